"""Whether a prompt's opening recurs: a conversation's next turn does, one-off prompts do not."""

from __future__ import annotations

import random
import zlib
from typing import Any

import orjson
import pytest

from extproc.tokenize.openings import FIRST_CHECKPOINT, Openings, openings

SYSTEM = "You are a careful assistant. Answer from the documents given, and cite them. " * 20  # ~1.6 kB


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        rng.choice(("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega")) for _ in range(n)
    )


def body(messages: list[dict[str, Any]]) -> bytes:
    return orjson.dumps({"model": "llama", "messages": messages, "max_tokens": 64})


def test_a_conversations_next_turns_recur_from_the_second() -> None:
    rng = random.Random(1)
    seen = Openings()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": words(rng, 4000)}]
    assert not seen.recurs(body(messages))  # the first turn: nothing began like it
    for _ in range(5):
        messages += [
            {"role": "assistant", "content": words(rng, 200)},
            {"role": "user", "content": words(rng, 30)},
        ]
        assert seen.recurs(body(messages))


def test_one_off_prompts_sharing_a_system_prompt_do_not_recur() -> None:
    """Each shares ~1.6 kB of system prompt and nothing else: learning one teaches the next nothing."""
    rng = random.Random(2)
    seen = Openings()
    bodies = [
        body([{"role": "system", "content": SYSTEM}, {"role": "user", "content": words(rng, 3000)}])
        for _ in range(20)
    ]
    assert len({b[: len(SYSTEM)] for b in bodies}) == 1
    assert not any(seen.recurs(b) for b in bodies)
    assert seen.recurs(bodies[3])  # the same prompt again does


def test_a_shared_part_longer_than_half_the_prompt_recurs() -> None:
    """A system prompt that is most of every prompt is worth learning: it is what recurs."""
    rng = random.Random(3)
    long_system = SYSTEM * 10  # ~16 kB
    seen = Openings()
    first, second = (
        body([{"role": "system", "content": long_system}, {"role": "user", "content": words(rng, 100)}])
        for _ in range(2)
    )
    assert not seen.recurs(first)
    assert seen.recurs(second)


def test_a_prompt_too_short_to_judge_recurs() -> None:
    seen = Openings()
    assert seen.recurs(b"x" * (2 * FIRST_CHECKPOINT - 1))  # no checkpoint up to half of it
    assert seen.recurs(b"")
    assert not seen.recurs(b"y" * 2 * FIRST_CHECKPOINT)


@pytest.mark.parametrize("size", [0, FIRST_CHECKPOINT - 1, FIRST_CHECKPOINT, 5 * FIRST_CHECKPOINT, 100_000])
def test_each_opening_is_the_crc_of_the_bytes_up_to_its_checkpoint(size: int) -> None:
    data = random.Random(size).randbytes(size)
    found = openings(data)
    assert [c for c, _ in found] == [FIRST_CHECKPOINT << i for i in range(len(found))]
    assert all(crc == zlib.crc32(data[:checkpoint]) for checkpoint, crc in found)
    assert not found or found[-1][0] * 2 > size


def test_the_memory_is_bounded_and_forgets_the_oldest_first() -> None:
    rng = random.Random(4)
    seen = Openings(remembered=12)
    bodies = [rng.randbytes(4 * FIRST_CHECKPOINT) for _ in range(10)]  # 3 openings each
    for b in bodies:
        seen.recurs(b)
        assert len(seen) <= 12
    assert seen.recurs(bodies[-1])  # the newest are remembered
    assert not seen.recurs(bodies[0])  # the oldest were forgotten


def test_a_recurring_opening_is_kept_as_recent() -> None:
    rng = random.Random(5)
    seen = Openings(remembered=6)
    kept, *others = (rng.randbytes(4 * FIRST_CHECKPOINT) for _ in range(3))  # 3 openings each
    seen.recurs(kept)
    seen.recurs(others[0])
    assert seen.recurs(kept)  # seen again: now the most recent
    seen.recurs(others[1])  # evicts others[0]'s, not kept's
    assert seen.recurs(kept)


def test_remembering_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="remembered"):
        Openings(remembered=0)
