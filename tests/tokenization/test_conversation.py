"""Messages and tools are shaped like vLLM shapes them before rendering (so prompts match the engine's)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from extproc.errors import BadRequest
from extproc.tokenize import prepare_messages, prepare_tools


@pytest.mark.parametrize(
    ("content", "string_form", "openai_form"),
    [
        ("hi", "hi", [{"type": "text", "text": "hi"}]),
        (None, "", []),
        (
            [
                {"type": "text", "text": "a"},
                "b",
                {"type": "input_text", "text": "c"},
                {"type": "text", "text": None},
            ],
            "a\nb\nc",
            [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": "c"}],
        ),
        ([{"type": "refusal", "refusal": "no"}], "no", [{"type": "text", "text": "no"}]),
    ],
    ids=["string", "null", "parts", "refusal"],
)
def test_content_shapes(content: Any, string_form: str, openai_form: list[dict[str, str]]) -> None:
    """'string' format joins text parts with newlines; 'openai' format hands text parts over."""
    message = {"role": "user", "content": content}
    assert prepare_messages([message])[0]["content"] == string_form
    assert prepare_messages([message], content_format="openai")[0]["content"] == openai_form


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        ('{"city": "Paris"}', {"city": "Paris"}),
        ("", {}),
        ("not json", {}),
        ("[" * 100_000, {}),
        (None, {}),
        ({"a": 1}, {"a": 1}),
    ],
    ids=["json", "empty", "malformed", "nested-too-deep", "null", "already-object"],
)
def test_tool_call_arguments_become_objects(arguments: Any, parsed: Any) -> None:
    """Assistant tool-call arguments are parsed from JSON; empty or malformed ones become {}."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    before = copy.deepcopy(message)
    out = prepare_messages([message])[0]
    assert out["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": parsed}}
    ]
    assert message == before, "the request's messages must not be mutated"


def test_known_keys_only() -> None:
    """Only keys vLLM keeps survive: tool_call_id for tools, name, reasoning; empty tool_calls dropped."""
    messages: list[dict[str, Any]] = [
        {"role": "assistant", "content": "x", "tool_calls": [], "reasoning_content": "hmm", "extra": 1},
        {
            "role": "tool",
            "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}],
            "tool_call_id": "c",
        },
        {"role": "user", "content": "u", "name": "bob", "tool_call_id": "ignored"},
    ]
    assert prepare_messages(messages, content_format="openai") == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "x"}],
            "reasoning": "hmm",
            "reasoning_content": "hmm",
        },
        {"role": "tool", "content": "r1\nr2", "tool_call_id": "c"},
        {"role": "user", "content": [{"type": "text", "text": "u"}], "name": "bob"},
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("not a list", "messages"),
        ([{"content": "no role"}], "messages[0]"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content",
        ),
        ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], "messages[0].tool_calls"),
    ],
    ids=["not-a-list", "no-role", "bad-content", "image-part", "call-without-function"],
)
def test_malformed_messages_are_400(messages: Any, param: str) -> None:
    """Malformed messages are a BadRequest naming the field."""
    with pytest.raises(BadRequest) as info:
        prepare_messages(messages)
    assert info.value.param == param and info.value.status == 400


def test_tools_get_pydantic_defaults_in_order() -> None:
    """Tools look like vLLM's model_dump: declared fields first (unset ones null), then extras."""
    tools = [{"function": {"strict": True, "name": "f"}, "extra": "e"}]
    out = prepare_tools(tools)
    assert out == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": None, "strict": True},
            "extra": "e",
        }
    ]
    assert out is not None and list(out[0]["function"]) == ["name", "description", "parameters", "strict"]
    assert prepare_tools(None) is None


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([{"type": "function"}], "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"function": {"description": "no name"}}], "tools[0].function.name"),
    ],
    ids=["no-function", "wrong-type", "no-name"],
)
def test_malformed_tools_are_400(tools: Any, param: str) -> None:
    """Malformed tools are a BadRequest naming the field."""
    with pytest.raises(BadRequest) as info:
        prepare_tools(tools)
    assert info.value.param == param
