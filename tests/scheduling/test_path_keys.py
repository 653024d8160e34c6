"""Block keys remembered on the segment tree equal the keys of the whole prompt's ids."""

from __future__ import annotations

import random

import pytest
from tokenization.test_segments import load, random_conversation, template_for

from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.openai import ChatPrompt
from extproc.scheduling.path_keys import path_block_keys
from extproc.tokenize.prompts import chat_prompt_ids, chat_prompt_text
from extproc.tokenize.segments import SegmentPath
from extproc.tokenize.tokenizer import Tokenizer


def walk(tokenizer: Tokenizer, prompt: ChatPrompt, template: object, *, here: bool = False) -> SegmentPath:
    plan = tokenizer.plan_encode(chat_prompt_text(prompt, tokenizer, template))  # type: ignore[arg-type]
    assert plan is not None
    return plan.finish(plan.encode(here=here))


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_remembered_keys_equal_the_whole_prompts_keys(name: str) -> None:
    tokenizer, whole = load(name), load(name)
    assert tokenizer.enable_segment_cache(1 << 22)
    template = template_for(name, whole)
    rng = random.Random(f"path-keys-{name}")
    seeds = [namespace_seed("m"), namespace_seed("m", "salt")]
    history: list[dict[str, object]] = []
    for _ in range(60):
        # Half the time the conversation goes on (known prefix), else a new random one starts.
        if rng.random() < 0.5 or not history:
            history = list(random_conversation(rng)["messages"])
        else:
            history += [{"role": "assistant", "content": "ok " * rng.randrange(1, 40)}]
            history += [{"role": "user", "content": "more " * rng.randrange(1, 40)}]
        prompt = ChatPrompt.from_body({"model": "m", "messages": history})
        expected_ids = chat_prompt_ids(prompt, whole, template)
        for here in (rng.random() < 0.5, False):  # cold (encoded either way), then remembered
            path = walk(tokenizer, prompt, template, here=here)
            assert path.ids().tolist() == expected_ids
            assert len(path) == len(expected_ids) and list(path) == expected_ids
            for seed in seeds:
                for block_size in (1, 7, 16):
                    got = path_block_keys(path, block_size, seed).tolist()
                    assert got == block_keys(expected_ids, block_size, seed)


def test_remembered_keys_count_against_the_budget_and_go_with_their_segment() -> None:
    tokenizer = load("llama3")
    assert tokenizer.enable_segment_cache(256 * 1024)
    cache = tokenizer.segment_cache
    assert cache is not None
    template = template_for("llama3", tokenizer)
    for i in range(200):
        messages = [{"role": "user", "content": f"document {i}: " + "words and more words " * 60}]
        path = walk(tokenizer, ChatPrompt.from_body({"model": "m", "messages": messages}), template)
        before = cache.bytes
        path_block_keys(path, 16, namespace_seed("m"))
        assert cache.bytes > before or cache.stats.evictions > 0
        assert cache.bytes <= cache.max_bytes
    assert cache.stats.evictions > 0
