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
from peers.test_sync import held_streams, request_messages
from ports import free_port, free_port_range
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


async def test_workers_of_two_pods_peer_with_every_worker_of_both(tmp_path: Path) -> None:
    """Two replicas (pods) of 2 workers each, peered by ``--peers``: every worker follows the other
    three (its sibling and both workers of the other pod), and streams held on one pod show on every
    worker of the other as that pod's leases."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimServer(engine_settings())) for _ in range(2)]
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(catalog_yaml([LocalWorkerSet("llama", LLAMA, [e.address for e in engines])]))
        peer_ports = [free_port_range(2), free_port_range(2)]
        grpc_ports = [free_port(), free_port()]
        admins = [free_port_range(2), free_port_range(2)]
        pods = []
        for pod, other in ((0, 1), (1, 0)):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "extproc", "serve", "--source", f"file:{catalog}",
                "--listen", f"127.0.0.1:{grpc_ports[pod]}", "--admin-listen", f"127.0.0.1:{admins[pod]}",
                "--peer-listen", f"127.0.0.1:{peer_ports[pod]}", "--peers", f"127.0.0.1:{peer_ports[other]}",
                "--scrape-interval", "0", "--drain-seconds", "0", "--workers", "2",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            pods.append(process)
        workers = [admin + i for admin in admins for i in range(2)]
        try:

            async def all_peered() -> list[dict[str, Any]] | None:
                states = [await state(port) for port in workers]
                heard = [s and [p["connected"] for p in s["peers"]] == [True] * 3 for s in states]
                return [s for s in states if s] if all(heard) else None

            states = await until(all_peered, within=20, what="4 workers up, each hearing the other 3")
            for s, port in zip(states, workers, strict=True):
                followed = {p["address"] for p in s["peers"]}
                pod = 0 if port in (admins[0], admins[0] + 1) else 1
                own = f"127.0.0.1:{peer_ports[pod] + port - admins[pod]}"
                every = {f"127.0.0.1:{base + i}" for base in peer_ports for i in range(2)}
                assert followed == every - {own}, f"worker on admin {port} follows {followed}"

            async with held_streams(grpc_ports[0], 4) as picks:
                held = {address: picks.count(address) for address in set(picks)}

                async def seen_on_pod_b() -> bool:
                    for port in workers[2:]:
                        found = await state(port)
                        if found is None:
                            return False
                        totals: dict[str, int] = {}
                        for peer in found["peers"]:
                            if peer["address"].endswith(tuple(f":{peer_ports[0] + i}" for i in range(2))):
                                for endpoint, count in peer["leases"].items():
                                    totals[endpoint] = totals.get(endpoint, 0) + count
                        if totals != held:
                            return False
                    return True

                await until(seen_on_pod_b, within=5, what=f"A's held streams {held} on both of B's workers")
        finally:
            for pod in pods:
                pod.send_signal(signal.SIGTERM)
            codes = [await asyncio.wait_for(pod.wait(), 20) for pod in pods]
        assert codes == [0, 0]
