"""Shape OpenAI chat messages and tools the way vLLM does before it renders a chat template.

vLLM does not hand the request's ``messages`` to the template verbatim
(``vllm/entrypoints/chat_utils.py``): content becomes a ``"\\n"``-joined string or a list of text
parts depending on the template's content format, only known keys survive, an assistant's tool call
``arguments`` JSON string is parsed into an object, and ``tools`` go through pydantic (so missing
``description``/``parameters`` appear as null). Each of these changes the rendered prompt, so the
router must do the same to tokenize as the engine does. Text-only: image/audio parts are rejected.

Inputs are never mutated; the output is fresh dicts (tool-call objects included).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from extproc.errors import BadRequest
from extproc.tokenize.chat_template import ContentFormat

# Part types whose text vLLM keeps, and the key holding it.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def prepare_messages(
    messages: Sequence[Mapping[str, Any]], *, content_format: ContentFormat = "string"
) -> list[dict[str, Any]]:
    """The conversation vLLM passes to the template for these request ``messages``."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        raise BadRequest("messages must be a list of message objects", param="messages")
    return [_prepare_message(i, m, content_format) for i, m in enumerate(messages)]


def _prepare_message(index: int, message: Any, content_format: ContentFormat) -> dict[str, Any]:
    if (
        content_format == "string"
        and type(message) is dict
        and len(message) == 2
        and type(message.get("content")) is str
        and type(message.get("role")) is str
        and message["role"] != "developer"
    ):
        # Most of a long conversation: what the shaping below would build is an equal dict (the
        # template cannot change it: the sandbox is immutable).
        return message
    where = f"messages[{index}]"
    # dict first: the parsed JSON's type, and an ABC check costs a microsecond per message.
    is_mapping = type(message) is dict or isinstance(message, Mapping)
    if not is_mapping or not isinstance(message.get("role"), str):
        raise BadRequest(f"{where} must be an object with a string 'role'", param=where)
    role: str = message["role"]
    texts = _texts(message.get("content"), where)
    content: str | list[dict[str, str]] = "\n".join(texts)
    if content_format == "openai":
        content = [{"type": "text", "text": t} for t in texts]
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        # An empty list is dropped so templates take the plain assistant path.
        if calls is not None and (prepared := _tool_calls(calls, where)):
            out["tool_calls"] = prepared
        reasoning = message.get("reasoning", message.get("reasoning_content"))
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        # Most templates only handle string tool results; vLLM flattens text parts for them.
        out["content"] = "\n".join(texts)
    elif role == "developer":
        out["tools"] = message.get("tools")
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _texts(content: Any, where: str) -> list[str]:
    """The text pieces of a message's content (a string, null, or a list of parts)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BadRequest(
            f"{where}.content must be a string, null or a list of parts", param=f"{where}.content"
        )
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise BadRequest(
                f"{where}.content: unsupported content part type {kind!r} (this model takes text only)",
                param=f"{where}.content",
            )
        text = part.get(key)
        if text is None:
            continue  # vLLM skips text parts without text
        if not isinstance(text, str):
            raise BadRequest(f"{where}.content: part {key!r} must be a string", param=f"{where}.content")
        texts.append(text)
    return texts


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Copies of the tool calls with ``function.arguments`` parsed to an object, as vLLM does."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out: list[dict[str, Any]] = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            raise BadRequest(
                f"{where}.tool_calls: each call needs a 'function' object", param=f"{where}.tool_calls"
            )
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except (json.JSONDecodeError, RecursionError):
                # vLLM's rule: empty or malformed JSON renders as an empty object (nesting too deep
                # to decode is malformed here: it is refused rather than crash the request).
                function["arguments"] = {}
        elif not isinstance(arguments, dict | list):
            function["arguments"] = {}
        out.append({**call, "function": function})
    return out


def prepare_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the template.

    Declared fields come first in declaration order (``type``, ``function``; ``name``,
    ``description``, ``parameters``) with unset ones as None, then extra keys in request order.
    """
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise BadRequest("tools must be a list", param="tools")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or not isinstance(function, Mapping):
            raise BadRequest(f"{where} must be an object with a 'function' object", param=where)
        if tool.get("type", "function") != "function":
            raise BadRequest(f"{where}.type must be 'function'", param=f"{where}.type")
        if not isinstance(function.get("name"), str):
            raise BadRequest(f"{where}.function.name must be a string", param=f"{where}.function.name")
        fn: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        fn.update((k, v) for k, v in function.items() if k not in fn)
        entry: dict[str, Any] = {"type": "function", "function": fn}
        entry.update((k, v) for k, v in tool.items() if k not in entry)
        out.append(entry)
    return out
