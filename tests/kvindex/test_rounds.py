"""Settling rounds off the event loop: the index frozen during a round, the same index after it.

Every case runs one event stream twice: into an index that settles inline (the reference) and into
one whose large rounds run elsewhere. Between the two, only when rounds ran may differ, never what
the index answers once they are over.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Iterator

from waiting import eventually

from extproc.kvindex.decode import decode_batch
from extproc.kvindex.events import DecodedBatch, Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.sim.kv_events import BlockRemoved, BlockStored, KVEvent
from extproc.sim.kv_wire import encode_batch
from extproc.types import EndpointAddress

MODEL = "llama"
BLOCK = 16
SOURCES = [Source(EndpointAddress(f"10.0.0.{i}:8000"), 0) for i in range(1, 9)]
NEWCOMER = Source(EndpointAddress("10.0.0.99:8000"), 0)


def prompts(count: int, seed: int = 1) -> list[tuple[int, ...]]:
    """Prompts of 2-24 blocks, most of them sharing one of a few prefixes."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(50_000) for _ in range(BLOCK * rng.randint(1, 8))) for _ in range(6)]
    return [
        rng.choice(prefixes) + tuple(rng.randrange(50_000) for _ in range(BLOCK * rng.randint(1, 16)))
        for _ in range(count)
    ]


def stream(seed: int, batches: int) -> Iterator[tuple[Source, list[KVEvent]]]:
    """Each source's engine storing prompts (chained BlockStored) and evicting old blocks."""
    rng = random.Random(seed)
    held: dict[Source, list[bytes]] = {s: [] for s in SOURCES}
    for tokens in prompts(batches, seed):
        source = rng.choice(SOURCES)
        digests, parent = [], b""
        for start in range(0, len(tokens), BLOCK):
            parent = hashlib.blake2b(
                parent + repr(tokens[start : start + BLOCK]).encode(), digest_size=16
            ).digest()
            digests.append(parent)
        events: list[KVEvent] = [BlockStored(tuple(digests), None, tokens, BLOCK, None, None)]
        held[source] += [d for d in digests if d not in held[source]]
        if len(held[source]) > 3000:
            gone, held[source] = held[source][:200], held[source][200:]
            events.append(BlockRemoved(tuple(gone)))
        yield source, events


def payloads(seed: int, batches: int) -> list[tuple[Source, bytes]]:
    return [
        (source, encode_batch(events, ts=1.0, dp_rank=0, encoding="maps", hash_format="bytes"))
        for source, events in stream(seed, batches)
    ]


def new_index(*, elsewhere: bool) -> PrefixIndex:
    index = PrefixIndex(
        max_entries=10**7,
        max_entries_per_source=10**6,
        hot_blocks=512,
        rounds_elsewhere=elsewhere,
    )
    for source in SOURCES:
        index.add_source(source, namespace=MODEL, block_size=BLOCK)
    return index


def answers(index: PrefixIndex, asked: list[tuple[int, ...]]) -> list[dict[Source, int]]:
    seed = namespace_seed(MODEL)
    return [index.match(block_keys(tokens, BLOCK, seed)) for tokens in asked]


def test_writes_during_a_round_wait_and_the_index_ends_as_if_it_had_settled_inline() -> None:
    reference, index = new_index(elsewhere=False), new_index(elsewhere=True)
    asked = prompts(60, seed=1)  # the stream's own prompts (same seed): many are held
    rounds = 0
    for source, payload in payloads(seed=1, batches=400):
        reference.apply(source, _decoded(payload))
        if index.round_due():
            rounds += 1
            before = answers(index, asked)
            index.begin_round()
            # What comes during the round waits: the index answers as it did when the round began.
            index.apply(source, _decoded(payload))
            index.add_source(NEWCOMER, namespace=MODEL, block_size=BLOCK)
            index.apply(NEWCOMER, _decoded(payload))
            index.drop_source(NEWCOMER)
            assert answers(index, asked) == before
            index.run_round()
            assert answers(index, asked) == before, "the settled layer answers as the recent one did"
            index.end_round()
            reference.add_source(NEWCOMER, namespace=MODEL, block_size=BLOCK)
            reference.apply(NEWCOMER, _decoded(payload))
            reference.drop_source(NEWCOMER)
        else:
            index.apply(source, _decoded(payload))
    assert rounds >= 3, "the stream is long enough for several rounds"
    assert index.blocks() == reference.blocks()
    assert answers(index, asked) == answers(reference, asked)
    assert NEWCOMER not in index.sources()


async def test_rounds_run_in_a_thread_while_the_loop_keeps_answering() -> None:
    """Through the ingest on a running loop: rounds go to a thread, lookups made meanwhile answer
    what the index held when the round began, and the end state is the inline reference's."""
    reference, index = new_index(elsewhere=False), new_index(elsewhere=True)
    asked = prompts(60, seed=2)
    reference_ingest, ingest = IndexIngest(reference), IndexIngest(index)
    lookups_during_rounds = 0
    try:
        for number, (source, payload) in enumerate(payloads(seed=2, batches=600)):
            reference_ingest.on_batch(source, number, payload)
            ingest.on_batch(source, number, payload)
            if index.in_round:
                frozen = index.stats().blocks
                before = answers(index, asked)
                while index.in_round:
                    assert answers(index, asked) == before
                    assert index.stats().blocks == frozen
                    lookups_during_rounds += 1
                    await asyncio.sleep(0)
        await eventually(lambda: not ingest.rounds.busy, within=30, what="the last round and its backlog")
        assert ingest.rounds.in_thread >= 2
        assert lookups_during_rounds > 0, "the loop ran while rounds did"
        assert index.blocks() == reference.blocks()
        assert answers(index, asked) == answers(reference, asked)
    finally:
        ingest.close()


async def test_batches_that_arrive_during_a_round_are_applied_in_order_after_it() -> None:
    reference, index = new_index(elsewhere=False), new_index(elsewhere=True)
    asked = prompts(60, seed=3)
    reference_ingest, ingest = IndexIngest(reference), IndexIngest(index)
    try:
        for number, (source, payload) in enumerate(payloads(seed=3, batches=600)):
            reference_ingest.on_batch(source, number, payload)
            ingest.on_batch(source, number, payload)  # arrives during rounds too: it waits
            if number % 50 == 0:
                reference_ingest.on_reset(source, "test")
                ingest.on_reset(source, "test")
        await eventually(lambda: not ingest.rounds.busy, within=30, what="the last round and its backlog")
        assert ingest.rounds.in_thread >= 1
        assert index.blocks() == reference.blocks()
        assert answers(index, asked) == answers(reference, asked)
    finally:
        ingest.close()


def _decoded(payload: bytes) -> DecodedBatch:
    return decode_batch(payload)
