"""The replay's online mode with several routers: real engines in a child process, real peer sync."""

from __future__ import annotations

import sys
from pathlib import Path

# The benchmarks are not an installed package: import them from the repo root (see test_replay_trace).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.replay.arms import Config, default_arms
from bench.replay.online import run_arm
from bench.replay.trace import TraceRequest
from extproc.sim.engine_core import EngineParams

VOCAB = 5000
ENGINE = {"block_size": 16, "num_gpu_blocks": 4000, "max_model_len": 16384}


async def test_routers_synced_over_loopback_spread_load_as_one_router_does() -> None:
    """Three routers, round robin, each its own subscriptions and leases: with the real peer sync
    each sees the others' requests as load and the burst spreads two per engine, as one router
    spreads it; without it, each piles its share onto the engines it alone thinks idle."""
    # 50 ms apart (far beyond the sync's few milliseconds), all eight arrived before the first prefill
    # ends (~1 s), each running for seconds, no prompt reused.
    requests = [TraceRequest(i, 0.05 * i, 12000, 300, (50_000 + i,)) for i in range(8)]
    results = {}
    for name, routers, sync in (("one", 1, None), ("synced", 3, 0.0), ("unsynced", 3, None)):
        cfg = Config(engines=4, time_scale=1.0, output_cap=300, engine=ENGINE, seed=3)
        cfg.routers, cfg.sync_delay_s = routers, sync
        raw = await run_arm(default_arms(EngineParams(**ENGINE))[-1](), requests, cfg, VOCAB)
        assert all(r["ok"] for r in raw["requests"]), raw["requests"]
        counts = [sum(1 for r in raw["requests"] if r["endpoint"] == e["address"]) for e in raw["engines"]]
        results[name] = (sorted(counts), raw["peer_messages"])
    assert results["one"][0] == results["synced"][0] == [2, 2, 2, 2], results
    assert max(results["unsynced"][0]) > 2, f"three routers blind to each other herd: {results}"
    # What spread the synced burst is the sync: lease deltas went between the routers.
    assert results["synced"][1]["delta"] > 0 and results["unsynced"][1] is None
