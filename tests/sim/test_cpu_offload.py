"""The CPU offload tier: vLLM's native CPU offloading in model time, on the wire and in the router's index."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp
import pytest
from simulated import StartSim, idle
from waiting import eventually

from extproc.errors import ConfigError
from extproc.kvindex.events import Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.sim.block_hash import extend_block_hashes
from extproc.sim.cpu_tier import MEDIUM_CPU, CpuTier
from extproc.sim.engine_core import EngineCore, EngineParams, SimRequest
from extproc.sim.engine_loop import EngineLoop
from extproc.sim.kv_events import BlockRemoved, BlockStored, KVEvent
from extproc.sim.kv_wire import EventEncoding, HashFormat
from extproc.sim.server import SimServer
from extproc.sim.settings import KVEventSettings
from extproc.types import EndpointAddress

from .kv_subscriber import decode_batch
from .test_engine_core import Trace, _drain
from .test_engine_loop import FakeTime
from .test_server_kv_events import Follower, complete, engine_blocks

BS, BASE, PER_SEQ, RATE, LOAD = 4, 0.01, 0.001, 1000.0, 10_000.0
DIGESTS = [bytes([i]) * 32 for i in range(12)]


def _params(**overrides: Any) -> EngineParams:
    values: dict[str, Any] = {
        "block_size": BS,
        "num_gpu_blocks": 16,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 64,
        "prefill_tokens_per_s": RATE,
        "decode_base_s": BASE,
        "decode_per_seq_s": PER_SEQ,
        "cpu_offload_blocks": 64,
        "cpu_load_tokens_per_s": LOAD,
    }
    values.update(overrides)
    return EngineParams(**values)


def _tokens(seed: int, n: int) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def _hashes(tokens: Sequence[int], size: int = BS) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, size, None)
    return out


def _run(core: EngineCore, now: float, *prompts: tuple[str, list[int]]) -> Trace:
    """Submit the prompts at ``now`` (one output token each) and run until the engine drains."""
    for rid, prompt in prompts:
        core.add_request(SimRequest(rid, prompt, [9000], arrival_time=now, finish_reason="length"))
    return _drain(core, now)


def _evict_from_gpu(core: EngineCore, now: float) -> float:
    """Two 40-token prompts fill the 16-block GPU pool twice over; returns the model time after."""
    return _run(core, _run(core, now, ("x", _tokens(7, 40))).end, ("y", _tokens(8, 40))).end


def _cpu_events(events: Sequence[KVEvent]) -> list[KVEvent]:
    return [e for e in events if not isinstance(e, BlockStored | BlockRemoved) or e.medium == MEDIUM_CPU]


# -- the tier on its own -----------------------------------------------------------------------------


def test_tier_evicts_least_recently_used_tail_first_and_says_so() -> None:
    """A full tier evicts its LRU blocks in one BlockRemoved; a request's touch keeps its head longest."""
    tier = CpuTier(4, 16)
    assert tier.store(DIGESTS[0:3]) == 3
    tier.touch(DIGESTS[0:3])  # as after a store: head most recent
    assert tier.keys() == [DIGESTS[2], DIGESTS[1], DIGESTS[0]]
    assert tier.store(DIGESTS[3:6]) == 3
    assert tier.keys() == [DIGESTS[0], DIGESTS[3], DIGESTS[4], DIGESTS[5]]


def test_tier_events_pins_and_protection() -> None:
    """Stores and evictions are announced medium CPU, token-less; pinned and stored keys are never evicted."""
    tier = CpuTier(3, 16)
    tier.store(DIGESTS[0:3])
    tier.pin([DIGESTS[0]])
    assert tier.store([DIGESTS[1], DIGESTS[3]]) == 1  # DIGESTS[1] is held and protected: 2 goes
    assert tier.store(DIGESTS[4:7]) is None, "only one block is evictable: the store is skipped"
    tier.unpin([DIGESTS[0]])
    assert tier.store([DIGESTS[4]]) == 1
    events = tier.take_events()
    assert events == [
        BlockStored(tuple(DIGESTS[0:3]), None, (), 16, None, None, medium="CPU"),
        BlockRemoved((DIGESTS[2],), medium="CPU"),
        BlockStored((DIGESTS[3],), None, (), 16, None, None, medium="CPU"),
        BlockRemoved((DIGESTS[0],), medium="CPU"),
        BlockStored((DIGESTS[4],), None, (), 16, None, None, medium="CPU"),
    ]
    assert set(tier.keys()) == {DIGESTS[1], DIGESTS[3], DIGESTS[4]}


# -- the engine in model time -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"cpu_offload_blocks": -1}, "cpu_offload_blocks"),
        ({"cpu_offload_blocks": True}, "cpu_offload_blocks"),
        ({"cpu_offload_blocks": 15}, "cpu_offload_blocks 15 x 4 tokens cannot hold"),
        ({"cpu_load_tokens_per_s": 0.0}, "cpu_load_tokens_per_s"),
        ({"cpu_load_tokens_per_s": float("inf")}, "cpu_load_tokens_per_s"),
    ],
    ids=["negative", "bool", "too-small", "zero-rate", "infinite-rate"],
)
def test_params_are_validated(overrides: dict[str, Any], name: str) -> None:
    """Bad CPU-tier parameters raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=name):
        _params(**overrides)


def test_default_is_no_cpu_tier_and_a_pcie_gen5_load_rate() -> None:
    """Off by default; loads at ~50 GB/s / 128 KiB per token."""
    p = EngineParams()
    assert p.cpu_offload_blocks == 0 and EngineCore(p).cache.cpu is None
    assert p.cpu_load_tokens_per_s == pytest.approx(50e9 / (128 * 1024), rel=0.01)


def test_blocks_are_written_through_and_outlive_their_gpu_eviction() -> None:
    """Cached blocks enter the CPU tier (medium CPU, hashes only); GPU evictions leave them there."""
    core = EngineCore(_params())
    a = _tokens(1, 40)
    first = _run(core, 0.0, ("a", a))
    keys = set(_hashes(a))
    assert keys <= core.cache.cpu_hashes() and keys <= set(core.cache.cached_hashes())
    (stored,) = _cpu_events(first.events)
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (tuple(_hashes(a)), None, ())

    x = _run(core, first.end, ("x", _tokens(7, 40)))
    events = [*x.events, *_run(core, x.end, ("y", _tokens(8, 40))).events]
    gpu_removed = {
        h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes
    }
    assert keys <= gpu_removed, "a's blocks were evicted from the GPU"
    assert not keys & set(core.cache.cached_hashes())
    assert keys <= core.cache.cpu_hashes()
    assert not [e for e in _cpu_events(events) if isinstance(e, BlockRemoved)]


def _cold_ttft() -> float:
    return BASE + 44 / RATE


@pytest.mark.parametrize("published", [BS, 2 * BS], ids=["published-16", "published-2x"])
def test_cpu_hit_is_loaded_not_recomputed_and_counted_as_external(published: int) -> None:
    """A prefix evicted from the GPU but held on CPU costs its load, not its prefill; counted external."""
    core = EngineCore(_params(published_block_size=published))
    a = _tokens(1, 40)
    now = _evict_from_gpu(core, _run(core, 0.0, ("a", a)).end)
    queries, hits = core.prefix_cache_queries, core.prefix_cache_hits

    b = [*a, 1, 2, 3, 4]
    trace = _run(core, now, ("b", b))
    first = trace.first("b")
    assert first.num_cached_tokens == 40
    assert first.ttft is not None and first.ttft == pytest.approx(40 / LOAD + BASE + 4 / RATE)
    assert first.ttft < _cold_ttft()
    assert (core.prefix_cache_queries - queries, core.prefix_cache_hits - hits) == (44, 0)
    # a, x, y looked up 40 tokens each past their (empty) GPU hits, b 44.
    assert (core.external_prefix_cache_queries, core.external_prefix_cache_hits) == (3 * 40 + 44, 40)
    assert core.cpu_loaded_tokens == 40 and core.cpu_load_seconds == pytest.approx(40 / LOAD)
    assert trace.steps[0].idle and trace.steps[0].duration == pytest.approx(40 / LOAD)

    # Loaded blocks are cached on the GPU again, announced with their tokens; the CPU copy stays.
    gpu_stored = [e for e in trace.steps[1].events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert gpu_stored[0].token_ids == tuple(a) and gpu_stored[0].parent_block_hash is None
    assert gpu_stored[0].block_size == published
    keys = set(_hashes(a)[published // BS - 1 :: published // BS])
    assert keys <= set(core.cache.cached_hashes()) and keys <= core.cache.cpu_hashes()


def test_without_the_tier_the_same_request_is_recomputed() -> None:
    """The baseline: with no CPU tier the evicted prefix is prefilled again, nothing counts external."""
    core = EngineCore(_params(cpu_offload_blocks=0))
    a = _tokens(1, 40)
    now = _evict_from_gpu(core, _run(core, 0.0, ("a", a)).end)
    trace = _run(core, now, ("b", [*a, 1, 2, 3, 4]))
    assert trace.first("b").ttft == pytest.approx(_cold_ttft())
    assert core.external_prefix_cache_queries == core.external_prefix_cache_hits == 0
    assert not [e for e in trace.events if getattr(e, "medium", "GPU") != "GPU"]


def test_loads_queue_on_one_link() -> None:
    """Two loads queue on one PCIe link: the second request waits for both loads, not for the first's step."""
    slow = 1000.0  # 20 ms per 20-token load: longer than a step
    core = EngineCore(_params(cpu_load_tokens_per_s=slow))
    a1, a2 = _tokens(1, 20), _tokens(2, 20)
    now = _evict_from_gpu(core, _run(core, 0.0, ("a1", a1), ("a2", a2)).end)
    trace = _run(core, now, ("b1", [*a1, 1, 2, 3, 4]), ("b2", [*a2, 1, 2, 3, 4]))
    assert trace.first("b1").ttft == pytest.approx(20 / slow + BASE + 4 / RATE)
    assert trace.first("b2").ttft == pytest.approx(40 / slow + BASE + 4 / RATE)
    assert core.cpu_load_seconds == pytest.approx(40 / slow)


def test_cpu_lru_eviction_is_announced() -> None:
    """A tier of 16 blocks takes a's 10, then x's 10 evict a's last four (tail first): BlockRemoved CPU."""
    core = EngineCore(_params(cpu_offload_blocks=16))
    a = _tokens(1, 40)
    now = _run(core, 0.0, ("a", a)).end
    trace = _run(core, now, ("x", _tokens(7, 40)))
    removed = [e for e in _cpu_events(trace.events) if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(tuple(reversed(_hashes(a)[6:])), medium="CPU")]
    assert core.cpu_cache_blocks == 16


def test_abort_during_a_load_releases_everything() -> None:
    """A request aborted while its KV is loading frees its GPU blocks and unpins its CPU blocks."""
    core = EngineCore(_params())
    a = _tokens(1, 40)
    now = _evict_from_gpu(core, _run(core, 0.0, ("a", a)).end)
    core.add_request(SimRequest("b", [*a, 1], [9000], arrival_time=now))
    step = core.step(now)
    assert step.idle and core.num_loading == 1 and core.num_waiting == 1 and core.kv_cache_usage > 0
    assert core.abort("b")
    assert not core.has_work and core.kv_cache_usage == 0.0
    assert core.cache.cpu is not None and core.cache.cpu.num_pinned == 0


def test_reset_empties_both_tiers_with_one_event() -> None:
    """reset_prefix_cache drops the CPU tier too; AllBlocksCleared is the only event."""
    core = EngineCore(_params())
    _run(core, 0.0, ("a", _tokens(1, 40)))
    assert core.reset_prefix_cache()
    assert core.cpu_cache_blocks == 0 and not core.cache.cached_hashes()
    assert [type(e).__name__ for e in core.cache.take_events()] == ["AllBlocksCleared"]


# -- the asyncio shell ----------------------------------------------------------------------------------


class HoldingTime(FakeTime):
    """FakeTime whose sleeps can be held (never returning) so a test can act while the loop waits."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.held = 0

    async def sleep(self, delay: float) -> None:
        if self.hold:
            self.held += 1
            await asyncio.get_running_loop().create_future()
        await super().sleep(delay)


async def test_an_arrival_during_a_load_is_scheduled_at_once() -> None:
    """While the engine only waits for a load, a new request starts when it arrives, not after the load."""
    fake, core = HoldingTime(), EngineCore(_params())
    loop = EngineLoop(core, time_scale=1.0, clock=fake.clock, sleep=fake.sleep)
    await loop.start()
    try:
        a = _tokens(1, 40)
        for rid, prompt in (("a", a), ("x", _tokens(7, 40)), ("y", _tokens(8, 40))):
            async for _ in loop.submit(SimRequest(rid, prompt, [9000])):
                pass
        fake.hold = True
        b = loop.submit(SimRequest("b", [*a, 1, 2, 3, 4], [9000]))
        await eventually(lambda: fake.held == 1)
        assert core.num_loading == 1
        fake.now += 0.001
        fake.hold = False
        c = loop.submit(SimRequest("c", _tokens(9, 8), [9000]))
        outs_c = [out async for out in c]
        outs_b = [out async for out in b]
    finally:
        await loop.close()
    assert outs_c[0].queue_time == 0.0
    assert outs_c[0].ttft == pytest.approx(BASE + 8 / RATE)
    assert outs_b[0].ttft == pytest.approx(0.001 + BASE + 8 / RATE + BASE + 4 / RATE)


# -- on the wire, and in the router's index --------------------------------------------------------------


async def offload_workload(http: aiohttp.ClientSession, server: SimServer, seed: int) -> None:
    """12 four-block documents asked about in random order, 4 at a time: more than the GPU pool (40
    blocks) keeps, so documents come back from the CPU tier, and more than the tier (48) holds."""
    rng = random.Random(seed)
    docs = [[rng.randrange(100, 4000) for _ in range(4 * 16)] for _ in range(12)]
    for _ in range(9):
        batch = []
        for _ in range(4):
            tail = [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 24))]
            batch.append(complete(http, server, rng.choice(docs) + tail, max_tokens=rng.randrange(1, 20)))
        await asyncio.gather(*batch)


def _engine_cpu_blocks(server: SimServer) -> Counter[int]:
    return Counter(int.from_bytes(d[-8:], "big") for d in server.ranks[0].core.cache.cpu_hashes())


@pytest.mark.parametrize("encoding", [EventEncoding.ARRAYS, EventEncoding.MAPS], ids=lambda e: e.value)
@pytest.mark.parametrize("hash_format", list(HashFormat), ids=lambda h: h.value)
async def test_subscriber_rebuilds_both_tiers(
    sim: StartSim, http: aiohttp.ClientSession, encoding: EventEncoding, hash_format: HashFormat
) -> None:
    """GPU and CPU tiers rebuilt from the events (both encodings) equal the engine's, through evictions."""
    kv = KVEventSettings(port=0, replay_port=0, encoding=encoding, hash_format=hash_format)
    server = await sim(kv_events=kv, engine={"num_gpu_blocks": 40, "cpu_offload_blocks": 48})
    follower = Follower(server)
    try:
        await follower.join(http, server)
        await offload_workload(http, server, seed=1)
        await eventually(lambda: idle(server))
        await follower.drain()
        core = server.ranks[0].core
        assert core.external_prefix_cache_hits > 0, "the workload should hit the CPU tier"
        assert follower.cache.blocks == engine_blocks(server)
        assert follower.cache.lower["CPU"] == _engine_cpu_blocks(server)
        assert follower.cache.unknown_removals == 0
        cpu_removals = [
            e
            for payload in follower.payloads
            for e in decode_batch(payload).events
            if e["type"] == "BlockRemoved" and e["medium"] == "CPU"
        ]
        assert cpu_removals, "the workload should overflow the CPU tier"
    finally:
        follower.close()


async def test_router_index_sees_the_cpu_tier(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """The router's index, fed the real stream, holds an evicted prefix on its lower tier only; a hit
    loads it back onto the GPU, and the engine counts it as an external hit."""
    server = await sim(
        kv_events=KVEventSettings(port=0, replay_port=0),
        served_model_names=("llama",),
        engine={"num_gpu_blocks": 36, "cpu_offload_blocks": 64},
        enable_prompt_tokens_details=True,
    )
    follower = Follower(server)
    source = Source(EndpointAddress(server.address), 0)
    index = PrefixIndex(max_entries=10_000, max_entries_per_source=10_000)
    index.add_source(source, namespace="llama", block_size=16)
    ingest = IndexIngest(index)
    applied = 0

    async def sync() -> None:
        nonlocal applied
        await eventually(lambda: idle(server))
        await follower.drain()
        for seq in range(applied, len(follower.payloads)):
            ingest.on_batch(source, seq, follower.payloads[seq])
        applied = len(follower.payloads)

    try:
        await follower.join(http, server)
        rng = random.Random(5)
        prompt = [rng.randrange(100, 4000) for _ in range(4 * 16 + 1)]
        keys = block_keys(prompt, 16, namespace_seed("llama"))[:4]
        await complete(http, server, prompt, max_tokens=1)
        await sync()
        assert index.match(keys)[source] == 4
        for _ in range(9):  # 9 x 5 blocks through a 36-block GPU pool
            await complete(http, server, [rng.randrange(100, 4000) for _ in range(4 * 16 + 1)], max_tokens=1)
        await sync()
        assert index.match(keys)[source] == 0
        assert index.match(keys, lower_tiers=True)[source] == 4
        assert ingest.counters.batches == applied

        body = {"prompt": prompt, "max_tokens": 1}
        async with http.post(f"http://{server.address}/v1/completions", json=body) as resp:
            usage = (await resp.json())["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 64}
        await sync()
        assert index.match(keys)[source] == 4
        assert follower.cache.lower["CPU"] == _engine_cpu_blocks(server)

        async with http.get(f"http://{server.address}/metrics") as resp:
            text = await resp.text()
        assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="llama"} 64.0' in text
        assert 'vllm:external_prefix_cache_queries_total{engine="0",model_name="llama"} ' in text
        state = server.state()["ranks"][0]
        assert state["external_prefix_cache_hits"] == 64
        assert (state["cpu_cache_blocks"], state["cpu_cache_capacity"]) == (
            len(_engine_cpu_blocks(server)),
            64,
        )
        stats = server.ranks[0].stats()
        assert (stats.external_prefix_cache_hits, stats.cpu_cache_capacity) == (64, 64)
    finally:
        follower.close()
