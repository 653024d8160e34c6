"""Approximate prefix affinity: chunk keys, matching leading chunks, LRU bound, forgetting."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from extproc.kvindex.approx import (
    CHARS_PER_BLOCK,
    CHARS_PER_TOKEN,
    ApproxPrefixIndex,
    text_keys,
)
from extproc.types import EndpointAddress

A = EndpointAddress("10.0.0.1:8000")
B = EndpointAddress("10.0.0.2:8000")
C = EndpointAddress("10.0.0.3:8000")
MODEL = "llama"
TOKENS_PER_BLOCK = CHARS_PER_BLOCK // CHARS_PER_TOKEN
#: Eight distinct full chunks.
TEXT = "".join(f"chunk {i} ".ljust(CHARS_PER_BLOCK, chr(ord("a") + i)) for i in range(8))


@pytest.mark.parametrize(
    ("length", "max_blocks", "expected"),
    [
        (0, 10, 0),
        (CHARS_PER_BLOCK - 1, 10, 0),
        (CHARS_PER_BLOCK, 10, 1),
        (3 * CHARS_PER_BLOCK + 10, 10, 3),
        (8 * CHARS_PER_BLOCK, 5, 5),
        (8 * CHARS_PER_BLOCK, 1, 1),
    ],
    ids=["empty", "under-one-chunk", "one-chunk", "partial-tail-ignored", "capped", "capped-to-one"],
)
def test_text_keys_cover_full_chunks_only(length: int, max_blocks: int, expected: int) -> None:
    """One key per full chunk up to ``max_blocks``; a prefix of the text has a prefix of the keys."""
    keys = text_keys(TEXT[:length], namespace=MODEL, max_blocks=max_blocks)
    assert len(keys) == expected
    assert keys == text_keys(TEXT, namespace=MODEL, max_blocks=100)[:expected]


def test_text_keys_are_chained_and_namespaced() -> None:
    """A changed chunk changes its key and every later one; another namespace shares no key."""
    keys = text_keys(TEXT, namespace=MODEL, max_blocks=100)
    edited = TEXT[: 2 * CHARS_PER_BLOCK] + "X" + TEXT[2 * CHARS_PER_BLOCK + 1 :]
    edited_keys = text_keys(edited, namespace=MODEL, max_blocks=100)
    assert edited_keys[:2] == keys[:2]
    assert not set(edited_keys[2:]) & set(keys)
    assert not set(text_keys(TEXT, namespace="qwen", max_blocks=100)) & set(keys)
    assert len(set(keys)) == len(keys) == 8


def test_match_counts_leading_chunks_in_approximate_tokens() -> None:
    """Each endpoint is credited with the leading chunks it was sent, in tokens; others get 0."""
    index = ApproxPrefixIndex()
    keys = index.keys(TEXT, MODEL)
    index.record(keys[:6], A)
    index.record(keys[:2], B)
    assert index.match(keys, [A, B, C]) == {
        A: 6 * TOKENS_PER_BLOCK,
        B: 2 * TOKENS_PER_BLOCK,
        C: 0,
    }
    assert index.match(keys[:4], [A, B]) == {A: 4 * TOKENS_PER_BLOCK, B: 2 * TOKENS_PER_BLOCK}
    assert index.match(keys, [B]) == {B: 2 * TOKENS_PER_BLOCK}
    assert index.match([], [A, B]) == {A: 0, B: 0}
    assert index.match(keys, []) == {}


def test_holders_names_only_endpoints_of_the_pool_that_were_sent_the_prompt() -> None:
    """The request path's lookup leaves out endpoints sent nothing of the prompt, and holders
    outside the pool asked about (another model's endpoints)."""
    index = ApproxPrefixIndex()
    keys = index.keys(TEXT, MODEL)
    index.record(keys[:6], A)
    index.record(keys[:2], B)
    index.record(keys[:3], C)
    assert index.holders(keys, frozenset({A, B})) == {A: 6 * TOKENS_PER_BLOCK, B: 2 * TOKENS_PER_BLOCK}
    assert index.holders(keys[1:], frozenset({A, C})) == {A: 5 * TOKENS_PER_BLOCK, C: 2 * TOKENS_PER_BLOCK}
    assert index.holders(keys, frozenset()) == {}
    assert index.holders([], frozenset({A})) == {}


def test_match_stops_at_the_first_missing_chunk() -> None:
    """Chunks after a chunk the endpoint was never sent do not count."""
    index = ApproxPrefixIndex()
    keys = index.keys(TEXT, MODEL)
    index.record([keys[0], keys[1], keys[3], keys[4]], A)
    index.record(keys[1:5], B)
    assert index.match(keys, [A, B]) == {A: 2 * TOKENS_PER_BLOCK, B: 0}


def test_another_namespace_matches_nothing() -> None:
    """What was learned for one model is not credited to a request for another."""
    index = ApproxPrefixIndex()
    index.record(index.keys(TEXT, MODEL), A)
    assert index.match(index.keys(TEXT, "qwen"), [A]) == {A: 0}


def test_keys_are_capped_per_request() -> None:
    """``max_blocks_per_request`` bounds the keys a request makes (and so what one request records)."""
    index = ApproxPrefixIndex(max_blocks_per_request=3)
    keys = index.keys(TEXT, MODEL)
    assert keys == text_keys(TEXT, namespace=MODEL, max_blocks=3)
    index.record(keys, A)
    assert len(index) == 3
    assert index.match(index.keys(TEXT, MODEL), [A]) == {A: 3 * TOKENS_PER_BLOCK}


def test_record_is_bounded_in_two_generations() -> None:
    """Keys not recorded again within two generations (``max_entries // 2`` keys each) go; recording
    a key again keeps it; the index never holds more than ``max_entries``."""
    index = ApproxPrefixIndex(max_entries=4)
    keys = index.keys(TEXT, MODEL)
    index.record(keys[0:1], A)
    index.record(keys[1:2], A)  # the first generation is full: it grows old
    index.record(keys[0:1], B)  # keys[0] recorded again: young again (and sent to B too)
    index.record(keys[2:3], A)  # the second is full: the first goes, with keys[1] only
    assert len(index) == 2
    assert index.match(keys[0:1], [A, B]) == {A: TOKENS_PER_BLOCK, B: TOKENS_PER_BLOCK}
    assert index.match(keys[1:2], [A]) == {A: 0}
    assert index.match(keys[2:3], [A]) == {A: TOKENS_PER_BLOCK}
    index.record(keys[3:4], A)
    assert index.match(keys[3:4], [A]) == {A: TOKENS_PER_BLOCK}
    for i in range(50):
        index.record(index.keys(f"{i:04d}".ljust(4 * CHARS_PER_BLOCK, "."), MODEL), C)
        assert len(index) <= 4


def test_a_long_prompt_spans_generations() -> None:
    """A prompt with more chunks than a generation holds still matches whole right after it is
    recorded: its first chunks are in the old generation, the rest in the young one."""
    index = ApproxPrefixIndex(max_entries=6)
    keys = index.keys(TEXT, MODEL)[:5]
    index.record(keys, A)
    assert len(index) == 5
    assert index.match(keys, [A, B]) == {A: 5 * TOKENS_PER_BLOCK, B: 0}


def test_a_full_index_holds_no_set_per_key() -> None:
    """Keys recorded to the same endpoints share one holder set: a full index costs its keys and
    little more (~140 bytes a key, where a set each cost ~360), and adds nothing per key for the
    cyclic collector to walk on every full collection (a stall of the event loop)."""
    rng = random.Random(1)
    index = ApproxPrefixIndex(max_entries=100_000)
    gc.collect()
    objects = len(gc.get_objects())
    tracemalloc.start()
    try:
        for request in range(100):
            keys = [rng.getrandbits(60) for _ in range(500)]
            index.record(keys, (A, B, C)[request % 3])
            index.record(keys[:100], B)  # a prefix some requests also sent to B
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index) == 50_000  # the young generation has just grown old
    assert len(gc.get_objects()) - objects < 100
    assert used / len(index) < 200
    # Sharing changes nothing a match sees.
    assert index.match(keys, [A, B, C])[B] == 100 * TOKENS_PER_BLOCK


def test_forget_drops_departed_endpoints() -> None:
    """Endpoints not kept lose their credit; chunks only they held are freed."""
    index = ApproxPrefixIndex()
    keys = index.keys(TEXT, MODEL)
    index.record(keys[:4], A)
    index.record(keys, B)
    index.forget([A, C])
    assert index.match(keys, [A, B]) == {A: 4 * TOKENS_PER_BLOCK, B: 0}
    assert len(index) == 4
    index.forget([])
    assert len(index) == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"max_entries": 0}, {"max_blocks_per_request": 0}],
    ids=["no-entries", "no-blocks"],
)
def test_bounds_must_be_positive(kwargs: dict[str, int]) -> None:
    """An index that could hold nothing is a configuration error."""
    with pytest.raises(ValueError, match="must be >= 1"):
        ApproxPrefixIndex(**kwargs)
