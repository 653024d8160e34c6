"""The sink subscribers feed: real vLLM payloads into the index, bad input counted, resets, health, logs."""

from __future__ import annotations

import hashlib
import logging
import random

import msgpack
import pytest

from extproc.kvindex.events import Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import LOG_INTERVAL, IndexIngest, IngestCounters, SourceHealth
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.sim.kv_events import BlockRemoved, BlockStored, KVEvent
from extproc.sim.kv_wire import encode_batch
from extproc.types import EndpointAddress

A = Source(EndpointAddress("10.0.0.1:8000"), 0)
B = Source(EndpointAddress("10.0.0.2:8000"), 0)
UNKNOWN = Source(EndpointAddress("10.0.0.9:8000"), 0)
MODEL = "llama"
BLOCK = 16
_RNG = random.Random(7)
DOC = tuple(_RNG.randrange(5000) for _ in range(BLOCK * 6))
KEYS = block_keys(DOC, BLOCK, namespace_seed(MODEL))
DIGESTS = [hashlib.sha256(b"block-%d" % i).digest() for i in range(6)]
LOGGER = "extproc.kvindex.ingest"


def stored(first: int, count: int) -> BlockStored:
    """DOC's engine blocks [first, first+count), chained to block first-1 as vLLM sends them."""
    return BlockStored(
        block_hashes=tuple(DIGESTS[first : first + count]),
        parent_block_hash=DIGESTS[first - 1] if first else None,
        token_ids=DOC[first * BLOCK : (first + count) * BLOCK],
        block_size=BLOCK,
        lora_id=None,
        lora_name=None,
    )


def payload(*events: KVEvent, encoding: str = "maps", hash_format: str = "int") -> bytes:
    return encode_batch(list(events), ts=1.0, dp_rank=0, encoding=encoding, hash_format=hash_format)


def make_ingest(*sources: Source, clock: list[float] | None = None) -> IndexIngest:
    index = PrefixIndex(max_entries=10_000, max_entries_per_source=10_000)
    for source in sources:
        index.add_source(source, namespace=MODEL, block_size=BLOCK)
    if clock is None:
        return IndexIngest(index)
    return IndexIngest(index, clock=lambda: clock[0])


GARBAGE = [
    b"",
    b"\xc1",
    b"not msgpack at all",
    msgpack.packb({"ts": 1.0, "events": []}),
    msgpack.packb([1.0]),
    msgpack.packb(["yesterday", []]),
    msgpack.packb([1.0, "events"]),
]
GARBAGE_IDS = [
    "empty",
    "reserved-byte",
    "text",
    "map-batch",
    "one-element",
    "ts-not-a-number",
    "events-not-array",
]


@pytest.mark.parametrize(
    ("encoding", "hash_format"),
    [("arrays", "int"), ("arrays", "bytes"), ("maps", "int"), ("maps", "bytes")],
    ids=["vllm<=0.23-int", "vllm<=0.23-bytes", "vllm>=0.24-int", "vllm>=0.24-bytes"],
)
def test_vllm_payloads_land_in_the_index(encoding: str, hash_format: str) -> None:
    """Stores chained across batches and a removal, in vLLM's exact bytes, move the source's prefix."""
    ingest = make_ingest(A, B)
    ingest.on_batch(A, 0, payload(stored(0, 2), encoding=encoding, hash_format=hash_format))
    ingest.on_batch(A, 1, payload(stored(2, 3), encoding=encoding, hash_format=hash_format))
    assert ingest.index.match(KEYS) == {A: 5, B: 0}
    removal = BlockRemoved(block_hashes=(DIGESTS[3],))
    ingest.on_batch(A, 2, payload(removal, encoding=encoding, hash_format=hash_format))
    assert ingest.index.match(KEYS) == {A: 3, B: 0}
    assert ingest.counters == IngestCounters(batches=3)


@pytest.mark.parametrize("garbage", GARBAGE, ids=GARBAGE_IDS)
def test_garbage_is_counted_as_a_decode_error_without_raising(garbage: bytes) -> None:
    """A payload that is not a batch is counted and dropped; the index and later batches are unaffected."""
    ingest = make_ingest(A)
    ingest.on_batch(A, 0, garbage)
    assert ingest.counters == IngestCounters(decode_errors=1)
    assert ingest.index.match(KEYS) == {A: 0}
    ingest.on_batch(A, 1, payload(stored(0, 2)))
    assert ingest.index.match(KEYS) == {A: 2}
    assert ingest.counters == IngestCounters(batches=1, decode_errors=1)


def test_batches_for_unregistered_sources_are_counted_and_dropped() -> None:
    """A batch for a source the index does not know (endpoint just left) is counted, not raised."""
    ingest = make_ingest(A)
    ingest.on_batch(UNKNOWN, 0, payload(stored(0, 2)))
    assert ingest.counters == IngestCounters(unknown_source=1)
    assert ingest.index.sources() == [A]
    assert ingest.index.match(KEYS) == {A: 0}


def test_reset_clears_the_sources_blocks_but_keeps_it_registered() -> None:
    """After a reset the source holds nothing, is still indexed, and takes new batches."""
    ingest = make_ingest(A, B)
    ingest.on_batch(A, 0, payload(stored(0, 3)))
    ingest.on_batch(B, 0, payload(stored(0, 2)))
    ingest.on_reset(A, "publisher restarted")
    assert ingest.index.match(KEYS) == {A: 0, B: 2}
    assert set(ingest.index.sources()) == {A, B}
    assert ingest.health[A].last_reset == "publisher restarted"
    assert ingest.counters.resets == 1
    ingest.on_batch(A, 0, payload(stored(0, 1)))
    assert ingest.index.match(KEYS) == {A: 1, B: 2}


def test_reset_of_an_unregistered_source_is_harmless() -> None:
    """A reset for a source the index already dropped is counted and does not raise."""
    ingest = make_ingest(A)
    ingest.on_reset(UNKNOWN, "endpoint removed")
    assert ingest.counters.resets == 1
    assert ingest.index.sources() == [A]


@pytest.mark.parametrize("source", [A, UNKNOWN], ids=["registered", "unregistered"])
def test_completeness_marks_the_index_source_and_records_the_reason(
    source: Source, caplog: pytest.LogCaptureFixture
) -> None:
    """Incomplete streams show in ``incomplete_sources`` and health (with a warning); complete clears it."""
    ingest = make_ingest(A)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ingest.on_completeness(source, False, "batches 3-5 lost (no longer in the replay buffer)")
    assert ingest.health[source] == SourceHealth(
        complete=False, reason="batches 3-5 lost (no longer in the replay buffer)"
    )
    assert ingest.index.incomplete_sources() == frozenset({A} & {source})
    assert f"kv source incomplete source={source}" in caplog.text
    ingest.on_completeness(source, True, "in sync from seq 0")
    assert ingest.health[source] == SourceHealth(complete=True, reason="in sync from seq 0")
    assert ingest.index.incomplete_sources() == frozenset()


@pytest.mark.parametrize(
    ("times", "logged"),
    [
        ([0.0, 1.0, LOG_INTERVAL - 0.5], 1),
        ([0.0, LOG_INTERVAL], 2),
        ([0.0, 30.0, LOG_INTERVAL, LOG_INTERVAL + 30.0, 2 * LOG_INTERVAL], 3),
    ],
    ids=["within-interval", "at-interval", "every-interval"],
)
def test_decode_errors_are_logged_at_most_once_per_interval(
    times: list[float], logged: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A source sending garbage logs once per interval, but every payload is counted."""
    clock = [0.0]
    ingest = make_ingest(A, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for seq, now in enumerate(times):
            clock[0] = now
            ingest.on_batch(A, seq, b"garbage")
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == logged
    assert all("kv batch not decoded source=10.0.0.1:8000/dp0" in r.getMessage() for r in records)
    assert ingest.counters.decode_errors == len(times)


def test_log_limits_are_per_source_and_forgotten_with_the_source(caplog: pytest.LogCaptureFixture) -> None:
    """Another source's garbage still logs; a forgotten source logs again at once."""
    clock = [100.0]
    ingest = make_ingest(A, B, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ingest.on_batch(A, 0, b"garbage")
        ingest.on_batch(A, 1, b"garbage")
        ingest.on_batch(B, 0, b"garbage")
        ingest.on_completeness(A, False, "lost")
        ingest.forget(A)
        ingest.on_batch(A, 0, b"garbage")
    decode_logs = [r.getMessage() for r in caplog.records if "not decoded" in r.getMessage()]
    assert [m.split()[4] for m in decode_logs] == [f"source={A}", f"source={B}", f"source={A}"]
    assert A not in ingest.health


def test_an_engine_block_size_the_set_does_not_divide_is_said_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang's default page size is 1: a set declared 16 would skip every event in silence."""
    clock = [0.0]
    ingest = make_ingest(A, clock=clock)
    pages = BlockStored(
        block_hashes=tuple(DIGESTS[:3]),
        parent_block_hash=None,
        token_ids=DOC[:3],
        block_size=1,
        lora_id=None,
        lora_name=None,
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for seq in range(3):
            ingest.on_batch(A, seq, payload(pages))
    [record] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "blocks hold 1 tokens, not a multiple of the worker set's kvBlockSize 16" in record
    assert ingest.index.block_size_mismatch(A) == (16, 1)
    assert ingest.index.match(block_keys(DOC[:16], BLOCK, namespace_seed(MODEL))) == {A: 0}


def test_a_settling_round_longer_than_the_threshold_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Packing recent blocks holds the event loop: a round past ``slow_settle_s`` says so, with the
    way out; one under it stays quiet. (The threshold here is 0 and a day: the test cannot time.)"""
    for threshold, expected in ((0.0, 1), (86_400.0, 0)):
        caplog.clear()
        index = PrefixIndex(max_entries=10_000, max_entries_per_source=10_000, hot_blocks=1)
        index.add_source(A, namespace=MODEL, block_size=BLOCK)
        ingest = IndexIngest(index, slow_settle_s=threshold)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            ingest.on_batch(A, 0, payload(stored(0, 3)))
        logs = [r.getMessage() for r in caplog.records if "settling round" in r.getMessage()]
        assert len(logs) == expected
        assert index.stats().settled_blocks == 3 and index.stats().settle_rounds == 1
        if logs:
            assert "lower --kv-index-memory-mib" in logs[0] and "blocks=3" in logs[0]
