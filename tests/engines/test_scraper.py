"""The scraper against real simulated engines (and a few misbehaving servers) on loopback."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from ports import free_port
from simulated import StartSim
from waiting import eventually

from extproc.catalog.model import Catalog, Endpoint, ServedModel, WorkerSet
from extproc.catalog.store import CatalogStore
from extproc.demo.catalog import LocalWorkerSet
from extproc.engines.scraper import FOLLOW_SLICE, EndpointSignals, EngineScraper, metrics_urls
from extproc.types import EndpointAddress, ModelName, WorkerSetKey

from .test_parity import catalog_of

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
INTERVAL = 0.05


@pytest.fixture
def sim(sim: StartSim) -> StartSim:
    """The shared factory, engines serving MODEL."""
    return functools.partial(sim, served_model_names=(MODEL,))


def publish(store: CatalogStore, *addresses: str) -> None:
    store.publish(catalog_of([LocalWorkerSet("llama", MODEL, list(addresses))]))


@pytest.fixture
async def scraper() -> AsyncIterator[tuple[CatalogStore, EngineScraper]]:
    store = CatalogStore()
    scraper = EngineScraper(store, interval=INTERVAL, timeout=0.5)
    scraper.start()
    yield store, scraper
    await scraper.close()


def entry(scraper: EngineScraper, address: str) -> EndpointSignals | None:
    return scraper.snapshot().get(EndpointAddress(address))


async def until(
    scraper: EngineScraper, address: str, test: Callable[[EndpointSignals], bool]
) -> EndpointSignals:
    def ok() -> bool:
        found = entry(scraper, address)
        return found is not None and test(found)

    await eventually(ok, within=5.0)
    found = entry(scraper, address)
    assert found is not None
    return found


async def test_signals_appear_for_every_endpoint(
    sim: StartSim, scraper: tuple[CatalogStore, EngineScraper]
) -> None:
    """Each ready endpoint gets fresh signals, its DP ranks and served names visible."""
    store, scraper_ = scraper
    one, two = await sim(), await sim(data_parallel_size=2)
    publish(store, one.address, two.address)
    first = await until(scraper_, one.address, lambda e: e.usable is not None)
    second = await until(scraper_, two.address, lambda e: e.usable is not None)
    assert first.signals is not None and second.signals is not None
    assert first.url == f"http://{one.address}/metrics" and first.error is None
    assert (first.signals.running, first.signals.waiting, first.signals.kv_cache_usage) == (0, 0, 0.0)
    assert first.signals.model_names == (MODEL,) and first.signals.engines == ("0",)
    assert second.signals.engines == ("0", "1") and second.signals.data_parallel_size == 2
    state = scraper_.debug_state()
    assert state["endpoints"][one.address]["signals"]["running"] == 0
    assert state["intervalSeconds"] == INTERVAL


async def test_a_running_request_shows_up_and_goes_away(
    sim: StartSim, scraper: tuple[CatalogStore, EngineScraper]
) -> None:
    store, scraper_ = scraper
    server = await sim(time_scale=1.0)
    publish(store, server.address)
    body = {"model": MODEL, "prompt": list(range(100, 164)), "max_tokens": 400, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{server.address}/v1/completions", json=body) as resp,
    ):
        await resp.content.readline()
        busy = await until(scraper_, server.address, lambda e: e.usable is not None and e.usable.running == 1)
        assert busy.signals is not None and busy.signals.kv_cache_usage is not None
        assert busy.signals.kv_cache_usage > 0
    await until(scraper_, server.address, lambda e: e.usable is not None and e.usable.running == 0)


async def test_an_endpoint_that_stops_answering_goes_stale_with_a_reason(
    sim: StartSim, scraper: tuple[CatalogStore, EngineScraper]
) -> None:
    """The last good signals are kept for people to read, but marked stale; the error says why."""
    store, scraper_ = scraper
    server = await sim()
    publish(store, server.address)
    await until(scraper_, server.address, lambda e: e.usable is not None)
    await server.stop()
    gone = await until(scraper_, server.address, lambda e: e.stale and e.error is not None)
    assert gone.usable is None and gone.signals is not None
    assert gone.error is not None and "Connect" in gone.error
    assert scraper_.debug_state()["endpoints"][server.address]["failures"] >= 1


async def test_a_stopped_engine_is_unreachable_once_and_reachable_when_back(sim: StartSim) -> None:
    """Refused connections mark the engine gone (one notification); its return clears the mark."""
    store, gone = CatalogStore(), []
    scraper_ = EngineScraper(store, interval=INTERVAL, timeout=0.5, on_unreachable=gone.append)
    scraper_.start()
    try:
        port = free_port()
        server = await sim(listen=f"127.0.0.1:{port}")
        publish(store, server.address)
        await until(scraper_, server.address, lambda e: e.usable is not None)
        address = EndpointAddress(server.address)
        assert scraper_.reachable(address)
        await server.stop()
        await eventually(lambda: not scraper_.reachable(address), what="the stopped engine noticed")
        rounds = scraper_.rounds
        await eventually(lambda: scraper_.rounds >= rounds + 2, what="more failed scrapes")
        assert gone == [address]  # once per outage, not once per failed scrape
        assert scraper_.debug_state()["endpoints"][address]["unreachable"] is True
        await sim(listen=f"127.0.0.1:{port}")
        await eventually(lambda: scraper_.reachable(address), what="the engine back")
        assert gone == [address]
    finally:
        await scraper_.close()


async def test_a_connection_the_gateway_could_not_open_marks_the_engine_until_a_scrape_answers(
    sim: StartSim,
) -> None:
    """Envoy's report is acted on at once; a live engine's next scrape clears a mistaken mark."""
    store, gone = CatalogStore(), []
    scraper_ = EngineScraper(store, interval=INTERVAL, timeout=0.5, on_unreachable=gone.append)
    server = await sim()
    publish(store, server.address)
    address = EndpointAddress(server.address)
    scraper_.connection_failed(address)
    scraper_.connection_failed(address)
    scraper_.connection_failed(EndpointAddress("127.0.0.9:1"))  # not in the catalog: ignored
    assert not scraper_.reachable(address) and gone == [address]  # one notification per outage
    scraper_.start()
    try:
        await eventually(lambda: scraper_.reachable(address), what="the scrape that finds it alive")
    finally:
        await scraper_.close()


async def test_an_engine_the_gateway_retried_away_from_is_avoided_until_its_next_scrape(
    sim: StartSim,
) -> None:
    """A retry elsewhere says little about why: the engine is avoided, and a scrape decides.

    Alive, it is back at once, with nothing forgotten; gone, it turns unreachable as usual."""
    store, gone = CatalogStore(), []
    scraper_ = EngineScraper(store, interval=INTERVAL, timeout=0.5, on_unreachable=gone.append)
    alive, dead = await sim(), await sim()
    publish(store, alive.address, dead.address)
    await dead.stop()
    for server in (alive, dead):
        scraper_.retried_away(EndpointAddress(server.address))
        assert not scraper_.reachable(EndpointAddress(server.address))
    assert gone == []  # a suspicion forgets nothing
    scraper_.start()
    try:
        await eventually(lambda: scraper_.rounds >= 1, what="a scrape round")
        assert scraper_.reachable(EndpointAddress(alive.address))
        assert not scraper_.reachable(EndpointAddress(dead.address))
        assert gone == [EndpointAddress(dead.address)]
    finally:
        await scraper_.close()


async def test_an_endpoint_removed_from_the_catalog_disappears(
    sim: StartSim, scraper: tuple[CatalogStore, EngineScraper]
) -> None:
    store, scraper_ = scraper
    one, two = await sim(), await sim()
    publish(store, one.address, two.address)
    await until(scraper_, two.address, lambda e: e.usable is not None)
    publish(store, one.address)
    assert set(scraper_.snapshot()) == {one.address}  # at once, not at the next round
    rounds = scraper_.rounds
    await eventually(lambda: scraper_.rounds >= rounds + 2)
    assert set(scraper_.snapshot()) == {one.address}


@pytest.fixture
async def bad_server() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """One HTTP server whose /metrics misbehaves as ``mode["kind"]`` says."""
    mode: dict[str, Any] = {"kind": "garbage"}
    release = asyncio.Event()

    async def metrics(request: web.Request) -> web.StreamResponse:
        kind = mode["kind"]
        if kind == "garbage":
            return web.Response(text="<html>hello</html>\n")
        if kind == "404":
            return web.Response(status=404, text="no")
        if kind == "huge":
            resp = web.StreamResponse()
            await resp.prepare(request)
            for _ in range(40):  # 40 x 128 KiB, streamed without a Content-Length
                await resp.write(b"# " + b"x" * (128 * 1024 - 3) + b"\n")
            return resp
        await release.wait()  # "hang"
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"127.0.0.1:{port}", mode
    release.set()
    await runner.cleanup()


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("garbage", "no vllm:num_requests_running"),
        ("404", "HTTP 404"),
        ("huge", "exceeds 1048576 bytes"),
        ("hang", "no answer within 0.2s"),
    ],
)
async def test_misbehaving_endpoints_are_errors_not_crashes(
    bad_server: tuple[str, dict[str, Any]], kind: str, reason: str
) -> None:
    address, mode = bad_server
    mode["kind"] = kind
    store = CatalogStore()
    publish(store, address)
    scraper = EngineScraper(store, interval=INTERVAL, timeout=0.2, max_response_bytes=1024 * 1024)
    scraper.start()
    try:
        found = await until(scraper, address, lambda e: e.error is not None)
        assert found.stale and found.signals is None and found.usable is None
        assert found.error is not None and reason in found.error
        rounds = scraper.rounds
        await eventually(lambda: scraper.rounds > rounds)  # the task lives on
    finally:
        await scraper.close()


async def test_borrowed_session_is_not_closed(sim: StartSim) -> None:
    server = await sim()
    store = CatalogStore()
    publish(store, server.address)
    async with aiohttp.ClientSession() as session:
        scraper = EngineScraper(store, interval=INTERVAL, session=session)
        await scraper.scrape_all()  # one round without the task: usable directly
        found = entry(scraper, server.address)
        assert found is not None and found.usable is not None
        await scraper.close()
        assert not session.closed


def test_metrics_urls_use_the_metrics_port_and_bracket_ipv6() -> None:
    """The metrics port when the catalog names one (else the serving port); IPv6 hosts in brackets."""
    key = WorkerSetKey("default/llama")
    endpoints = (
        Endpoint(EndpointAddress("10.0.0.1:8000"), "10.0.0.1", 8000, key, metrics_port=9090),
        Endpoint(EndpointAddress("[fd00::1]:8000"), "fd00::1", 8000, key),
    )
    ws = WorkerSet(key, "demo", 16, (ServedModel(ModelName(MODEL)),), endpoints)
    assert metrics_urls(Catalog(worker_sets={key: ws})) == {
        "10.0.0.1:8000": "http://10.0.0.1:9090/metrics",
        "[fd00::1]:8000": "http://[fd00::1]:8000/metrics",
    }


async def test_stale_is_judged_with_the_injected_clock(sim: StartSim) -> None:
    """Signals older than three intervals are stale (clock in seconds): a real scrape at 99 s is
    fresh at 100 s and stale at 103.5 s."""
    engine = await sim()
    now = [99.0]
    store = CatalogStore()
    publish(store, engine.address)
    scraper = EngineScraper(store, interval=1.0, clock=lambda: now[0])
    scraper.start()
    try:
        await scraper.scrape_all()
    finally:
        await scraper.close()
    now[0] = 100.0
    fresh = scraper.snapshot()[EndpointAddress(engine.address)]
    assert fresh.signals is not None and not fresh.stale
    now[0] = 103.5
    found = scraper.snapshot()[EndpointAddress(engine.address)]
    assert found.stale and found.age == pytest.approx(4.5)


async def test_an_engine_contradicting_its_sets_declared_kind_is_a_problem_of_the_set(
    sim: StartSim, scraper: tuple[CatalogStore, EngineScraper]
) -> None:
    """A set annotated ``sglang`` whose pod serves vLLM's metrics says so; a matching one does not."""
    store, scraper_ = scraper
    vllm, sglang = await sim(), await sim(engine_kind="sglang")
    declared = [
        LocalWorkerSet("wrong", MODEL, [vllm.address], engine="sglang"),
        LocalWorkerSet("right", "other-model", [sglang.address], engine="sglang"),
    ]
    store.publish(catalog_of(declared))
    await until(scraper_, vllm.address, lambda e: e.usable is not None)
    found = await until(scraper_, sglang.address, lambda e: e.usable is not None)
    assert found.signals is not None and found.signals.engine_kind == "sglang"
    assert scraper_.kind_problems() == {
        WorkerSetKey("default/wrong"): [
            f"endpoint {vllm.address} serves vllm metrics but its worker set declares "
            "kinference.buoyant.io/engine: sglang"
        ]
    }
    assert scraper_.debug_state()["endpoints"][vllm.address]["signals"]["engineKind"] == "vllm"
    store.publish(
        catalog_of([LocalWorkerSet("wrong", MODEL, [vllm.address])])
    )  # undeclared: no claim to check
    assert scraper_.kind_problems() == {}


async def test_a_large_catalog_is_followed_in_slices_and_the_latest_one_wins() -> None:
    """18,000 endpoints followed at once held the event loop ~30-65 ms: a catalog larger than a slice
    is followed by a task, and a newer catalog published meanwhile is what the scraper ends with."""
    store = CatalogStore()
    scraper_ = EngineScraper(store, interval=INTERVAL)  # not started: nothing is scraped
    big = [f"127.0.{i // 200}.{i % 200 + 1}:8000" for i in range(3 * FOLLOW_SLICE)]
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count_turns())
    try:
        publish(store, *big)
        await eventually(lambda: set(scraper_.snapshot()) == set(big))
        assert turns >= 3  # the loop ran other tasks while the catalog was followed
        assert entry(scraper_, big[-1]).url == f"http://{big[-1]}/metrics"  # type: ignore[union-attr]
        other = [f"127.1.{i // 200}.{i % 200 + 1}:8000" for i in range(3 * FOLLOW_SLICE)]
        publish(store, *other)
        publish(store, "127.0.0.9:8000")  # while the previous one is still being followed
        await eventually(lambda: set(scraper_.snapshot()) == {"127.0.0.9:8000"})
        await asyncio.sleep(0.05)
        assert set(scraper_.snapshot()) == {"127.0.0.9:8000"}
    finally:
        counter.cancel()
        await scraper_.close()


async def test_a_large_pool_is_scraped_in_full_with_its_answers_spread_out() -> None:
    """Past SPREAD_ABOVE endpoints every endpoint is still scraped each round, but not all at once:
    the engines never see more than a fraction of the pool asking together (a burst would be 64)."""
    page = b'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
    in_flight = peak = 0
    seen: set[str] = set()

    async def metrics(request: web.Request) -> web.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        seen.add(request.host)
        await asyncio.sleep(0.02)  # a slow engine page: concurrent asks pile up here
        in_flight -= 1
        return web.Response(body=page, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    addresses = [f"127.0.1.{i}:{port}" for i in range(1, 121)]
    for address in addresses:
        await web.TCPSite(runner, address.rpartition(":")[0], port).start()
    store = CatalogStore()
    publish(store, *addresses)
    scraper = EngineScraper(store, interval=0.5, timeout=2.0)
    try:
        scraper.start()
        await eventually(lambda: len(seen) == len(addresses), within=10.0, what="every endpoint scraped")
        assert all(entry(scraper, a) is not None for a in addresses)
        # One burst would be MAX_CONCURRENCY (64) at once; spread, a few groups overlap.
        assert peak <= 40, f"{peak} scrapes at once: the round came in a burst"
    finally:
        await scraper.close()
        await runner.cleanup()
