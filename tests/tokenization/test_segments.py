"""Incremental encoding gives exactly the ids of whole-prompt encoding, with real vocabularies.

Differential: random conversations (system prompts, tools, multi-part content, unicode, whitespace
and added tokens written into the text) are rendered with each tokenizer's own template, then
encoded whole by the library and piece by piece through the cache, cold and warm.
"""

from __future__ import annotations

import gc
import random
import re
from typing import Any

import pytest
from real_tokenizers import real_tokenizer

from extproc.openai import ChatPrompt
from extproc.tokenize.prompts import chat_prompt_ids, chat_prompt_text
from extproc.tokenize.segments import SegmentCache, segment_ids, splitter_for
from extproc.tokenize.shipped import shipped_chat_template
from extproc.tokenize.tokenizer import Tokenizer

TOKENIZERS = ["llama3", "qwen3", "tiny"]
_TEXT = [
    "hello",
    " world",
    "  spaced  ",
    "\n\n",
    "\t",
    "émigré café",
    "日本語のテキスト",
    "emoji 🚀🔥",
    "NFC e\u0301",  # a combining accent: Qwen's NFC normalizer composes it
    "code: def f(x):\n    return x",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    " <|eot_id|> ",
    "<think>",
    "</tool_call>",
    "<|begin_of_text|>",
    "1234567",
    "'s 're",
]


def load(name: str) -> Tokenizer:
    return Tokenizer.from_dir(real_tokenizer(name)) if name != "tiny" else Tokenizer.from_dir(_tiny_dir())


def _tiny_dir() -> Any:
    from extproc.tokenize.shipped import shipped_tokenizer_dir

    return shipped_tokenizer_dir()


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(_TEXT) for _ in range(rng.randrange(1, 12)))


def random_conversation(rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": random_text(rng)})
    for turn in range(rng.randrange(1, 6)):
        if rng.random() < 0.3:
            parts = [{"type": "text", "text": random_text(rng)} for _ in range(rng.randrange(1, 4))]
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": random_text(rng)})
        if turn < 4:
            messages.append({"role": "assistant", "content": random_text(rng)})
    body: dict[str, Any] = {"model": "m", "messages": messages}
    if rng.random() < 0.3:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": "lookup", "description": random_text(rng), "parameters": {}},
            }
        ]
    return body


def template_for(name: str, tokenizer: Tokenizer) -> Any:
    if name == "tiny":
        return shipped_chat_template("llama3")
    template = tokenizer.get_chat_template()
    assert template is not None
    return template


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_real_tokenizers_allow_incremental_encoding(name: str) -> None:
    """Their added tokens match literally, so the cache applies (else it would silently not)."""
    assert splitter_for(load(name)._backend) is not None


@pytest.mark.parametrize("name", TOKENIZERS)
def test_incremental_ids_equal_whole_prompt_ids(name: str) -> None:
    whole = load(name)
    cached = load(name)
    assert cached.enable_segment_cache(1 << 20)
    template = template_for(name, whole)
    rng = random.Random(f"segments-{name}")
    for _ in range(150):
        body = random_conversation(rng)
        prompt = ChatPrompt.from_body(body)
        expected_text_ids = chat_prompt_ids(prompt, whole, template)
        # The library on the whole rendered text, not our encode (which may take the batch path).
        assert chat_prompt_ids(prompt, cached, template) == expected_text_ids  # cold
        assert chat_prompt_ids(prompt, cached, template) == expected_text_ids  # warm
    assert cached.segment_cache is not None and cached.segment_cache.stats.hits > 0


@pytest.mark.parametrize("name", TOKENIZERS)
def test_raw_text_with_added_tokens_and_whitespace(name: str) -> None:
    tokenizer = load(name)
    splitter = splitter_for(tokenizer._backend)
    assert splitter is not None
    cache = SegmentCache(1 << 20)
    rng = random.Random(f"raw-{name}")

    def batch(pieces: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer._backend.encode_batch(pieces, add_special_tokens=False)]

    for _ in range(300):
        text = random_text(rng) * rng.randrange(1, 4)
        expected = tokenizer._backend.encode(text, add_special_tokens=False).ids
        assert cache.encode(splitter, text, batch) == expected, text


def test_a_conversations_next_turn_encodes_only_what_is_new() -> None:
    tokenizer = load("llama3")
    whole = load("llama3")
    assert tokenizer.enable_segment_cache(1 << 24)
    template = template_for("llama3", tokenizer)
    history = [{"role": "system", "content": "policy " * 2000}, {"role": "user", "content": "first question"}]
    chat_prompt_ids(ChatPrompt.from_body({"model": "m", "messages": history}), tokenizer, template)
    history += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second question"}]
    prompt = ChatPrompt.from_body({"model": "m", "messages": history})
    plan = tokenizer.plan_encode(chat_prompt_text(prompt, tokenizer, template))
    assert plan is not None
    # The long system prompt and the first question are known; only what follows is encoded.
    assert sum(len(segment_ids(segment)) for segment in plan.known) > 2000
    assert 0 < plan.new_chars < 100
    path = plan.finish(plan.encode())
    assert path.ids().tolist() == chat_prompt_ids(prompt, whole, template)
    # Once more: the whole prompt is known, nothing is encoded.
    again = tokenizer.plan_encode(chat_prompt_text(prompt, tokenizer, template))
    assert again is not None and again.new == [] and again.new_chars == 0


def test_a_shared_prefix_is_one_path_whatever_follows() -> None:
    """Two conversations on one system prompt share its segment; their next segments differ."""
    tokenizer = load("llama3")
    assert tokenizer.enable_segment_cache(1 << 24)
    template = template_for("llama3", tokenizer)
    system = {"role": "system", "content": "shared instructions " * 500}
    paths = []
    for question in ("one", "two"):
        prompt = ChatPrompt.from_body(
            {"model": "m", "messages": [system, {"role": "user", "content": question}]}
        )
        plan = tokenizer.plan_encode(chat_prompt_text(prompt, tokenizer, template))
        assert plan is not None
        paths.append(plan.finish(plan.encode()))
    first, second = (p.segments for p in paths)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a is not b)
    assert sum(len(segment_ids(segment)) for segment in first[:shared]) > 1000  # the instructions, once
    assert segment_ids(first[shared]).tolist() != segment_ids(second[shared]).tolist()


def test_the_cache_stays_within_its_byte_budget() -> None:
    tokenizer = load("llama3")
    splitter = splitter_for(tokenizer._backend)
    assert splitter is not None
    cache = SegmentCache(64 * 1024)

    def batch(pieces: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer._backend.encode_batch(pieces, add_special_tokens=False)]

    for i in range(500):
        cache.encode(splitter, f"document {i}: " + "words and more words " * 40 + "<|eot_id|>", batch)
    assert 0 < cache.bytes <= 64 * 1024
    assert cache.stats.evictions > 0 and len(cache) < 500


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_trie_pattern_finds_what_the_flat_alternation_finds(name: str) -> None:
    """Longest added token first at each position, like the library: proven against the plain
    longest-first alternation on texts dense with added tokens and their prefixes."""
    tokenizer = load(name)
    splitter = splitter_for(tokenizer._backend)
    assert splitter is not None
    words = sorted(splitter.ids, key=len, reverse=True)
    flat = re.compile("(" + "|".join(re.escape(w) for w in words) + ")")
    rng = random.Random(f"trie-{name}")
    fragments = [*words, *(w[: rng.randrange(1, len(w) + 1)] for w in words), "x", " ", "|", "<"]
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randrange(1, 30)))
        assert splitter.capture.split(text) == flat.split(text), text
        assert "".join(splitter.segments(text)) == text


def test_remembered_segments_cost_full_collections_nothing() -> None:
    """Once collected, the tree's segments are no longer tracked by the cyclic garbage collector,
    so its full collections (which stop the whole process) do not walk them."""
    tokenizer = load("llama3")
    assert tokenizer.enable_segment_cache(1 << 22)
    template = template_for("llama3", tokenizer)
    messages = [{"role": "system", "content": "rules " * 300}]
    for turn in range(20):
        messages += [{"role": "user", "content": f"q{turn}"}, {"role": "assistant", "content": f"a{turn}"}]
    text = chat_prompt_text(ChatPrompt.from_body({"messages": messages}), tokenizer, template)
    plan = tokenizer.plan_encode(text)
    assert plan is not None
    path = plan.finish(plan.encode())
    gc.collect()
    assert len(path.segments) > 20
    assert not any(gc.is_tracked(segment) for segment in path.segments)
