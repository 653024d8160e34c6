"""Replay a Mooncake trace against simulated engines, one routing policy after another.

Each policy ("arm") gets a fresh fleet of simulated engines (empty caches) in a child process, and
the bench process runs the router's real decision path against it: the real :class:`Scheduler`
with the real :class:`PrefixRouting` (tokenizer ``extproc:tiny``, ZMQ KV-event subscriptions to
every engine, the follower, the prefix matcher), in-flight leases held until each response ends.
Requests then go over HTTP straight to the chosen engine: no Envoy, because on a 2-core machine
Envoy's CPU would distort the engines' pacing more than the routing we want to compare.

Two processes so both cores work: engines (their model-time pacing is sensitive to CPU starvation)
in the child, router + load client in the parent. Engine-side numbers (prefix-cache counters, TTFT
and end-to-end latency in *simulated* seconds) come back from the child when the arm ends.

Run from the repo root: ``.venv/bin/python -m bench.replay [--quick]`` (see ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.machine import machine
from bench.replay import report
from bench.replay.arms import (
    MODEL,
    PATH,
    REPO,
    TRACE,
    Arm,
    Config,
    Sent,
    default_arms,
    replay_catalog,
)
from bench.replay.offline import OfflineReplay
from bench.replay.stalls import StallSampler
from bench.replay.trace import (
    TraceRequest,
    load,
    pooled_lru,
    prompt_tokens,
    spread_arrivals,
    summary,
    upper_bound,
)
from extproc.catalog.store import CatalogStore
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl
from extproc.demo.catalog import LocalWorkerSet, kv_ports_of
from extproc.engines.scraper import EngineScraper
from extproc.openai import read_request
from extproc.scheduling.hooks import remember_affinity
from extproc.scheduling.scheduler import Scheduler
from extproc.serve.prefix_routing import PrefixRouting
from extproc.settings import CandidateSettings, PrefixSettings, TokenizerSpec
from extproc.sim.engine_core import EngineParams
from extproc.sim.prefix_cache import HASH_ALGOS
from extproc.tokenize import shipped_tokenizer
from extproc.tokenize.registry import SHIPPED_TOKENIZER

log = logging.getLogger("bench.replay")


# -- the engines (child process) --------------------------------------------------------------------


def fleet_main(config: dict[str, Any], conn: Connection) -> None:
    """Child process entry: run the fleet until told to stop, then send back the engines' numbers."""
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_fleet(config, conn))


async def _fleet(config: dict[str, Any], conn: Connection) -> None:
    from extproc.sim.fleet import SimFleet
    from extproc.sim.kv_wire import EventEncoding
    from extproc.sim.settings import KVEventSettings, SimSettings

    kind = config.get("engine_kind", "vllm")
    encoding = EventEncoding.SGLANG if kind == "sglang" else EventEncoding.MAPS
    settings = SimSettings(
        engine_kind=kind,
        listen="127.0.0.1:0",
        served_model_names=(MODEL,),
        engine=EngineParams(**config["engine"]),
        time_scale=config["time_scale"],
        enable_prompt_tokens_details=True,
        kv_events=KVEventSettings(port=0, replay_port=0, encoding=encoding),
    )
    observed: dict[str, dict[str, list[float]]] = {}
    cpu0 = time.process_time()
    stalls = StallSampler()
    stalls.start()
    async with SimFleet(settings, replicas=config["engines"]) as fleet:
        for server in fleet.servers:
            seen = observed.setdefault(server.address, {"ttft": [], "queue": [], "e2e": []})
            _tap(server.metrics, seen)
        conn.send(
            [
                {
                    "address": s.address,
                    "kv": s.state()["ranks"][0]["kv_events"]["endpoint"],
                    "replay": s.state()["ranks"][0]["kv_events"]["replay_endpoint"],
                }
                for s in fleet.servers
            ]
        )
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        engines = []
        for server in fleet.servers:
            stats = [rank.stats() for rank in server.ranks]
            engines.append(
                {
                    "address": server.address,
                    "prefix_cache_queries": sum(s.prefix_cache_queries for s in stats),
                    "prefix_cache_hits": sum(s.prefix_cache_hits for s in stats),
                    # Hits on the CPU offload tier (0 without one): loaded back, not recomputed.
                    "external_prefix_cache_hits": sum(s.external_prefix_cache_hits for s in stats),
                    "preemptions": sum(s.num_preemptions for s in stats),
                    "prompt_tokens": sum(s.prompt_tokens for s in stats),
                    "requests_finished": server.requests_finished,
                    # Wall seconds the engine loops fell behind their model and gave up on.
                    "lag_dropped_s": sum(rank.loop.lag_dropped_s for rank in server.ranks),
                    **observed[server.address],
                }
            )
        stalls.stop()
        conn.send({"engines": engines, "cpu_s": time.process_time() - cpu0, "stalls": stalls.summary()})


def _tap(metrics: Any, seen: dict[str, list[float]]) -> None:
    """Keep every TTFT / queue / e2e observation (simulated seconds), not just histogram buckets."""
    first, finished = metrics.observe_first_token, metrics.observe_finished

    def observe_first_token(engine: str, *, ttft: float, queue_time: float) -> None:
        seen["ttft"].append(ttft)
        seen["queue"].append(queue_time)
        first(engine, ttft=ttft, queue_time=queue_time)

    def observe_finished(engine: str, *, e2e: float, finish_reason: str) -> None:
        seen["e2e"].append(e2e)
        finished(engine, e2e=e2e, finish_reason=finish_reason)

    metrics.observe_first_token = observe_first_token
    metrics.observe_finished = observe_finished


# -- the router + client (this process) -------------------------------------------------------------


async def run_arm(arm: Arm, requests: list[TraceRequest], cfg: Config, vocab: int) -> dict[str, Any]:
    """Start fresh engines, replay ``requests`` at their scaled arrival times, collect everything."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=fleet_main,
        args=(
            {
                "engines": cfg.engines,
                "time_scale": cfg.time_scale,
                "engine": cfg.engine,
                "engine_kind": cfg.engine_kind,
            },
            child,
        ),
        daemon=True,
    )
    proc.start()
    loop = asyncio.get_running_loop()
    try:
        servers = await loop.run_in_executor(None, _recv, parent, 60.0)
        return await _replay(arm, requests, cfg, vocab, servers, parent)
    finally:
        if proc.is_alive():
            with contextlib.suppress(OSError):
                parent.send("stop")  # an arm that failed midway: let the engines shut down cleanly
            proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def _recv(conn: Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer from the engine process in {timeout:g} s")
    return conn.recv()


async def _replay(
    arm: Arm,
    requests: list[TraceRequest],
    cfg: Config,
    vocab: int,
    servers: list[dict[str, str]],
    conn: Connection,
) -> dict[str, Any]:
    addresses = [s["address"] for s in servers]
    kv_ports = {} if arm.approximate else {s["address"]: kv_ports_of(s["kv"], s["replay"]) for s in servers}
    worker_set = LocalWorkerSet(
        "replay", MODEL, addresses, kv_block_size=cfg.engine.get("block_size", 16), kv_ports=kv_ports
    )
    store = CatalogStore()
    routing = PrefixRouting(PrefixSettings(tokenizers=(TokenizerSpec(MODEL, SHIPPED_TOKENIZER),)), store)
    routing.start()
    store.publish(replay_catalog(worker_set))
    scraper = None
    if cfg.scrape_interval > 0:
        scraper = EngineScraper(store, interval=cfg.scrape_interval * cfg.time_scale)
        scraper.start()
    load = LoadView()
    scheduler = Scheduler(
        load,
        arm.policy,
        max_fallbacks=0,
        rng=random.Random(cfg.seed),
        prefix=routing.matcher,
        signals=None if scraper is None else scraper.usable,
        hooks=(remember_affinity(routing.matcher),),
        candidates=arm.candidates,
    )
    control = RequestControl(catalog=lambda: store.current, scheduler=scheduler, load=load)
    sent: list[Sent] = []
    loop = asyncio.get_running_loop()
    try:
        await _wait_subscribed(routing, 0 if arm.approximate else len(addresses))
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            cpu0, t0 = time.process_time(), time.monotonic()
            tasks = []
            for request in requests:
                due = t0 + request.arrival_s * cfg.time_scale
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                record = Sent(request.index, "", lag_s=max(time.monotonic() - due, 0.0))
                sent.append(record)
                tasks.append(asyncio.create_task(_one(session, control, arm, request, cfg, vocab, record)))
            await asyncio.gather(*tasks)
            wall = time.monotonic() - t0
            cpu = time.process_time() - cpu0
        conn.send("stop")
        engines = await loop.run_in_executor(None, _recv, conn, 60.0)
        lookups = dict(routing.matcher.counters.lookups)
    finally:
        await routing.close()
        if scraper is not None:
            await scraper.close()
    return {
        "name": arm.name,
        "prefix_mode": "approximate" if arm.approximate else "precise",
        "wall_s": wall,
        "router_client_cpu_s": cpu,
        "engine_cpu_s": engines["cpu_s"],
        "prefix_lookups": lookups,
        "engines": engines["engines"],
        "engine_stalls": engines["stalls"],
        "requests": [asdict(s) for s in sent],
    }


async def _wait_subscribed(routing: PrefixRouting, sources: int, wait_s: float = 20.0) -> None:
    """Traffic starts only once every engine's KV-event subscription is connected (a fresh engine has
    published nothing yet, so there is nothing to sync until the first event)."""
    deadline = time.monotonic() + wait_s
    while sources and time.monotonic() < deadline:
        stats = routing.subscriptions.stats()
        if len(stats) >= sources and all(s.connected for s in stats.values()):
            await asyncio.sleep(0.2)  # ZMQ's slow joiner: let PUB see the SUB before the first event
            return
        await asyncio.sleep(0.05)
    if sources:
        raise TimeoutError(f"KV-event subscriptions not ready: {routing.subscriptions.stats()}")


async def _one(
    session: aiohttp.ClientSession,
    control: RequestControl,
    arm: Arm,
    request: TraceRequest,
    cfg: Config,
    vocab: int,
    record: Sent,
) -> None:
    """Route one request through the real scheduler, send it to the pick, hold the lease to the end."""
    start = time.monotonic()
    max_tokens = max(1, min(request.output_length, cfg.output_cap))
    body = {
        "model": MODEL,
        "prompt": prompt_tokens(request, vocab),
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    decision = control.decide(read_request(PATH, body))
    address = decision.pick.address
    record.endpoint = address
    record.router_cached = decision.prefix.cached_tokens.get(address, 0)
    record.decide_s = time.monotonic() - start
    tokens, seconds = decision.prefill
    lease = control.acquire(
        address, model=MODEL, prefill_tokens=tokens, prefill_seconds=seconds * cfg.time_scale
    )
    if arm.active is not None:
        arm.active.start(request.index, address, request.input_length, record.router_cached)
    try:
        async with session.post(f"http://{address}{PATH}", data=orjson.dumps(body)) as resp:
            if resp.status != 200:
                record.error = f"{resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = orjson.loads(line[6:])
                if record.ttft_wall_s is None and chunk.get("choices"):
                    record.ttft_wall_s = time.monotonic() - start
                    if arm.active is not None:
                        arm.active.first_token(request.index)
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    record.engine_cached = details.get("cached_tokens")
        record.e2e_wall_s = time.monotonic() - start
        record.ok = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        record.error = repr(exc)
    finally:
        control.release(lease)
        if arm.active is not None:
            arm.active.finish(request.index)


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
        help="--offline: also play each policy with this many router replicas, requests round robin, "
        "with peer sync and without (default 1: one router)",
    )
    p.add_argument(
        "--sync-delay-ms",
        type=float,
        default=5.0,
        help="--routers: model milliseconds a lease change takes to reach the other routers",
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
    if args.routers < 1 or (args.routers > 1 and not args.offline):
        p.error("--routers N (N >= 1) is modelled in --offline replays only")
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
            raw = await run_arm(arm, requests, cfg, vocab)
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
