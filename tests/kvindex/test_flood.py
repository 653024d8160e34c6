"""A flood of bad frames through the whole pipeline (ZMQ -> subscriber -> decoder -> index).

A hostile or broken publisher interleaves malformed frames, undecodable payloads and oversized
messages with real vLLM batches; the index must end up holding exactly the real batches' blocks,
every bad message must be counted, and nothing may grow past its bound.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import zmq
import zmq.asyncio
from waiting import eventually

from extproc.kvindex.events import Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.kvindex.subscriber import KVEventSubscriber, SubscriberOptions
from extproc.sim.kv_events import BlockStored
from extproc.sim.kv_wire import encode_batch
from extproc.types import EndpointAddress

SOURCE = Source(EndpointAddress("127.0.0.1:8000"), 0)
BLOCK = 16
MODEL = "llama"


def stored(tokens: list[int], tag: str) -> bytes:
    """A vLLM (maps, int hashes) batch storing ``tokens`` as fresh blocks from token 0."""
    blocks = len(tokens) // BLOCK
    digests = tuple(hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(blocks))
    event = BlockStored(digests, None, tuple(tokens), BLOCK, None, None)
    return encode_batch([event], ts=0.0, dp_rank=0, encoding="maps", hash_format="int")


async def test_malformed_flood_leaves_exactly_the_real_blocks() -> None:
    """Bad frames and payloads are counted and skipped; the index holds exactly the real blocks."""
    rng = random.Random(11)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = PrefixIndex(max_entries=10_000, max_entries_per_source=2_000)
    index.add_source(SOURCE, namespace=MODEL, block_size=BLOCK)
    ingest = IndexIngest(index)
    options = SubscriberOptions(max_payload_bytes=64 * 1024)
    subscriber = KVEventSubscriber(
        source=SOURCE, pub_address=f"tcp://127.0.0.1:{port}", sink=ingest, options=options, context=ctx
    )
    subscriber.start()
    try:
        # Join: repeat seq 0 until one gets through (PUB drops what it sends before the SUB joins).
        first = [rng.randrange(100, 4000) for _ in range(2 * BLOCK)]
        while ingest.counters.batches == 0:
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), stored(first, "first")])
            await asyncio.sleep(0.01)
        await eventually(lambda: subscriber.stats().last_seq == 0)
        real = [first]
        seq, malformed, garbage, oversized = 1, 0, 0, 0
        for i in range(600):
            kind = i % 6
            if kind == 0:
                await pub.send_multipart([b"", b"only two frames"])
                malformed += 1
            elif kind == 1:
                await pub.send_multipart([b"", b"\x00" * 7, b"seq is not 8 bytes"])
                malformed += 1
            elif kind == 2:
                junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), junk])
                seq, garbage = seq + 1, garbage + 1
            elif kind == 3 and i % 60 == 3:
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\x00" * (100 * 1024)])
                seq, oversized = seq + 1, oversized + 1
            else:
                tokens = [rng.randrange(100, 4000) for _ in range(BLOCK * rng.randrange(1, 4))]
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), stored(tokens, f"real/{i}")])
                real.append(tokens)
                seq += 1
        last = seq - 1
        await eventually(lambda: subscriber.stats().last_seq == last)
        stats = subscriber.stats()
        assert stats.counters.malformed == malformed
        assert stats.counters.oversized == oversized
        assert ingest.counters.decode_errors == garbage
        # A seq-0 join probe that arrived twice reads as a restart (reset, then applied again).
        assert ingest.counters.batches - ingest.counters.resets == len(real)
        seed = namespace_seed(MODEL)
        for tokens in real:
            keys = block_keys(tokens, BLOCK, seed)
            assert index.match(keys) == {SOURCE: len(keys)}
        assert index.stats().blocks == sum(len(t) // BLOCK for t in real)
        assert index.stats().blocks <= 2_000
    finally:
        await subscriber.close()
        pub.close(linger=0)
        ctx.term()
