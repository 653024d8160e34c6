"""Fleet scale: one ``serve`` deciding for pools of 8 to 1,000 endpoints, through the real gRPC path.

The question (issue 40): does a decision's cost, and the idle cost of watching the fleet, grow with
the pool? For each pool size:

- **engines**: one child process answers ``GET /metrics`` on every endpoint's own loopback address
  (``127.0.x.y:PORT``) with the same SGLang-style page of ~28 kB: the simulator's SGLang series
  (``extproc.sim.sglang``) with a request in its histograms, plus filler histogram families up to
  the size of a real SGLang 0.5.23 page. Synthetic, and said so: it exercises the scraper's
  filtering and parsing at a real page's size, not SGLang's exact families;
- **serve**: ``python -m extproc serve`` with its defaults (scrape every 1 s), one worker set of N
  endpoints, in two modes: **approximate** (no tokenizer and no KV events: prompts are matched
  against our own routing history) and **precise** (the real Llama 3 tokenizer, and every endpoint
  publishing KV events: the engines' process runs one fake publisher per endpoint, vLLM's PUB and
  replay sockets on the endpoint's own address, each announcing ``--blocks-per-engine`` blocks of
  random tokens, and one endpoint in ten the load's chat prompt as well, so lookups find holders;
  then each stores and evicts one block a second, as a live engine's stream never stops);
- **idle**: serve's CPU (cores) and RSS while it only scrapes, over ``--idle-seconds``;
- **load**: the gRPC load client (``grpc_load``) sends 64-byte chats on ``--concurrency`` streams
  for ``--seconds``: decisions/s, p50, p99.

Time-driven, so it checks itself: the engines' process measures its own event-loop lag and counts
the scrapes it answered; a pool whose engines fell behind (lag p99 over 100 ms, or fewer than 80%
of the expected scrapes answered while idle) is marked invalid, with the reason. Writes
``bench/results/fleet.{json,md}``.

    python bench/fleet.py [--sizes 8 64 256 1000] [--modes approximate precise] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import orjson
from grpc_load import chat_body, closed_loop, one_stream, request_messages
from machine import machine, proc_cpu_seconds, provenance, record

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.openai import read_request
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.settings import TokenizerSpec
from extproc.sim.kv_events import BlockRemoved, BlockStored, KVEvent
from extproc.tokenize.registry import TokenizerRegistry

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from ports import free_port  # noqa: E402
from stack import wait_http  # noqa: E402

sys.path.insert(0, str(HERE.parent / "scripts"))
from fetch_tokenizers import ensure  # noqa: E402

MODEL = "fleet-model"
SIZES = (8, 64, 256, 1000)
MODES = ("approximate", "precise")
#: Precise mode: one endpoint in this many also holds the load's chat prompt.
HOLDER_EVERY = 10
BLOCK_SIZE = 16
#: A real SGLang 0.5.23 page, as its own collectors render it, is about this long.
PAGE_BYTES = 28_000
#: Engines whose loop lags more than this (p99) answered scrapes late: the pool's run is invalid.
MAX_ENGINE_LAG_S = 0.1


def addresses(count: int, port: int) -> list[str]:
    """``count`` distinct loopback addresses (127.0.0.0/8 is all loopback on Linux), one port."""
    return [f"127.0.{i // 250}.{i % 250 + 1}:{port}" for i in range(count)]


def engine_page(model: str, size: int = PAGE_BYTES) -> bytes:
    """The simulator's SGLang series with one request observed, padded with filler histograms."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from extproc.sim.metrics import RankStats
    from extproc.sim.sglang import SGLangMetrics

    stats = RankStats("0", 3, 1, 0.42, 120_000, 80_000, 0, 150_000, 40_000)
    metrics = SGLangMetrics(model_name=model, stats=lambda: [stats], max_total_tokens=500_000)
    metrics.ttft.labels("unified", "false", model).observe(0.2)
    metrics.e2e.labels("unified", "false", model).observe(2.0)
    page = generate_latest(metrics.registry)
    filler = CollectorRegistry()
    buckets = tuple(0.001 * 1.5**i for i in range(30))
    stage = 0
    while len(page) + len(generate_latest(filler)) < size:
        histogram = Histogram(
            f"sglang:per_stage_req_latency_seconds_{stage}",
            "The latency of each stage of requests (filler at a real page's size).",
            ["engine_type", "model_name", "stage"],
            buckets=buckets,
            registry=filler,
        )
        histogram.labels("unified", model, f"stage_{stage}").observe(0.01)
        stage += 1
    return page + generate_latest(filler)


@dataclass(frozen=True)
class KvPlan:
    """What the engines' fake KV-event publishers announce (precise mode)."""

    #: Every endpoint publishes on this port (and replays on the next) of its own address.
    port: int
    #: The load's chat prompt, as the router tokenizes it: whole blocks of it are announced.
    prompt_ids: tuple[int, ...]
    blocks_per_engine: int


def kv_events(endpoint: str, number: int, plan: KvPlan) -> list[KVEvent]:
    """An engine's announcements: random blocks, and the chat prompt's for one endpoint in ten."""
    rng = random.Random(endpoint)

    def digest(i: object) -> bytes:
        return hashlib.blake2b(f"{endpoint}/{i}".encode(), digest_size=16).digest()

    tokens = tuple(rng.randrange(100_000) for _ in range(plan.blocks_per_engine * BLOCK_SIZE))
    hashes = tuple(digest(i) for i in range(plan.blocks_per_engine))
    events: list[KVEvent] = [BlockStored(hashes, None, tokens, BLOCK_SIZE, None, None)]
    whole = len(plan.prompt_ids) // BLOCK_SIZE
    if number % HOLDER_EVERY == 0 and whole:
        prompt = tuple(digest(f"prompt/{i}") for i in range(whole))
        events.append(
            BlockStored(prompt, None, plan.prompt_ids[: whole * BLOCK_SIZE], BLOCK_SIZE, None, None)
        )
    return events


def engines_main(endpoints: list[str], page: bytes, conn: Connection, kv: KvPlan | None = None) -> None:
    """Child process: answer /metrics on every endpoint (and publish KV events from it, given
    ``kv``) until told to stop; report what it saw."""
    import uvloop
    import zmq
    import zmq.asyncio
    from aiohttp import web

    from extproc.sim.kv_publisher import KVEventPublisher
    from extproc.sim.settings import KVEventSettings

    async def run() -> dict[str, Any]:
        served = 0

        async def metrics(_request: web.Request) -> web.Response:
            nonlocal served
            served += 1
            return web.Response(body=page, content_type="text/plain", charset="utf-8")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for endpoint in endpoints:
            host, _, port = endpoint.rpartition(":")
            await web.TCPSite(runner, host, int(port), backlog=1024).start()
        publishers: list[KVEventPublisher] = []
        context = zmq.asyncio.Context()
        context.set(zmq.MAX_SOCKETS, 65_536)  # two sockets an endpoint; libzmq's default cap is 1,023
        for number, endpoint in enumerate(endpoints if kv is not None else ()):
            assert kv is not None
            host = endpoint.rpartition(":")[0]
            publisher = KVEventPublisher(
                KVEventSettings(port=kv.port, replay_port=kv.port + 1), host=host, context=context
            )
            await publisher.start()
            publisher.publish(kv_events(endpoint, number, kv), ts=time.time())
            publishers.append(publisher)
        lags: list[float] = []

        async def heartbeat() -> None:
            while True:
                due = time.monotonic() + 0.05
                await asyncio.sleep(0.05)
                lags.append(max(0.0, time.monotonic() - due))

        async def churn() -> None:
            """Each engine stores and evicts one fresh block a second, spread over the second: a
            subscriber joins (replaying what was announced before it came) at the next message."""
            tick = 0
            while publishers:
                tick += 1
                for group in range(10):
                    await asyncio.sleep(0.1)
                    for number in range(group, len(publishers), 10):
                        digest = hashlib.blake2b(f"{number}/churn/{tick}".encode(), digest_size=16).digest()
                        tokens = tuple(range(tick, tick + BLOCK_SIZE))
                        stored = BlockStored((digest,), None, tokens, BLOCK_SIZE, None, None)
                        publishers[number].publish([stored, BlockRemoved((digest,))], ts=time.time())

        beat = asyncio.create_task(heartbeat())
        churning = asyncio.create_task(churn())
        loop = asyncio.get_running_loop()
        conn.send("ready")
        marks: dict[str, Any] = {}
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                break
            # A mark: the scrapes answered and the lag seen since the previous one.
            marks[command] = {"served": served, "lag_p99_s": _p99(lags), "lag_max_s": max(lags, default=0.0)}
            lags.clear()
            conn.send(marks[command])
        beat.cancel()
        churning.cancel()
        for publisher in publishers:
            await publisher.close()
        context.destroy(linger=0)
        await runner.cleanup()
        return marks

    conn.send(uvloop.run(run()))


async def wait_index(admin_port: int, blocks: int, within: float = 120.0) -> int:
    """Blocks serve's KV-event index holds (``extproc_kv_index_blocks`` summed), once it holds
    ``blocks`` or ``within`` seconds have passed."""
    from prometheus_client.parser import text_string_to_metric_families

    def held() -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return int(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "extproc_kv_index_blocks"
                for sample in family.samples
            )
        )

    deadline = time.monotonic() + within
    count = await asyncio.to_thread(held)
    while count < blocks and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        count = await asyncio.to_thread(held)
    return count


def prompt_ids() -> tuple[int, ...]:
    """The load's chat prompt as serve tokenizes it with the Llama 3 tokenizer (precise mode)."""
    tokenizer = TokenizerRegistry.load([TokenizerSpec(MODEL, str(ensure("llama3")))]).get(MODEL)
    assert tokenizer is not None
    prompt = read_request("/v1/chat/completions", orjson.loads(chat_body(MODEL))).read_prompt()
    assert prompt is not None
    ids = tokenizer.prompt_ids(prompt)
    assert ids is not None, "the Llama 3 tokenizer has a chat template"
    return tuple(ids)


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * len(ordered)))]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_pool(
    size: int, mode: str, args: argparse.Namespace, tmp: Path, page: bytes, prompt_ids: tuple[int, ...]
) -> dict[str, Any]:
    """Engines, serve, idle measure, load measure, for one pool of ``size`` endpoints."""
    endpoints = addresses(size, free_port())
    kv = KvPlan(free_port(), prompt_ids, args.blocks_per_engine) if mode == "precise" else None
    kv_ports = {e: (kv.port, kv.port + 1) for e in endpoints} if kv is not None else {}
    catalog = tmp / f"catalog-{size}-{mode}.yaml"
    catalog.write_text(
        catalog_yaml([LocalWorkerSet("fleet", MODEL, endpoints, kv_block_size=BLOCK_SIZE, kv_ports=kv_ports)])
    )
    tokenizer = ["--tokenizer", f"{MODEL}={ensure('llama3')}"] if mode == "precise" else []
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    engines = ctx.Process(target=engines_main, args=(endpoints, page, child, kv), daemon=True)
    engines.start()
    serve: asyncio.subprocess.Process | None = None
    try:
        assert await asyncio.to_thread(parent.recv) == "ready"
        grpc_port, admin_port = free_port(), free_port()
        serve = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "--log-level", "error", "serve",
            "--source", f"file:{catalog}", "--listen", f"127.0.0.1:{grpc_port}",
            "--admin-listen", f"127.0.0.1:{admin_port}", "--seed", "1", *tokenizer,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await wait_http(f"http://127.0.0.1:{admin_port}/readyz", within=60.0)
        await asyncio.sleep(args.settle_seconds)  # every endpoint scraped at least once
        index_blocks = await wait_index(admin_port, size * args.blocks_per_engine if kv else 0)

        def mark(name: str) -> dict[str, Any]:
            parent.send(name)
            answer: dict[str, Any] = parent.recv()
            return answer

        before = await asyncio.to_thread(mark, "idle-start")
        cpu0, t0 = proc_cpu_seconds(serve.pid), time.monotonic()
        await asyncio.sleep(args.idle_seconds)
        idle_s = time.monotonic() - t0
        idle_cpu = (proc_cpu_seconds(serve.pid) - cpu0) / idle_s
        idle = await asyncio.to_thread(mark, "idle-end")
        rss_idle = rss_mb(serve.pid)
        scrapes = idle["served"] - before["served"]
        expected = size * idle_s  # one scrape per endpoint per second (the default interval)
        messages = request_messages(chat_body(MODEL))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
            load = await closed_loop(
                lambda: one_stream(stub, messages),
                concurrency=args.concurrency,
                duration=args.seconds,
                pids={"serve": serve.pid},
            )
        loaded = await asyncio.to_thread(mark, "load-end")
        problems = []
        if idle["lag_p99_s"] > MAX_ENGINE_LAG_S or loaded["lag_p99_s"] > MAX_ENGINE_LAG_S:
            problems.append(
                f"the engines' loop lagged (p99 {idle['lag_p99_s'] * 1000:.0f} ms idle, "
                f"{loaded['lag_p99_s'] * 1000:.0f} ms under load): scrapes were answered late"
            )
        if scrapes < 0.8 * expected:
            problems.append(f"only {scrapes} of ~{expected:.0f} expected scrapes answered while idle")
        if load["errors"]:
            problems.append(f"{load['errors']} streams failed: {load['first_error']}")
        if kv is not None and index_blocks < size * args.blocks_per_engine:
            problems.append(
                f"the index held {index_blocks} blocks, not the {size * args.blocks_per_engine} announced"
            )
        return {
            "endpoints": size,
            "mode": mode,
            "index_blocks": index_blocks,
            "idle": {
                "seconds": round(idle_s, 2),
                "serve_cpu": round(idle_cpu, 3),
                "serve_rss_mb": round(rss_idle, 1),
                "scrapes_per_s": round(scrapes / idle_s, 1),
                "engine_lag_p99_ms": round(idle["lag_p99_s"] * 1000, 1),
            },
            "load": {
                "decisions_per_s": round(load["per_s"], 1),
                "p50_ms": round(load["latency"]["p50_ms"], 2),
                "p99_ms": round(load["latency"]["p99_ms"], 2),
                "serve_cpu": round(load["cpu"]["serve"], 3),
                "machine_cpu": round(load["cpu"]["machine"], 3),
                "errors": load["errors"],
                "engine_lag_p99_ms": round(loaded["lag_p99_s"] * 1000, 1),
            },
            "serve_rss_mb_after": round(rss_mb(serve.pid), 1),
            "valid": not problems,
            "problems": problems,
        }
    finally:
        if serve is not None and serve.returncode is None:
            serve.terminate()
            await serve.wait()
        if engines.is_alive():
            parent.send("stop")
            await asyncio.to_thread(engines.join, 10)
        if engines.is_alive():
            engines.kill()


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Fleet scale: one serve, pools of 8 to 1,000 endpoints",
        "",
        f"{provenance(results['machine'])}. One worker set of N endpoints on N loopback addresses, "
        f"each answering `/metrics` with a {results['page_bytes'] / 1000:.0f} kB SGLang-style page "
        "(synthetic: the simulator's SGLang series plus filler histograms to a real page's size), all "
        "from one engines process; `serve` with its defaults (scrape every 1 s); the gRPC load client "
        f"sends 64-byte chats on {results['concurrency']} streams for {results['seconds']:g} s; idle "
        f"measured over {results['idle_seconds']:g} s. *approximate*: no tokenizer, no KV events. "
        "*precise*: the Llama 3 tokenizer, and one fake vLLM KV-event publisher per endpoint (PUB and "
        f"replay on its own address), each announcing {results['blocks_per_engine']:,} blocks of "
        f"random tokens, one endpoint in {HOLDER_EVERY} the chat prompt's blocks too.",
    ]
    for mode in results["modes"]:
        rows = [row for row in results["pools"] if row.get("mode", "approximate") == mode]
        if not rows:
            continue
        lines += [
            "",
            f"**{mode}**",
            "",
            "| endpoints | decisions/s | p50 ms | p99 ms | serve CPU under load | serve CPU idle "
            "| scrapes/s | RSS MB idle | index blocks | valid |",
            "|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
        ]
        for row in rows:
            idle, load = row["idle"], row["load"]
            valid = "yes" if row["valid"] else "**no**: " + "; ".join(row["problems"])
            lines.append(
                f"| {row['endpoints']:,} | {load['decisions_per_s']:,.0f} | {load['p50_ms']} "
                f"| {load['p99_ms']} | {load['serve_cpu']} | {idle['serve_cpu']} "
                f"| {idle['scrapes_per_s']:,.0f} | {idle['serve_rss_mb']} | {row.get('index_blocks', 0):,} "
                f"| {valid} |"
            )
        first, last = rows[0], rows[-1]
        lines += [
            "",
            f"At {last['endpoints']:,} endpoints against {first['endpoints']}: decisions/s "
            f"{last['load']['decisions_per_s'] / max(first['load']['decisions_per_s'], 1e-9):.2f}x, "
            f"p99 {last['load']['p99_ms'] / max(first['load']['p99_ms'], 1e-9):.1f}x "
            "(issue 40's targets, for the defaults: at least 0.7x and at most 2x; idle scraping at "
            "most 0.2 cores; RSS at most 150 MB).",
        ]
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    page = engine_page(MODEL)
    ids = prompt_ids() if "precise" in args.modes else ()
    pools = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for size in args.sizes:
                pool = await one_pool(size, mode, args, Path(tmp), page, ids)
                load, idle = pool["load"], pool["idle"]
                print(
                    f"{mode}, {size} endpoints: {load['decisions_per_s']:.0f}/s, idle CPU {idle['serve_cpu']}"
                )
                pools.append(pool)
    return {
        "machine": machine(),
        "page_bytes": len(page),
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "idle_seconds": args.idle_seconds,
        "modes": args.modes,
        "blocks_per_engine": args.blocks_per_engine,
        "pools": pools,
        "median_decisions_per_s": statistics.median(p["load"]["decisions_per_s"] for p in pools),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--blocks-per-engine",
        type=int,
        default=200,
        help="precise mode: blocks each fake publisher announces",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each load measure")
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="length of each idle measure")
    parser.add_argument(
        "--settle-seconds", type=float, default=3.0, help="wait after ready, before measuring"
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "fleet.json")
    args = parser.parse_args()
    record(args.out, asyncio.run(main_async(args)), report)


if __name__ == "__main__":
    main()
