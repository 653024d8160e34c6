"""Latency-aware routing end to end: real Envoy, the router scraping engines, simulated engines.

One engine is kept busy by traffic that never passes through the router (so only its own
``/metrics`` can tell); with ``--policy predicted-ttft`` the router sends nothing there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from waiting import eventually

from extproc.serve.app import Server
from extproc.sim.server import SimServer

from .sim_gateway import (
    LLAMA,
    delta,
    engine_settings,
    finished,
    router_settings,
    worker_set,
    write_catalog,
)


async def _stream_forever(session: aiohttp.ClientSession, engine: SimServer, i: int) -> None:
    """A long streaming request sent straight to the engine, read until cancelled."""
    body = {"model": LLAMA, "prompt": f"background load {i}", "max_tokens": 3000, "stream": True}
    async with session.post(f"http://{engine.address}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for _ in resp.content:
            pass


async def test_predicted_ttft_avoids_an_engine_busy_with_traffic_it_cannot_see(
    envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path
) -> None:
    """Engine signals reveal a busy pod the router never routed to; requests go to the idle ones."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(SimServer(engine_settings(time_scale=1.0))) for _ in range(3)
        ]
        busy = engines[0]
        catalog = tmp_path / "catalog.yaml"
        write_catalog(catalog, [worker_set(engines)])
        settings = dataclasses.replace(
            router_settings(catalog), policy="predicted-ttft", scrape_interval=0.05, decision_headers=True
        )
        server = Server(settings)
        stack.push_async_callback(server.stop)
        await server.start()
        gateway = await envoy_gateway(
            extproc_address=("127.0.0.1", server.grpc_port), pool=[("127.0.0.1", e.port) for e in engines]
        )
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        )
        load = [asyncio.create_task(_stream_forever(session, busy, i)) for i in range(48)]
        try:

            def busy_seen() -> bool:
                signals = server.scraper.usable(busy.address)  # type: ignore[arg-type]
                return signals is not None and (signals.running or 0) >= 48

            await eventually(busy_seen, within=10, what="the router scraping the busy engine's running batch")
            before = finished(engines)
            for i in range(6):
                body = {
                    "model": "chat",
                    "messages": [{"role": "user", "content": f"hello {i}"}],
                    "max_tokens": 2,
                }
                async with session.post(f"{gateway.url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-extproc-endpoint"] != busy.address
                    assert float(resp.headers["x-extproc-predicted-ttft-ms"]) > 0
            served = delta(before, finished(engines))
            assert served[busy.address] == 0
            assert sum(served.values()) == 6
        finally:
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)


@pytest.mark.parametrize("policy", ["predicted-ttft"], ids=["predicted"])
async def test_unknown_profile_routes_with_the_default_and_is_counted(
    envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path, policy: str
) -> None:
    """A set naming a profile the file lacks still routes (with the default profile); a metric says so."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimServer(engine_settings())) for _ in range(2)]
        catalog = tmp_path / "catalog.yaml"
        write_catalog(catalog, [dataclasses.replace(worker_set(engines), profile="h100-fast")])
        profiles = tmp_path / "profiles.yaml"
        profiles.write_text("profiles:\n  a100:\n    prefill_tokens_per_s: 9000\n")
        settings = dataclasses.replace(router_settings(catalog), policy=policy, profiles=profiles)
        server: Server = Server(settings)
        stack.push_async_callback(server.stop)
        await server.start()
        gateway = await envoy_gateway(
            extproc_address=("127.0.0.1", server.grpc_port), pool=[("127.0.0.1", e.port) for e in engines]
        )
        async with aiohttp.ClientSession() as session:
            body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            async with session.post(f"{gateway.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            async with session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as resp:
                metrics = await resp.text()
        assert (
            'extproc_worker_set_unknown_profile{profile="h100-fast",worker_set="default/llama"} 1.0'
            in metrics
        )
