"""The replay benchmark's pure trace parts: prompts are deterministic, the upper bound is exact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

# The benchmarks are not an installed package: import them from the repo root. (No __init__.py here:
# pytest would name this folder's package ``bench`` and shadow the real one.)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.replay.rows import TraceFormatError
from bench.replay.trace import (
    TRACE_BLOCK,
    TraceRequest,
    block_lengths,
    block_tokens,
    load,
    pooled_lru,
    prompt_tokens,
    upper_bound,
)

VOCAB = 1000


def req(index: int, input_length: int, *hash_ids: int) -> TraceRequest:
    return TraceRequest(index, float(index), input_length, 10, tuple(hash_ids))


def test_expansion_is_deterministic_and_shares_prefixes() -> None:
    """Same ids -> same tokens in any request; lengths exact; ids in the vocabulary."""
    a = prompt_tokens(req(0, 1200, 7, 8, 9), VOCAB)
    b = prompt_tokens(req(5, 1100, 7, 8, 4), VOCAB)
    assert len(a) == 1200 and len(b) == 1100
    assert a[: 2 * TRACE_BLOCK] == b[: 2 * TRACE_BLOCK]
    assert a[2 * TRACE_BLOCK :] != b[2 * TRACE_BLOCK : 1200]
    assert a == prompt_tokens(req(0, 1200, 7, 8, 9), VOCAB)
    assert all(0 <= t < VOCAB for t in a)
    assert block_tokens(7, VOCAB) != block_tokens(8, VOCAB)
    assert block_tokens(7, VOCAB) != block_tokens(7, VOCAB, salt=1)


def test_short_ids_are_padded_uniquely() -> None:
    """A row whose ids cover too few tokens still gets input_length tokens, not shared with others."""
    a, b = prompt_tokens(req(1, 700, 3), VOCAB), prompt_tokens(req(2, 700, 3), VOCAB)
    assert len(a) == len(b) == 700
    assert a[:TRACE_BLOCK] == b[:TRACE_BLOCK] and a[TRACE_BLOCK:] != b[TRACE_BLOCK:]


def test_block_lengths_cut_the_last_block() -> None:
    assert block_lengths(req(0, 1100, 1, 2, 3)) == [512, 512, 76]
    assert block_lengths(req(0, 1024, 1, 2)) == [512, 512]


def test_upper_bound_on_a_tiny_trace() -> None:
    """Leading seen blocks count; a partial block serves only what was seen; a miss ends the run."""
    trace = [
        req(0, 1024, 1, 2),  # nothing seen: 0
        req(1, 1536, 1, 2, 3),  # 1, 2 seen: 1024
        req(2, 1000, 1, 9),  # 1 seen, 9 new: 512
        req(3, 1536, 1, 9, 3),  # 1, [1,9] seen (9 only 488 tokens): 512 + 488, then the run ends
        req(4, 600, 5, 2),  # 2 was seen after 1, not after 5: 0
        req(5, 1024, 1, 2),  # all seen; the engine view keeps one token to recompute
    ]
    bound = upper_bound(trace, engine_block=16)
    assert bound.prompt_tokens == 1024 + 1536 + 1000 + 1536 + 600 + 1024
    assert bound.hit_tokens == 0 + 1024 + 512 + 1000 + 0 + 1024
    # Engine view: whole 16-token blocks, at most prompt - 1: 1000 -> 992, 1024 -> 1008.
    assert bound.engine_hit_tokens == 0 + 1024 + 512 + 992 + 0 + 1008
    assert bound.hit_rate == pytest.approx(bound.hit_tokens / bound.prompt_tokens)


def test_load_slices_and_rebases(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 1000 * i + 500, "input_length": 10, "output_length": 2, "hash_ids": [i]}
        for i in range(5)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load(path, requests=2, start=1)
    assert [r.index for r in got] == [1, 2]
    assert [r.arrival_s for r in got] == [0.0, 1.0]
    assert got[0].hash_ids == (1,)


def test_pooled_lru_serves_every_earlier_prefix_when_everything_fits() -> None:
    """1024 + 512 + (512 + 512 + 176: block 3 was seen only as its 176-token tail) tokens hit."""
    requests = [req(0, 1200, 1, 2, 3), req(1, 1100, 1, 2, 4), req(2, 600, 1, 5), req(3, 1500, 1, 2, 3)]
    roomy = pooled_lru(requests, capacity_tokens=10**9)
    assert (roomy.hit_tokens, roomy.engine_hit_tokens) == (2736, 2736)
    assert pooled_lru(requests, capacity_tokens=0).hit_tokens == 0


def test_pooled_lru_evicts_the_least_recently_used_blocks() -> None:
    """Room for two 512-token blocks: the chain touched last survives, the older one does not."""
    a, b = req(0, 1024, 1, 2), req(1, 1024, 3, 4)
    assert pooled_lru([a, b, req(2, 1024, 3, 4)], capacity_tokens=1024).hit_tokens == 1024
    assert pooled_lru([a, b, req(2, 1024, 1, 2)], capacity_tokens=1024).hit_tokens == 0


def test_an_azure_trace_loads_with_blocks_no_two_prompts_share(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,512,4\n"
        "2023-11-16 18:15:48.1805900,513,5\n"
    )
    first, second = load(path)
    assert (first.arrival_s, first.input_length, first.output_length, first.hash_ids) == (0.0, 512, 4, (0,))
    assert (second.arrival_s, second.hash_ids) == (1.5, (1, 2))
    assert upper_bound([first, second], engine_block=16).hit_rate == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("time,prompt,answer\n1,2,3\n", "expected the columns TIMESTAMP,ContextTokens,GeneratedTokens"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,many,3\n",
            "azure.csv:2: invalid literal",
        ),
    ],
)
def test_a_malformed_azure_trace_is_refused_naming_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(text)
    with pytest.raises(TraceFormatError, match=message):
        load(path)
