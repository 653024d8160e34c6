"""OpenAI response bodies and SSE chunks, shaped like vLLM's.

Pure: the HTTP layer feeds generated text and counts in, and gets JSON-ready dicts or SSE bytes
out. Chat streams open with an assistant-role delta, carry one content delta per engine step,
close with ``finish_reason``, then (when ``stream_options.include_usage``) a chunk with empty
``choices`` and the usage, then ``data: [DONE]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

Kind = Literal["chat", "completion"]

SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: Prompt tokens served from the prefix cache; None unless the server reports it.
    cached_tokens: int | None = None

    def as_json(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": None,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every body or chunk of one response repeats."""

    kind: Kind
    request_id: str
    model: str
    created: int

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _base(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}


def full_response(head: ResponseHead, text: str, finish_reason: str, usage: Usage) -> dict[str, Any]:
    """A non-streaming answer."""
    choice: dict[str, Any]
    if head.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
    return {**head._base(head.object_name), "choices": [choice], "usage": usage.as_json()}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def role_chunk(head: ResponseHead) -> bytes | None:
    """The opening chat delta with the assistant role (completions have none)."""
    if head.kind != "chat":
        return None
    delta = {"role": "assistant", "content": ""}
    return sse(_chunk(head, delta=delta, text=None, finish_reason=None))


def text_chunk(head: ResponseHead, text: str, finish_reason: str | None = None) -> bytes:
    return sse(_chunk(head, delta={"content": text}, text=text, finish_reason=finish_reason))


def usage_chunk(head: ResponseHead, usage: Usage) -> bytes:
    return sse({**head._base(head.chunk_object_name), "choices": [], "usage": usage.as_json()})


def _chunk(
    head: ResponseHead, *, delta: dict[str, Any], text: str | None, finish_reason: str | None
) -> dict[str, Any]:
    choice: dict[str, Any]
    if head.kind == "chat":
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = None
    return {**head._base(head.chunk_object_name), "choices": [choice]}
