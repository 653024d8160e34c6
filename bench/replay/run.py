"""Replay a Mooncake trace against simulated engines, one routing policy after another.

Online (the default, :mod:`bench.replay.online`): fresh simulated engines per policy ("arm") in a
child process, the router's real decision path and the load client in this one, wall clock scaled
by ``--time-scale``. Offline (``--offline``, :mod:`bench.replay.offline`): the same decision path
and engine cores in virtual time, in one process, deterministic per seed. Engine-side numbers
(prefix-cache counters, TTFT and end-to-end latency in *simulated* seconds) make the report.

Run from the repo root: ``.venv/bin/python -m bench.replay [--quick]`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.machine import machine
from bench.replay import report
from bench.replay.arms import (
    REPO,
    TRACE,
    Arm,
    Config,
    default_arms,
)
from bench.replay.offline import OfflineReplay
from bench.replay.online import run_arm
from bench.replay.trace import (
    TraceRequest,
    load,
    pooled_lru,
    spread_arrivals,
    summary,
    upper_bound,
)
from extproc.settings import CandidateSettings
from extproc.sim.block_hash import HASH_ALGOS
from extproc.sim.engine_core import EngineParams
from extproc.tokenize import shipped_tokenizer

log = logging.getLogger("bench.replay")


def _variants(
    factories: Iterable[Callable[[], Arm]], cfg: Config, args: argparse.Namespace
) -> Iterator[tuple[Callable[[], Arm], str, Config]]:
    """Each policy once; with ``--routers N``, also with N routers synced and N unsynced."""
    for factory in factories:
        yield factory, "", cfg
        if args.routers > 1:
            synced = replace(cfg, routers=args.routers, sync_delay_s=args.sync_delay_ms / 1000)
            yield factory, f" x{args.routers} routers, synced", synced
            yield factory, f" x{args.routers} routers, no sync", replace(cfg, routers=args.routers)


def offline_arm(arm: Arm, requests: list[TraceRequest], cfg: Config, vocab: int) -> dict[str, Any]:
    """The arm played in virtual time (:mod:`bench.replay.offline`), same shape as :func:`run_arm`'s."""
    return OfflineReplay(arm, requests, cfg, vocab).run()


# -- summary ----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0-100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summarize(arm: dict[str, Any], scale: float) -> dict[str, Any]:
    """The per-policy numbers the report shows."""
    engines = arm["engines"]
    queries = sum(e["prefix_cache_queries"] for e in engines)
    hits = sum(e["prefix_cache_hits"] for e in engines)
    cpu_hits = sum(e.get("external_prefix_cache_hits", 0) for e in engines)
    ttft = [t for e in engines for t in e["ttft"]]
    e2e = [t for e in engines for t in e["e2e"]]
    reqs = arm["requests"]
    per_engine = [sum(1 for r in reqs if r["endpoint"] == e["address"]) for e in engines]
    tokens = [e["prompt_tokens"] for e in engines]
    mean = statistics.fmean(per_engine) if per_engine else 0.0
    client_ttft = [r["ttft_wall_s"] / scale for r in reqs if r["ttft_wall_s"] is not None]
    client_e2e = [r["e2e_wall_s"] / scale for r in reqs if r["e2e_wall_s"] is not None]
    return {
        "policy": arm["name"],
        "prefix_mode": arm["prefix_mode"],
        "requests": len(reqs),
        "errors": sum(1 for r in reqs if not r["ok"]),
        "hit_rate": (hits + cpu_hits) / queries if queries else 0.0,
        "gpu_hit_rate": hits / queries if queries else 0.0,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "client_ttft_p50_s": percentile(client_ttft, 50),
        "client_ttft_p99_s": percentile(client_ttft, 99),
        "client_e2e_p99_s": percentile(client_e2e, 99),
        "requests_per_engine": per_engine,
        "imbalance_max_over_mean": max(per_engine) / mean if mean else None,
        "imbalance_cv": statistics.pstdev(per_engine) / mean if mean else None,
        "prompt_tokens_cv": statistics.pstdev(tokens) / statistics.fmean(tokens) if any(tokens) else None,
        "preemptions": sum(e["preemptions"] for e in engines),
        "decide_ms_p50": 1000 * (percentile([r["decide_s"] for r in reqs], 50) or 0.0),
        "dispatch_lag_ms_p99": 1000 * (percentile([r["lag_s"] for r in reqs], 99) or 0.0),
        "wall_s": arm["wall_s"],
        "router_client_cpu_s": arm["router_client_cpu_s"],
        "engine_cpu_s": arm["engine_cpu_s"],
        "prefix_lookups": arm["prefix_lookups"],
        "engine_lag_dropped_s": sum(e.get("lag_dropped_s", 0.0) for e in engines),
        # Online only: where the engines' loop stalled (bench/replay/stalls.py).
        "engine_stalls": arm.get("engine_stalls"),
    }


# -- entry ------------------------------------------------------------------------------------------


def _candidates(text: str) -> CandidateSettings:
    try:
        prefix, least, random_ = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P,L,R (three whole numbers), got {text!r}") from None
    return CandidateSettings(prefix_holders=prefix, least_loaded=least, random=random_)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 120 requests, time scale 0.1")
    p.add_argument("--requests", type=int, default=3000, help="contiguous trace rows replayed (default 3000)")
    p.add_argument("--start", type=int, default=0, help="first trace row (default 0)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.12, help="wall seconds per simulated second")
    p.add_argument("--output-cap", type=int, default=512, help="max_tokens = min(output_length, this)")
    p.add_argument("--gpu-blocks", type=int, default=24_000, help="KV blocks of 16 tokens per engine")
    p.add_argument(
        "--cpu-offload-blocks",
        type=int,
        default=0,
        help="CPU offload tier per engine, in 16-token blocks (0 = none; 96000 ~ 4x the GPU's)",
    )
    # Off by default: at the trace's compressed time scale a 1 s scrape is ~70 scrapes/s of 8 engines'
    # /metrics, which starves the one core the engines share and stretches their model time (seen
    # here: e2e p99 x6, preemptions, for every policy), so the comparison would measure the bench.
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=0.0,
        help="simulated seconds between scrapes of each engine's /metrics; 0 = no engine signals (0)",
    )
    p.add_argument(
        "--engine",
        choices=["vllm", "sglang"],
        default="vllm",
        help="the simulated engines' surface: metric names and KV-event encoding (vllm)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="play the trace in virtual time, in this process (deterministic; bench/replay/offline.py)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1,
        help="the scheduler's tie-break seed (offline runs repeat exactly per seed)",
    )
    p.add_argument(
        "--wire-events",
        action="store_true",
        help="offline: encode the engines' KV events as vLLM does and decode them with the router's "
        "ingest (~20%% slower; by default they are handed over decoded, with the same results)",
    )
    p.add_argument(
        "--hash-algo",
        choices=HASH_ALGOS,
        default="xxhash",
        help="what the engines hash blocks with, as vLLM's --prefix-caching-hash-algo (xxhash: ~8x "
        "cheaper than sha256, and no decision changes: routers key blocks by their tokens)",
    )
    p.add_argument(
        "--candidates",
        type=_candidates,
        default=None,
        metavar="P,L,R",
        help="also run ours scoring a bounded candidate set (P prefix holders, L least loaded, R random) "
        "beside ours scoring every endpoint",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="also play each policy with this many router replicas, requests round robin, with peer "
        "sync and without (online: the real sync over loopback; offline: modelled). Default 1",
    )
    p.add_argument(
        "--sync-delay-ms",
        type=float,
        default=5.0,
        help="--offline --routers: model milliseconds a lease change takes to reach the other routers "
        "(online, it takes what the real sync takes)",
    )
    p.add_argument("--only", nargs="*", help="run only the policies whose names start with these")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="raw output (bench/results/raw/replay[_offline].json; its .md goes to bench/results/)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = REPO / f"bench/results/raw/replay{'_offline' if args.offline else ''}.json"
    if args.offline and args.scrape_interval > 0:
        p.error("--offline does not model engine signals: leave --scrape-interval at 0")
    if args.routers < 1:
        p.error(f"--routers N needs N >= 1, got {args.routers}")
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}: pass --trace PATH (a Mooncake-format .jsonl)")
    return args


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.requests, args.time_scale = min(args.requests, 120), 0.1
    requests = load(args.trace, requests=args.requests, start=args.start)
    if args.routers > 1:
        requests = spread_arrivals(requests)  # every arm of the run, the one-router ones too
    engine = {
        "block_size": 16,
        "num_gpu_blocks": args.gpu_blocks,
        # Mooncake prompts reach ~126k tokens: a 128k context, like the models the trace came from.
        "max_model_len": 131_072,
        "cpu_offload_blocks": args.cpu_offload_blocks,
        "prefix_caching_hash_algo": args.hash_algo,
    }
    cfg = Config(
        args.engines,
        args.time_scale,
        args.output_cap,
        engine,
        seed=args.seed,
        scrape_interval=args.scrape_interval,
        engine_kind=args.engine,
        wire_events=args.wire_events,
    )
    vocab = shipped_tokenizer().vocab_size
    bound = upper_bound(requests, engine_block=16)
    # The CPU tier is write-through (a superset of the GPU's blocks, mostly): an engine holds about
    # the larger of the two.
    fleet_tokens = cfg.engines * max(args.gpu_blocks, args.cpu_offload_blocks) * 16
    pooled = pooled_lru(requests, capacity_tokens=fleet_tokens, engine_block=16)
    result: dict[str, Any] = {
        "machine": machine(),
        "trace": {"path": str(args.trace), **summary(requests)},
        "config": {
            "engines": cfg.engines,
            "seed": cfg.seed,
            "time_scale": cfg.time_scale,
            "output_cap": cfg.output_cap,
            "engine_params": asdict(EngineParams(**engine)),
            "engine_kind": cfg.engine_kind,
            "vocab_size": vocab,
            "mode": "offline: virtual time, one process (bench/replay/offline.py)"
            if args.offline
            else f"online: wall clock, engines in a child process at time scale {cfg.time_scale:g}",
            "transport": (
                "in-process calls: scheduler, then the engine core; KV events through the router's "
                + (
                    "ingest, encoded as vLLM publishes them"
                    if cfg.wire_events
                    else "index, handed over decoded"
                )
            )
            if args.offline
            else "bench -> engine HTTP directly (no Envoy), streaming /v1/completions, token-id prompts",
            "engine_signals": (
                f"each engine's /metrics scraped every {cfg.scrape_interval:g} simulated s "
                "(running, waiting, KV usage)"
                if cfg.scrape_interval > 0
                else "none (policies see our in-flight counts and prefix matches only)"
            ),
        },
        "upper_bound": {
            "hit_rate_tokens": bound.hit_rate,
            "hit_rate_engine_blocks": bound.engine_hit_rate,
            "prompt_tokens": bound.prompt_tokens,
            "pooled_capacity_tokens": fleet_tokens,
            "pooled_hit_rate_engine_blocks": pooled.engine_hit_rate,
        },
        "arms": [],
    }
    started = time.monotonic()
    factories = default_arms(EngineParams(**engine), args.candidates)
    for factory, variant, arm_cfg in _variants(factories, cfg, args):
        arm = factory()
        if args.only and not any(arm.name.startswith(o) for o in args.only):
            continue
        arm.name += variant
        if args.offline:
            log.warning("arm %s: %d requests, offline (virtual time)", arm.name, len(requests))
            raw = offline_arm(arm, requests, arm_cfg, vocab)
            summary_ = summarize(raw, 1.0)
        else:
            log.warning("arm %s: %d requests, time scale %g", arm.name, len(requests), cfg.time_scale)
            raw = await run_arm(arm, requests, arm_cfg, vocab)
            summary_ = summarize(raw, cfg.time_scale)
        log.warning(
            "arm %s: hit %.3f ttft p50 %.3f p99 %.3f s, wall %.0f s",
            arm.name,
            summary_["hit_rate"],
            summary_["ttft_p50_s"] or -1,
            summary_["ttft_p99_s"] or -1,
            raw["wall_s"],
        )
        if stalls := summary_.get("engine_stalls"):
            log.warning(
                "arm %s: engines' loop stalled over %g s %d times (%.1f s in all, longest %.3f s; "
                "their process ran %.1f CPU s meanwhile, %.1f s of it collecting garbage)",
                arm.name,
                stalls["threshold_s"],
                stalls["stalls"],
                stalls["stalled_s"],
                stalls["longest_s"],
                stalls["stalled_cpu_s"],
                stalls["stalled_gc_s"],
            )
        result["arms"].append({"summary": summary_, "raw": raw})
    result["total_wall_s"] = time.monotonic() - started
    return result


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    result = asyncio.run(amain(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    with contextlib.suppress(OSError):
        md = report.write(result, args.out)
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
