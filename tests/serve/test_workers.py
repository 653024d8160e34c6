"""``serve --workers N``: one port, N processes, each peered with the others; SIGTERM ends them all."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from integration.sim_gateway import LLAMA, engine_settings
from peers.test_sync import request_messages
from ports import free_port
from waiting import until

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.sim.server import SimServer


async def state(port: int) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, OSError):
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/debug/state") as resp,
        ):
            if resp.status == 200:
                found: dict[str, Any] = await resp.json()
                return found
    return None


async def routed(port: int) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        page = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith('extproc_requests_total{outcome="routed"}')
    )


async def route_once(port: int) -> None:
    """One request on a connection of its own (the kernel picks the worker per connection)."""
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % LLAMA.encode()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()  # type: ignore[no-untyped-call]
        for message in request_messages(body):
            await call.write(message)
        answer = await call.read()
        assert answer.WhichOneof("response") == "request_headers", answer
        call.cancel()


async def test_two_workers_share_the_port_and_peer_with_each_other(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimServer(engine_settings())) for _ in range(2)]
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(catalog_yaml([LocalWorkerSet("llama", LLAMA, [e.address for e in engines])]))
        grpc_port, admin = free_port(), free_port()
        while admin + 1 == grpc_port:
            admin = free_port()
        supervisor = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "serve", "--source", f"file:{catalog}",
            "--listen", f"127.0.0.1:{grpc_port}", "--admin-listen", f"127.0.0.1:{admin}",
            "--scrape-interval", "0", "--drain-seconds", "0", "--workers", "2",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:

            async def both_peered() -> list[dict[str, Any]] | None:
                states = [await state(admin), await state(admin + 1)]
                peered = all(s and s["peers"] and s["peers"][0]["connected"] for s in states)
                return [s for s in states if s] if peered else None

            states = await until(both_peered, within=20, what="both workers up and hearing each other")
            owners = {s["peers"][0]["owner"] for s in states if s}
            assert len(owners) == 2, "each worker hears the other, a process of its own"
            for _ in range(24):
                await route_once(grpc_port)
            counts = [await routed(admin), await routed(admin + 1)]
            assert sum(counts) == 24 and min(counts) > 0, f"one port, both workers answer: {counts}"
        finally:
            supervisor.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(supervisor.wait(), 20)
        assert code == 0
        assert await state(admin) is None and await state(admin + 1) is None, "the workers ended with it"
