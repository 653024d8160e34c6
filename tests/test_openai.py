"""The typed request: read once from the body, tolerant of what only the engine judges."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from extproc.errors import BadRequest
from extproc.openai import (
    ChatPrompt,
    CompletionPrompt,
    model_in_path,
    normalize_path,
    parse_request,
    read_request,
    rewrite_model,
    splice_model,
)

PARTS = [{"type": "text", "text": "Look "}, {"type": "image_url"}, {"text": "here"}]


def prefix_text_of(path: str, payload: dict[str, Any]) -> str | None:
    return read_request(path, {"model": "m", **payload}).prefix_text


@pytest.mark.parametrize(
    ("path", "payload", "expected"),
    [
        ("/v1/completions", {"prompt": "Once upon a time"}, "Once upon a time"),
        ("/v1/completions", {"prompt": [101, 7, 42]}, "101 7 42"),
        ("/v1/completions", {"prompt": ["Once upon a time"]}, "Once upon a time"),
        ("/v1/completions", {"prompt": [[101, 7, 42]]}, "101 7 42"),
        ("/v1/completions", {"prompt": None}, None),
        ("/v1/completions", {"messages": [{"role": "user", "content": "hi"}]}, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
            "<system>Be brief.<user>Hi",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": PARTS}]},
            "<user>Look here",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
            "<user>Hi<assistant>",
        ),
        ("/v1/chat/completions", {"messages": "Hi"}, None),
        ("/v1/chat/completions", {"messages": ["Hi"]}, None),
        ("/v1/embeddings", {"input": "Hi"}, None),
    ],
    ids=[
        "completion-string",
        "completion-token-ids",
        "completion-batch-of-one-string",
        "completion-batch-of-one-token-list",
        "completion-no-prompt",
        "completion-path-ignores-messages",
        "chat-string-content",
        "chat-content-parts",
        "chat-null-content",
        "chat-messages-not-a-list",
        "chat-message-not-an-object",
        "embeddings",
    ],
)
def test_prefix_text(path: str, payload: dict[str, Any], expected: str | None) -> None:
    """The completion prompt or the chat messages in order (role-tagged); None when there is no prompt."""
    assert prefix_text_of(path, payload) == expected


def test_prefix_text_single_token_prompt() -> None:
    """A one-token id prompt is a prompt (as ``[[5]]`` is), not "no prompt"."""
    assert prefix_text_of("/v1/completions", {"prompt": [[5]]}) == "5"
    assert prefix_text_of("/v1/completions", {"prompt": [5]}) == "5"


@pytest.mark.parametrize("text", [None, 5, ["a"]], ids=["null", "number", "list"])
def test_prefix_text_tolerates_non_string_text_parts(text: Any) -> None:
    """A malformed text part (the engine's 400 to give) does not crash prompt extraction."""
    parts = [{"type": "text", "text": text}, {"type": "text", "text": "ok"}]
    result = prefix_text_of("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert result is None or isinstance(result, str)


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/chat/completions/", "/v1/chat/completions"),
        ("/v1/completions?api-version=1", "/v1/completions"),
        ("/v1/models/a%2Fb/?x=1", "/v1/models/a%2Fb"),
        ("", ""),
    ],
    ids=["plain", "trailing-slash", "query", "both", "empty"],
)
def test_paths_are_normalized_once(raw: str, path: str) -> None:
    """Query strings and trailing slashes never change what a path means."""
    assert normalize_path(raw) == path


def test_model_in_path_is_percent_decoded() -> None:
    """``/v1/models/{name}`` names a model, percent-decoded; other paths name none."""
    assert model_in_path("/v1/models/org%2Fllama") == "org/llama"
    assert model_in_path("/v1/models") is None
    assert model_in_path("/v1/chat/completions") is None


def test_chat_request_is_typed() -> None:
    """A chat body yields its kind, flags and prompt fields, read once."""
    body = {
        "model": "chat",
        "stream": True,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": None,
    }
    request = parse_request(orjson.dumps(body), path="/v1/chat/completions")
    assert (request.kind, request.model, request.stream, request.max_tokens) == ("chat", "chat", True, 64)
    assert request.read_prompt() == ChatPrompt(
        messages=({"role": "user", "content": "Hi"},),
        tools=({"type": "function", "function": {"name": "f"}},),
        chat_template_kwargs={"enable_thinking": False},
    )
    assert request.prefix_text == "<user>Hi"


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("Hello", "Hello"), ([1, 2, 3], (1, 2, 3)), (["Hello"], "Hello"), ([[4, 5]], (4, 5))],
    ids=["text", "ids", "batch-of-one-text", "batch-of-one-ids"],
)
def test_completion_prompt_is_typed(prompt: Any, expected: str | tuple[int, ...]) -> None:
    """A completions prompt is text or token ids, a batch of one unwrapped."""
    request = read_request("/v1/completions", {"model": "m", "prompt": prompt})
    assert request.kind == "completion" and request.read_prompt() == CompletionPrompt(expected)


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "'messages' must be a non-empty list"),
        ("/v1/chat/completions", {"messages": [{}], "tools": {}}, "'tools' must be a list"),
        ("/v1/chat/completions", {"messages": [{}], "chat_template_kwargs": 1}, "'chat_template_kwargs'"),
        ("/v1/chat/completions", {"messages": [{}], "add_generation_prompt": "yes"}, "true or false"),
        (
            "/v1/chat/completions",
            {"messages": [{}], "continue_final_message": True},
            "Cannot set both",
        ),
        ("/v1/completions", {"prompt": ""}, "must not be empty"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "got a batch"),
        ("/v1/completions", {"prompt": 5}, "a string or a list of token ids"),
    ],
    ids=[
        "no-messages",
        "message-not-object",
        "tools-not-list",
        "kwargs-not-object",
        "flag-not-bool",
        "both-flags",
        "empty-prompt",
        "batch",
        "number",
    ],
)
def test_unreadable_prompts_are_bad_requests_only_when_read(
    path: str, body: dict[str, Any], error: str
) -> None:
    """The request parses (routing needs only the model); reading its prompt names the bad field."""
    request = read_request(path, {"model": "m", **body})
    assert request.model == "m"
    with pytest.raises(BadRequest, match=re.escape(error)):
        request.read_prompt()


@pytest.mark.parametrize(
    ("salt", "expected"),
    [
        ("tenant-a", "tenant-a"),
        ("", None),
        (["tenant-b", "tenant-c"], "tenant-b"),
        ([], None),
        (7, None),
        (None, None),
    ],
)
def test_cache_salt_is_read_as_the_engines_read_it(salt: Any, expected: str | None) -> None:
    """A string salts; an empty one does not; a batched completion's list gives its first prompt's."""
    payload = {"model": "m", "prompt": "hello", **({} if salt is None else {"cache_salt": salt})}
    assert read_request("/v1/completions", payload).cache_salt == expected


def test_other_paths_have_no_prompt() -> None:
    """Embeddings and the like are routed by model; messages still give approximate text."""
    request = read_request("/v1/embeddings", {"model": "m", "input": "x"})
    assert (request.kind, request.read_prompt(), request.prefix_text) == ("other", None, None)
    with_messages = read_request(
        "/v1/embeddings", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    assert with_messages.prefix_text == "<user>x"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"", "request body is empty"),
        (b"{", "not valid JSON"),
        (b"[1]", "must be a JSON object, got list"),
        (b"{}", "has no 'model' field"),
        (b'{"model": 5}', "'model' must be a non-empty string"),
        (b'{"model": ""}', "'model' must be a non-empty string"),
    ],
    ids=["empty", "not-json", "not-object", "no-model", "model-number", "model-empty"],
)
def test_bad_bodies_are_400s_naming_the_problem(body: bytes, error: str) -> None:
    """Only what routing needs is strict: the body itself and its model."""
    with pytest.raises(BadRequest, match=error):
        parse_request(body, path="/v1/chat/completions")


def test_rewrite_keeps_every_other_field() -> None:
    """The alias rewrite changes ``model`` and nothing else."""
    body = {"model": "chat", "messages": [{"role": "user", "content": "é"}], "x": {"y": [1, None]}}
    request = read_request("/v1/chat/completions", body)
    rewritten = rewrite_model(request, "meta/llama", orjson.dumps(body))
    assert orjson.loads(rewritten) == {**body, "model": "meta/llama"}


@pytest.mark.parametrize("depth", [254, 300, 1000], ids=["orjson-limit", "past-it", "near-the-read-limit"])
def test_rewrite_of_deeply_nested_bodies(depth: int) -> None:
    """A body orjson can read but not write (255-1023 levels) is rewritten in place, not a 500."""
    raw = b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * depth
    raw += b"]" * depth + b"}"
    request = parse_request(raw, path="/v1/chat/completions")
    rewritten = rewrite_model(request, "meta/llama", raw)
    decoded = orjson.loads(rewritten)
    assert decoded["model"] == "meta/llama" and decoded["messages"] == request.payload["messages"]
    assert rewritten.replace(b'"meta/llama"', b'"chat"') == raw  # every other byte as sent


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"model":"a"}', b'{"model":"up"}'),
        (b'{ "model" :\n "a" , "n": 1}', b'{ "model" :\n "up" , "n": 1}'),
        (b'{"x": {"model": "inner"}, "model": "a"}', b'{"x": {"model": "inner"}, "model": "up"}'),
        (
            b'{"s": "say \\"model\\": \\"no\\"", "model": "a"}',
            b'{"s": "say \\"model\\": \\"no\\"", "model": "up"}',
        ),
        (b'{"model": 5, "x": "model", "model": "a"}', b'{"model": 5, "x": "model", "model": "up"}'),
        (b'{"model": "a", "model": "b"}', b'{"model": "up", "model": "up"}'),
        (b'{"mod\\u0065l": "a"}', b'{"mod\\u0065l": "up"}'),
    ],
    ids=[
        "plain",
        "white-space",
        "nested-untouched",
        "in-a-string",
        "non-string-earlier",
        "duplicates",
        "escaped-key",
    ],
)
def test_splice_replaces_only_top_level_model_values(raw: bytes, expected: bytes) -> None:
    """Only the top-level "model" members' string values change, however the JSON is spelled."""
    assert splice_model(raw, "up") == expected
