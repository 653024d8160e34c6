"""The replay's offline mode: the router's decision path and engine cores in virtual time."""

from __future__ import annotations

import sys
from pathlib import Path

# The benchmarks are not an installed package: import them from the repo root (see test_replay_trace).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.replay.policies import RoundRobin
from bench.replay.run import Arm, Config, default_arms, offline_arm, summarize
from bench.replay.trace import TraceRequest
from extproc.sim.engine_core import EngineParams

VOCAB = 5000
ENGINE = {"block_size": 16, "num_gpu_blocks": 4000, "max_model_len": 16384}


def conversations(count: int = 6, turns: int = 5) -> list[TraceRequest]:
    """``count`` conversations interleaved: each turn repeats its history's blocks and adds two."""
    rows = []
    for turn in range(turns):
        for c in range(count):
            ids = tuple(1000 * c + b for b in range(2 * (turn + 1)))
            index = len(rows)
            rows.append(TraceRequest(index, index * 0.4, 512 * len(ids) - 100, 20, ids))
    return rows


def run(arm: Arm, requests: list[TraceRequest]) -> dict:
    cfg = Config(engines=4, time_scale=1.0, output_cap=64, engine=ENGINE, seed=3)
    return offline_arm(arm, requests, cfg, VOCAB)


def ours() -> Arm:
    return default_arms(EngineParams(**ENGINE))[-1]()


def test_the_same_seed_replays_the_same_decisions_and_latencies() -> None:
    requests = conversations()
    first, second = run(ours(), requests), run(ours(), requests)
    assert [r["endpoint"] for r in first["requests"]] == [r["endpoint"] for r in second["requests"]]
    assert [r["ttft_wall_s"] for r in first["requests"]] == [r["ttft_wall_s"] for r in second["requests"]]


def test_every_request_finishes_and_follow_ups_find_their_history() -> None:
    """Each conversation's later turns reuse its earlier ones: routed by the engines' KV events, they
    hit the cache far more often than round robin does, and the router's credit is the engines' own."""
    requests = conversations()
    precise = run(ours(), requests)
    blind = run(Arm(RoundRobin.name, RoundRobin()), requests)
    for raw in (precise, blind):
        assert all(r["ok"] for r in raw["requests"]) and len(raw["requests"]) == len(requests)
        assert sum(e["requests_finished"] for e in raw["engines"]) == len(requests)
    assert summarize(precise, 1.0)["hit_rate"] > 1.5 * summarize(blind, 1.0)["hit_rate"]
    follow_ups = [r for r in precise["requests"] if r["index"] >= 6]
    assert all(r["engine_cached"] >= r["router_cached"] > 0 for r in follow_ups)
