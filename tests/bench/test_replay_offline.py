"""The replay's offline mode: the router's decision path and engine cores in virtual time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# The benchmarks are not an installed package: import them from the repo root (see test_replay_trace).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.replay.arms import Arm, Config, default_arms
from bench.replay.offline import OfflineReplay, router_batch
from bench.replay.policies import RoundRobin
from bench.replay.run import offline_arm, summarize
from bench.replay.trace import TraceRequest
from extproc.kvindex.decode import decode_batch
from extproc.kvindex.events import BlockRemoved, DecodedBatch
from extproc.sim import kv_events as sim
from extproc.sim.engine_core import EngineParams
from extproc.sim.kv_wire import EventEncoding, HashFormat, encode_batch

REPO = Path(__file__).resolve().parents[2]
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


def _per_hash(batch: DecodedBatch) -> list[object]:
    """A batch's events with each removal split per hash (the order the index applies them in)."""
    out: list[object] = []
    for event in batch.events:
        if isinstance(event, BlockRemoved):
            out += [("removed", h, event.medium) for h in event.engine_hashes]
        else:
            out.append(event)
    return out


@pytest.mark.parametrize("size", [32, 16, 12], ids=["sha256", "xxhash", "odd-size"])
def test_events_handed_over_decoded_are_what_the_wire_decodes_to(size: int) -> None:
    digest = [bytes(range(i, i + size)) for i in range(6)]
    events: list[sim.KVEvent] = [
        sim.BlockStored((digest[0], digest[1]), None, tuple(range(32)), 16, 1, "adapter", cache_salt="s"),
        sim.BlockStored((digest[2],), digest[1], tuple(range(16)), 16, 1, "adapter", cache_salt="s"),
        sim.BlockRemoved((digest[0],)),
        sim.BlockRemoved((digest[1],)),
        sim.BlockRemoved((digest[3],), medium="CPU"),
        sim.BlockStored((digest[4],), None, (), 16, None, None, medium="CPU"),
        sim.BlockStored((digest[5],), None, tuple(range(15)), 16, None, None),  # malformed: skipped
        sim.AllBlocksCleared(),
        sim.BlockRemoved((digest[2],)),
    ]
    wire = decode_batch(
        encode_batch(events, ts=1.0, dp_rank=0, encoding=EventEncoding.MAPS, hash_format=HashFormat.INT)
    )
    direct = router_batch(events, 1.0)
    assert _per_hash(direct) == _per_hash(wire)
    assert direct.skipped == wire.skipped == 1
    # Consecutive GPU removals arrive as one event; a change of medium starts another.
    assert [len(e.engine_hashes) for e in direct.events if isinstance(e, BlockRemoved)] == [2, 1, 1]


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_the_replay_is_the_same_with_events_decoded_or_on_the_wire(algo: str) -> None:
    """Small GPU pools and a CPU tier, so blocks are evicted, offloaded and loaded back."""
    engine = {
        **ENGINE,
        "num_gpu_blocks": 500,
        "max_model_len": 8000,
        "cpu_offload_blocks": 1500,
        "prefix_caching_hash_algo": algo,
    }
    replays = []
    for wire in (True, False):
        cfg = Config(engines=3, time_scale=1.0, output_cap=64, engine=engine, seed=3, wire_events=wire)
        replay = OfflineReplay(ours(), conversations(count=8, turns=6), cfg, VOCAB)
        replays.append((replay, replay.run()))
    (wired, on_wire), (direct, decoded) = replays
    fields = ("endpoint", "router_cached", "engine_cached", "ttft_wall_s", "e2e_wall_s")
    assert [[r[f] for f in fields] for r in on_wire["requests"]] == [
        [r[f] for f in fields] for r in decoded["requests"]
    ]
    assert wired.routing.index.stats() == direct.routing.index.stats()
    assert sum(e["external_prefix_cache_hits"] for e in decoded["engines"]) > 0


def test_the_engines_hash_algorithm_changes_no_decision() -> None:
    """The replay's engines hash with xxhash by default: routers key blocks by their tokens, so every
    route, cache hit and latency is what sha256 gives."""
    requests = conversations()
    raws = []
    for algo in ("sha256", "xxhash"):
        cfg = Config(
            engines=4,
            time_scale=1.0,
            output_cap=64,
            engine={**ENGINE, "prefix_caching_hash_algo": algo},
            seed=3,
        )
        raws.append(offline_arm(ours(), requests, cfg, VOCAB))
    fields = ("endpoint", "router_cached", "engine_cached", "ttft_wall_s", "e2e_wall_s")
    sha, xx = ([[r[f] for f in fields] for r in raw["requests"]] for raw in raws)
    assert sha == xx and any(r[2] for r in sha)


def test_an_azure_trace_replays_and_reports_that_no_prompt_shares_a_prefix(tmp_path: Path) -> None:
    """A trace without prefix information (the shared Azure ones) plays through the command a user
    runs, and its report says why every hit rate is 0 instead of dividing by it."""
    trace = tmp_path / "azure_llm_2023_conv.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{10 + i:02d}.5000000,{300 + 40 * i},{5 + i}\n" for i in range(12))
    )
    out = tmp_path / "replay.json"
    command = [sys.executable, "-m", "bench.replay.run", "--offline", "--trace", str(trace)]
    command += ["--requests", "12", "--engines", "2", "--only", "round", "ours", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = out.with_suffix(".md").read_text()
    assert report.startswith("# Routing quality: Azure LLM inference 2023 conv trace replay (offline)")
    assert "No prompt shares a prefix with an earlier one" in report
    assert "| ours (predicted-ttft) | precise | 0.0% |" in report


def test_a_row_longer_than_the_context_is_answered_400_and_counted_not_a_crash() -> None:
    """As an engine answers online: the run goes on, the row is an error, the count says how many."""
    requests = conversations(count=2, turns=2)
    too_long = TraceRequest(len(requests), 0.1, ENGINE["max_model_len"] + 500, 20, tuple(range(9000, 9040)))
    raw = run(ours(), [*requests, too_long])
    assert raw["refused_too_long"] == 1
    (refused,) = [r for r in raw["requests"] if not r["ok"]]
    assert refused["index"] == too_long.index and refused["error"].startswith("400")
    assert sum(e["requests_finished"] for e in raw["engines"]) == len(requests)


def test_routers_that_share_their_leases_spread_load_as_one_router_does() -> None:
    """Several routers, round robin: synced, each sees the others' requests as load; unsynced,
    each piles its share onto the engines it alone thinks idle."""
    # A burst (10 ms apart, each request running for seconds), no prompt reused.
    requests = [TraceRequest(i, 0.01 * i, 4000, 400, (50_000 + i,)) for i in range(8)]
    results = {}
    for name, routers, delay in (("one", 1, None), ("synced", 3, 0.005), ("unsynced", 3, None)):
        cfg = Config(engines=4, time_scale=1.0, output_cap=400, engine=ENGINE, seed=3)
        cfg.routers, cfg.sync_delay_s = routers, delay
        raw = offline_arm(ours(), requests, cfg, VOCAB)
        counts = [sum(1 for r in raw["requests"] if r["endpoint"] == e["address"]) for e in raw["engines"]]
        results[name] = sorted(counts)
    assert results["one"] == results["synced"] == [2, 2, 2, 2]
    assert max(results["unsynced"]) > 2, f"three routers blind to each other herd: {results}"
