"""The online replay: engines in a child process, the router(s) and the load client in this one.

Each arm gets a fresh fleet of simulated engines (empty caches) in a child process, and this process
runs the router's real decision path against it: the real :class:`Scheduler` with the real
:class:`PrefixRouting` (ZMQ KV-event subscriptions to every engine, the follower, the prefix
matcher), in-flight leases held until each response ends. Requests then go over HTTP straight to the
chosen engine: no Envoy, because on a 2-core machine Envoy's CPU would distort the engines' pacing
more than the routing we want to compare.

With ``--routers N`` this process runs N routers, each what one ``serve`` replica holds (its own
subscriptions, index, approximate memory, load view and scheduler), and requests go to them round
robin. Synced, they share their leases and approximate affinity through the real peer sync
(:class:`~extproc.serve.peering.Peering`, ZMQ over loopback), with whatever delay it really takes.
One scraper (when ``--scrape-interval`` asks for engine signals) feeds all of them: N replicas
would each scrape, but N times the scrapes would starve the engines' core and measure the bench.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from bench.replay.arms import MODEL, PATH, Arm, Config, Sent, replay_catalog
from bench.replay.routers import replica_scheduler, summed
from bench.replay.stalls import StallSampler
from bench.replay.trace import TraceRequest, prompt_tokens
from extproc.catalog.store import CatalogStore
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl
from extproc.demo.catalog import LocalWorkerSet, kv_ports_of
from extproc.engines.scraper import EngineScraper
from extproc.openai import read_request
from extproc.scheduling.hooks import remember_affinity
from extproc.serve.peering import Peering
from extproc.serve.prefix_routing import PrefixRouting
from extproc.settings import PrefixSettings, TokenizerSpec
from extproc.sim.engine_core import EngineParams
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


@dataclass(slots=True)
class OnlineRouter:
    """One replica's decision path, and its peer sync when the routers share."""

    routing: PrefixRouting
    control: RequestControl
    peering: Peering | None = None


def _router(
    index: int, arm: Arm, cfg: Config, store: CatalogStore, scraper: EngineScraper | None
) -> OnlineRouter:
    routing = PrefixRouting(PrefixSettings(tokenizers=(TokenizerSpec(MODEL, SHIPPED_TOKENIZER),)), store)
    load = LoadView()
    hooks = (remember_affinity(routing.matcher),)
    signals = None if scraper is None else scraper.usable
    scheduler = replica_scheduler(index, arm, cfg, load, routing, hooks, signals)
    control = RequestControl(catalog=lambda: store.current, scheduler=scheduler, load=load)
    router = OnlineRouter(routing, control)
    if cfg.routers > 1 and cfg.sync_delay_s is not None:
        router.peering = Peering("127.0.0.1:0", (), control, CollectorRegistry(), approx=routing.approx)
    return router


async def _peer(routers: list[OnlineRouter], wait_s: float = 10.0) -> None:
    """Each router follows every other's sync; returns once all hear from all (as serve's peers do)."""
    peerings = [r.peering for r in routers if r.peering is not None]
    for peering in peerings:
        peering.start()
    addresses = [f"127.0.0.1:{p.port}" for p in peerings]
    for peering, own in zip(peerings, addresses, strict=True):
        peering.add_peers(tuple(a for a in addresses if a != own))
    deadline = time.monotonic() + wait_s
    while not all(p.peers.connected(a) for p in peerings for a in p.peers.peers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"routers' peer sync not connected in {wait_s:g} s")
        await asyncio.sleep(0.05)


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
    scraper = None
    if cfg.scrape_interval > 0:
        scraper = EngineScraper(store, interval=cfg.scrape_interval * cfg.time_scale)
    routers = [_router(i, arm, cfg, store, scraper) for i in range(max(1, cfg.routers))]
    for router in routers:
        router.routing.start()
    store.publish(replay_catalog(worker_set))
    if scraper is not None:
        scraper.start()
    sent: list[Sent] = []
    loop = asyncio.get_running_loop()
    try:
        for router in routers:
            await _wait_subscribed(router.routing, 0 if arm.approximate else len(addresses))
        await _peer(routers)
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
                control = routers[len(sent) % len(routers)].control
                sent.append(record)
                tasks.append(asyncio.create_task(_one(session, control, arm, request, cfg, vocab, record)))
            await asyncio.gather(*tasks)
            wall = time.monotonic() - t0
            cpu = time.process_time() - cpu0
        conn.send("stop")
        engines = await loop.run_in_executor(None, _recv, conn, 60.0)
        lookups = summed(r.routing.matcher.counters.lookups for r in routers)
        peer_messages = _peer_messages(routers)
    finally:
        for router in routers:
            if router.peering is not None:
                await router.peering.stop()
            await router.routing.close()
        if scraper is not None:
            await scraper.close()
    return {
        "name": arm.name,
        "prefix_mode": "approximate" if arm.approximate else "precise",
        "routers": len(routers),
        "wall_s": wall,
        "router_client_cpu_s": cpu,
        "engine_cpu_s": engines["cpu_s"],
        "prefix_lookups": lookups,
        "peer_messages": peer_messages,
        "engines": engines["engines"],
        "engine_stalls": engines["stalls"],
        "requests": [asdict(s) for s in sent],
    }


def _peer_messages(routers: list[OnlineRouter]) -> dict[str, int] | None:
    """Peer-sync messages sent by all routers, by kind; None when they do not share."""
    peerings = [r.peering for r in routers if r.peering is not None]
    return summed(p.sync.sent for p in peerings) if peerings else None


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
