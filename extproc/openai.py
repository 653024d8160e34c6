"""OpenAI-style requests: read once into one typed :class:`InferenceRequest`, and the model rewrite.

This module is the only one that reads a request body. Everything downstream (scheduling, the
tokenizers, the prefix indexes, the simulator) consumes the typed request or one of its prompt
types, never the decoded dict.

Parsing is strict about the one field routing depends on (``model``) and tolerant of everything
else, which is passed through untouched: engines validate their own parameters. The prompt is
read only when someone needs its tokens (:meth:`InferenceRequest.read_prompt`): a prompt this
module cannot read the way the engine would (``messages`` not a list of objects, ``tools`` not a
list, ...) raises :class:`BadRequest` there, and the caller decides; the router routes such a
request approximately, so the engine answers the client itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote

import msgspec
import orjson

from extproc.errors import BadRequest

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"

#: Paths whose bodies carry ``model``; anything else with a body is routed the same way when it
#: does, and gets 400 when it does not (we never guess the model).
INFERENCE_PATHS = frozenset(
    {
        CHAT_PATH,
        COMPLETIONS_PATH,
        "/v1/embeddings",
        "/v1/responses",
        "/v1/score",
        "/v1/rerank",
        "/v1/audio/transcriptions",
    }
)

#: What a request asks for, as far as prompts go: chat messages, a completion prompt, or neither.
RequestKind = Literal["chat", "completion", "other"]


def normalize_path(raw: str) -> str:
    """``:path`` without its query string and trailing slashes: the form every check compares."""
    return raw.split("?", 1)[0].rstrip("/")


def model_in_path(path: str) -> str | None:
    """The name in ``/v1/models/{name}`` (percent-decoded), else None."""
    if not path.startswith(MODELS_PATH + "/"):
        return None
    return unquote(path.removeprefix(MODELS_PATH + "/"))


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's prompt fields, as vLLM's chat path reads them (types checked)."""

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    #: vLLM's chat default is False: the template already writes BOS.
    add_special_tokens: bool = False

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatPrompt:
        """Read the fields; :class:`BadRequest` names the one vLLM would refuse too."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of objects", param="messages")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise BadRequest("'tools' must be a list of objects", param="tools")
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        add_generation_prompt = flag(body, "add_generation_prompt", True)
        continue_final = flag(body, "continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return cls(
            messages=tuple(messages),
            tools=None if tools is None else tuple(tools),
            chat_template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            add_special_tokens=flag(body, "add_special_tokens", False),
        )


_TOKEN_IDS = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompletionPrompt:
    """A completions request's one prompt: text, or token ids (vocabulary not checked here)."""

    prompt: str | tuple[int, ...]

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> CompletionPrompt:
        """A prompt as vLLM accepts it: a string, a token-id list, or a batch of exactly one of those."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' must not be empty", param="prompt")
            return cls(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")
        if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
            raise BadRequest("one prompt per request is supported, got a batch", param="prompt")
        try:  # one C pass that checks and copies: a third of the time of a set of types, then a tuple
            return cls(msgspec.convert(prompt, _TOKEN_IDS))
        except msgspec.ValidationError as e:  # (bool is not int for msgspec either)
            message = f"'prompt' must be a string or a list of token ids: {e}"
            raise BadRequest(message, param="prompt") from None


Prompt = ChatPrompt | CompletionPrompt


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One request with a JSON body, as far as routing is concerned."""

    #: ``:path`` as :func:`normalize_path` leaves it.
    path: str
    kind: RequestKind
    model: str
    stream: bool
    #: ``max_completion_tokens`` or ``max_tokens`` when given (a positive int), else None.
    max_tokens: int | None
    #: The decoded body, for :meth:`read_prompt` and :func:`rewrite_model` only.
    payload: dict[str, Any] = field(repr=False)
    #: The body as it came (b"" when built from a decoded one), for tokenizing in another process.
    body: bytes = field(default=b"", repr=False)
    #: ``cache_salt``: the engines cache this prompt apart from every other salt (see
    #: :func:`cache_salt`); None when absent or empty.
    cache_salt: str | None = None
    #: :attr:`prefix_text` once computed, in a 1-tuple (its value may be None).
    _prefix_text: tuple[str | None] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def prefix_text(self) -> str | None:
        """The text approximate prefix affinity is computed from (see :func:`prefix_text`); None: none.

        Computed on first use: precise routing of a token-id prompt never needs it, and joining
        ~13k ids into text costs about a millisecond.
        """
        cached = self._prefix_text
        if cached is None:
            cached = (prefix_text(self.kind, self.payload),)
            object.__setattr__(self, "_prefix_text", cached)  # frozen: set once, like a cached property
        return cached[0]

    def read_prompt(self) -> Prompt | None:
        """The prompt, read the way the engine reads it; None for kinds without one.

        Raises :class:`BadRequest` naming the field the engine would refuse. Not done at parse time:
        only precise prefix matching needs it, and reading it costs about as much as the parse.
        """
        if self.kind == "chat":
            return ChatPrompt.from_body(self.payload)
        if self.kind == "completion":
            return CompletionPrompt.from_body(self.payload)
        return None


def parse_request(body: bytes, *, path: str) -> InferenceRequest:
    """Decode a JSON body sent to ``path`` (normalized); raise :class:`BadRequest` naming what is wrong."""
    if not body:
        raise BadRequest("request body is empty; expected a JSON object with a 'model' field")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    return read_request(path, payload, body=body)


def read_request(path: str, payload: object, *, body: bytes = b"") -> InferenceRequest:
    """The typed request from a decoded body sent to the (normalized) ``path``."""
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(payload).__name__}")
    model = payload.get("model")
    if model is None:
        raise BadRequest("request body has no 'model' field", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    kind: RequestKind = "chat" if path == CHAT_PATH else "completion" if path == COMPLETIONS_PATH else "other"
    return InferenceRequest(
        path=path,
        kind=kind,
        model=model,
        stream=payload.get("stream") is True,
        max_tokens=_max_tokens(payload),
        payload=payload,
        body=body,
        cache_salt=cache_salt(payload),
    )


def cache_salt(payload: Mapping[str, Any]) -> str | None:
    """The request's ``cache_salt`` as both engines key their caches by it; None for none.

    A string salts the prompt; ``""`` is no salt (SGLang reads it so; vLLM refuses it). SGLang also
    takes a list, one salt per prompt of a batched completion: the first prompt's, the one we route
    by. Anything else is the engine's to refuse, and routes as unsalted.
    """
    value = payload.get("cache_salt")
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, str) and value else None


def _max_tokens(payload: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = payload.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prefix_text(kind: RequestKind, payload: Mapping[str, Any]) -> str | None:
    """The text a prefix is made of: the completion prompt, or the chat messages in order.

    Tolerant: whatever the client sent, this returns text or None and never raises; judging the
    body is the engine's job. Any body with ``messages`` (not only chat) counts its messages.
    """
    if kind == "completion":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return " ".join(map(str, prompt))  # map: ~2x a generator on 10k-token prompts
        return None
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        content = message.get("content")
        if isinstance(content, list):
            texts = (p.get("text") for p in content if isinstance(p, dict))
            content = "".join(t for t in texts if isinstance(t, str))
        parts.append(f"<{message.get('role')}>{content if isinstance(content, str) else ''}")
    return "".join(parts)


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean request field; null means the default, anything else but a bool is a 400."""
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false, got {value!r}", param=key)
    return value


def rewrite_model(request: InferenceRequest, upstream_model: str, body: bytes) -> bytes:
    """``body`` (the request's raw bytes) with ``model`` replaced, every other field kept.

    Re-serializing the decoded body is the fast path. orjson reads up to 1,023 levels of nesting
    but writes only 254, so a deeper body (valid, and routed fine under its upstream name) has its
    top-level ``model`` value spliced in place instead, every other byte as the client sent it.
    """
    payload = dict(request.payload)
    payload["model"] = upstream_model
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:
        return splice_model(body, upstream_model)


#: JSON strings and brackets: enough to walk a document's nesting without decoding its values.
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_JSON_SPACE = b" \t\r\n"


def splice_model(body: bytes, upstream_model: str) -> bytes:
    """Replace the value of every top-level ``"model"`` member of a JSON object body (pure).

    The body must be valid JSON (it was decoded already): strings and brackets are the only tokens
    that matter for finding top-level members, so a regex pass finds them without recursion.
    """
    replacement = orjson.dumps(upstream_model)
    spans: list[tuple[int, int]] = []
    depth = 0
    key_is_model = False
    for token in _JSON_TOKENS.finditer(body):
        text = token.group()
        if text in (b"{", b"["):
            depth, key_is_model = depth + 1, False
        elif text in (b"}", b"]"):
            depth -= 1
        elif depth == 1:
            if key_is_model and _neighbour(body, token.start() - 1, -1) == b":":
                spans.append(token.span())  # the value of a "model" key
                key_is_model = False
            elif _neighbour(body, token.end(), 1) == b":":
                key_is_model = orjson.loads(text) == "model"
    for start, end in reversed(spans):
        body = body[:start] + replacement + body[end:]
    return body


def _neighbour(body: bytes, at: int, step: int) -> bytes:
    """The first byte from ``at`` in direction ``step`` that is not JSON white space (b"" if none)."""
    while 0 <= at < len(body) and body[at] in _JSON_SPACE:
        at += step
    return body[at : at + 1] if 0 <= at < len(body) else b""


def models_list(entries: list[tuple[str, str]]) -> bytes:
    """``GET /v1/models`` in OpenAI's list format from (client name, upstream name) pairs."""
    return orjson.dumps({"object": "list", "data": [model_object(n, u) for n, u in entries]})


def model_response(name: str, upstream: str) -> bytes:
    """``GET /v1/models/{name}``: one model object."""
    return orjson.dumps(model_object(name, upstream))


def model_object(name: str, upstream: str) -> dict[str, Any]:
    # ``root`` follows vLLM: the upstream model an alias stands for.
    return {"id": name, "object": "model", "created": 0, "owned_by": "extproc", "root": upstream}


def error_body(message: str, *, error_type: str, code: str, param: str | None = None) -> bytes:
    """An error in OpenAI's shape, so SDKs surface the message instead of a parse failure."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})
