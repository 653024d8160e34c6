"""The simulator's KV events, read by an independent subscriber, describe exactly its cache.

A workload over HTTP makes the engine store, evict and reset blocks; the subscriber in
``kv_subscriber.py`` (msgpack + pyzmq, none of the simulator's code) rebuilds the cache from the
events, and the result must equal what the engine's prefix cache holds, live and through replay.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import aiohttp
import pytest
from simulated import StartSim, idle
from waiting import eventually

from extproc.sim.kv_wire import EventEncoding, HashFormat
from extproc.sim.server import SimServer
from extproc.sim.settings import KVEventSettings, LoraModule

from .kv_subscriber import KVSubscriber, ReconstructedCache

BLOCK = 16


def engine_blocks(server: SimServer, rank: int = 0) -> Counter[int]:
    """The engine's cached blocks as the wire's values read as uint64: the digest's last 8 bytes
    (vLLM), or its first 8 (SGLang)."""
    cached = server.ranks[rank].core.cache.cached_hashes()
    kv = server.settings.kv_events
    head = kv is not None and kv.encoding == EventEncoding.SGLANG
    return Counter(
        {int.from_bytes(digest[:8] if head else digest[-8:], "big"): n for digest, n in cached.items()}
    )


async def complete(
    http: aiohttp.ClientSession, server: SimServer, prompt: list[int], max_tokens: int = 2
) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens}
    async with http.post(f"http://{server.address}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


class Follower:
    """Applies every batch from seq 0 in order: live ones as they come, missed ones by replay."""

    def __init__(self, server: SimServer, rank: int = 0) -> None:
        publisher = server.ranks[rank].publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        self.publisher = publisher
        self.sub = KVSubscriber()
        self.sub.connect(publisher.endpoint)
        self.cache = ReconstructedCache()
        self.next_seq = 0
        #: Events applied, by type, and every payload applied (seq order from 0).
        self.events: Counter[str] = Counter()
        self.payloads: list[bytes] = []

    async def join(self, http: aiohttp.ClientSession, server: SimServer) -> None:
        """Send small requests until one batch arrives live; fetch what came before it by replay."""
        rng = random.Random(7)
        published = server.settings.engine.published_block_size or BLOCK
        async with asyncio.timeout(5):
            while True:
                await complete(http, server, [rng.randrange(100, 4000) for _ in range(published + 1)])
                try:
                    message = await self.sub.recv_batch(timeout=0.05)
                    break
                except TimeoutError:
                    continue
        await self._catch_up_to(message.seq)
        self._apply(message.seq, message.payload)

    async def _catch_up_to(self, seq: int) -> None:
        if seq > self.next_seq:
            replayed = await self.sub.replay(self.publisher.replay_endpoint or "", self.next_seq)
            for replayed_seq, payload in replayed:
                if replayed_seq < seq:
                    self._apply(replayed_seq, payload)
        assert self.next_seq == seq, f"replay did not cover {self.next_seq}..{seq - 1}"

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq
        batch = self.cache.apply_batch(payload)
        self.events.update(event["type"] for event in batch.events)
        self.payloads.append(payload)
        self.next_seq = seq + 1

    async def drain(self) -> None:
        """Apply live batches until everything the publisher sent has been applied."""
        while self.next_seq < self.publisher.next_seq:
            message = await self.sub.recv_batch()
            await self._catch_up_to(message.seq)
            self._apply(message.seq, message.payload)

    def close(self) -> None:
        self.sub.close()


async def workload(http: aiohttp.ClientSession, server: SimServer, seed: int) -> None:
    """Conversations sharing system prompts, more blocks than the cache holds, some concurrency."""
    rng = random.Random(seed)
    systems = [[rng.randrange(100, 4000) for _ in range(3 * BLOCK)] for _ in range(3)]
    for _ in range(6):
        batch = []
        for _ in range(4):
            tail = [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 5 * BLOCK))]
            batch.append(complete(http, server, rng.choice(systems) + tail, max_tokens=rng.randrange(1, 40)))
        await asyncio.gather(*batch)


@pytest.mark.parametrize(
    ("encoding", "hash_format"),
    [
        *((e, h) for e in (EventEncoding.ARRAYS, EventEncoding.MAPS) for h in HashFormat),
        (EventEncoding.SGLANG, None),
    ],
    ids=["arrays-int", "arrays-bytes", "maps-int", "maps-bytes", "sglang"],
)
async def test_subscriber_rebuilds_the_cache_through_evictions_reset_and_replay(
    sim: StartSim, http: aiohttp.ClientSession, encoding: EventEncoding, hash_format: HashFormat | None
) -> None:
    """Live events (gaps filled by replay) rebuild the engine's cache exactly, in every encoding."""
    kv = KVEventSettings(
        port=0,
        replay_port=0,
        encoding=encoding,
        hash_format=hash_format or HashFormat.INT,
        topic="kv@sim@llama",
    )
    sglang = encoding == EventEncoding.SGLANG
    server = await sim(
        kv_events=kv, engine={"num_gpu_blocks": 40}, engine_kind="sglang" if sglang else "vllm"
    )
    follower = Follower(server)
    try:
        await follower.join(http, server)
        await workload(http, server, seed=1)
        await eventually(lambda: idle(server))
        await follower.drain()
        assert follower.events["BlockRemoved"] > 0, "the workload should overflow the cache"
        assert follower.cache.blocks == engine_blocks(server)
        assert follower.cache.unknown_removals == 0

        reset = "/flush_cache" if sglang else "/reset_prefix_cache"
        async with http.post(f"http://{server.address}{reset}") as resp:
            assert resp.status == 200
        await workload(http, server, seed=2)
        await eventually(lambda: idle(server))
        await follower.drain()
        assert follower.events["AllBlocksCleared"] == 1
        assert follower.cache.blocks == engine_blocks(server)

        # A subscriber that joins now rebuilds the same state from the replay buffer alone.
        fresh = ReconstructedCache()
        publisher = server.ranks[0].publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        for _, payload in await follower.sub.replay(publisher.replay_endpoint, 0):
            fresh.apply_batch(payload)
        assert fresh.blocks == engine_blocks(server)
    finally:
        follower.close()


async def test_evicted_blocks_are_announced_removed(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """Filling a small cache with distinct prompts evicts old blocks, and BlockRemoved says so."""
    server = await sim(kv_events=KVEventSettings(port=0, replay_port=0), engine={"num_gpu_blocks": 36})
    follower = Follower(server)
    try:
        await follower.join(http, server)
        rng = random.Random(3)
        for _ in range(12):
            await complete(http, server, [rng.randrange(100, 4000) for _ in range(4 * BLOCK)])
        await eventually(lambda: idle(server))
        await follower.drain()
        assert follower.cache.blocks == engine_blocks(server)
        assert follower.events["BlockRemoved"] >= 12 * 4 - 36, "every block past capacity is evicted"
        assert follower.cache.unknown_removals == 0
    finally:
        follower.close()


async def test_lora_blocks_carry_the_adapter_name(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """The same prompt under a LoRA adapter makes different blocks, tagged with the adapter's name."""
    server = await sim(
        kv_events=KVEventSettings(port=0, replay_port=0), lora_modules=(LoraModule("sql", "/a/sql"),)
    )
    follower = Follower(server)
    try:
        await follower.join(http, server)
        prompt = list(range(500, 500 + 2 * BLOCK + 1))
        for model in (server.base_name, "sql"):
            async with http.post(
                f"http://{server.address}/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 1},
            ) as resp:
                assert resp.status == 200
        await eventually(lambda: idle(server))
        await follower.drain()
        by_tokens: dict[tuple[int, ...], set[str | None]] = {}
        for info in follower.cache.info.values():
            by_tokens.setdefault(tuple(info.token_ids), set()).add(info.lora_name)
        assert by_tokens[tuple(prompt[:BLOCK])] == {None, "sql"}
    finally:
        follower.close()


async def test_coarser_published_blocks(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """With a published block size of 4 x 16, events carry 64-token blocks matching the cache view."""
    server = await sim(kv_events=KVEventSettings(port=0, replay_port=0), engine={"published_block_size": 64})
    follower = Follower(server)
    try:
        await follower.join(http, server)
        await complete(http, server, list(range(1000, 1000 + 130)))
        await eventually(lambda: idle(server))
        await follower.drain()
        assert follower.cache.blocks == engine_blocks(server)
        sizes = {info.block_size for info in follower.cache.info.values()}
        assert sizes == {64}
        assert any(info.token_ids == tuple(range(1000, 1064)) for info in follower.cache.info.values())
    finally:
        follower.close()
