"""Peer sync, black box: two ``serve`` processes peered over loopback, two simulated engines.

Streams are held open on A the way Envoy holds them between the routing answer and the response
(answered, no response yet), so A's leases are exactly those streams; B must show them as A's,
per endpoint, and drop them when A is killed. Timing bounds here are the contract's (0.5 s, 3 s,
10 s), each an order of magnitude above what the sync needs on an idle machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from integration.sim_gateway import LLAMA, engine_settings
from ports import free_port
from waiting import until

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.pb.envoy.config.core.v3 import base_pb2 as core
from extproc.pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.sim.server import SimServer


class Replica:
    """One ``extproc serve`` subprocess with peer sync."""

    def __init__(self, catalog: Path, peer_port: int, peer_of: int, log: Path, *extra: str) -> None:
        self.catalog, self.peer_port, self.peer_of, self.log = catalog, peer_port, peer_of, log
        self.extra = extra
        self.grpc_port, self.admin_port = free_port(), free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self._log: Any = None

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self) -> None:
        self._log = self.log.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "extproc", "serve", "--source", f"file:{self.catalog}",
            "--listen", f"127.0.0.1:{self.grpc_port}", "--admin-listen", f"127.0.0.1:{self.admin_port}",
            "--peer-listen", f"127.0.0.1:{self.peer_port}", "--peers", f"127.0.0.1:{self.peer_of}",
            "--scrape-interval", "0", "--drain-seconds", "0", *self.extra,
            stdout=asyncio.subprocess.DEVNULL, stderr=self._log,
        )  # fmt: skip
        await until(lambda: self.state(), within=15, what="serve answering /debug/state")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
        if self.proc is not None:
            await self.proc.wait()
        if self._log is not None:
            self._log.close()

    async def state(self) -> dict[str, Any] | None:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with aiohttp.ClientSession() as session, session.get(f"{self.admin}/debug/state") as resp:
                if resp.status == 200:
                    state: dict[str, Any] = await resp.json()
                    return state
        return None


def request_messages(body: bytes) -> list[ep.ProcessingRequest]:
    headers = ep.HttpHeaders(end_of_stream=False)
    for key, value in (
        (":path", "/v1/completions"),
        (":method", "POST"),
        ("content-type", "application/json"),
    ):
        headers.headers.headers.append(core.HeaderValue(key=key, raw_value=value.encode()))
    first = ep.ProcessingRequest(request_headers=headers)
    first.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    return [
        first,
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=False)),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=b"", end_of_stream=True)),
    ]


@contextlib.asynccontextmanager
async def held_streams(port: int, count: int, prompt: str = "hi") -> AsyncIterator[list[str]]:
    """``count`` streams answered with a destination and then held open (no response yet)."""
    body = b'{"model": "%s", "prompt": "%s", "max_tokens": 4}' % (LLAMA.encode(), prompt.encode())
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        calls, picks = [], []
        for _ in range(count):
            call = stub.Process()
            for message in request_messages(body):
                await call.write(message)
            answer = await call.read()
            assert answer.WhichOneof("response") == "request_headers", answer
            mutation = answer.request_headers.response.header_mutation.set_headers
            picks.append(
                next(
                    o.header.raw_value.decode()
                    for o in mutation
                    if o.header.key == "x-gateway-destination-endpoint"
                )
            )
            calls.append(call)
        try:
            yield picks
        finally:
            for call in calls:
                call.cancel()


def peer_leases(state: dict[str, Any] | None) -> dict[str, int] | None:
    if not state or not state["peers"] or not state["peers"][0]["connected"]:
        return None
    leases: dict[str, int] = state["peers"][0]["leases"]
    return leases


async def test_two_replicas_share_their_leases_and_forget_a_dead_peer(tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimServer(engine_settings())) for _ in range(2)]
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(catalog_yaml([LocalWorkerSet("llama", LLAMA, [e.address for e in engines])]))
        port_a, port_b = free_port(), free_port()
        a = Replica(catalog, port_a, port_b, tmp_path / "a.log")
        b = Replica(catalog, port_b, port_a, tmp_path / "b.log")
        for replica in (a, b):
            stack.push_async_callback(replica.stop)
            await replica.start()

        # Each lists the other as connected, with nothing held.
        for replica in (a, b):
            await until(lambda r=replica: _connected(r), within=10, what="the peer connected")  # type: ignore[misc]

        async with held_streams(a.grpc_port, 6) as picks:
            expected = {e: picks.count(e) for e in set(picks)}
            own = (await a.state() or {})["inflight"]
            assert own == expected, "A's own in-flight counts are its held streams"
            started = time.monotonic()
            seen = await until(lambda: _leases_are(b, expected), within=0.5 + 0.5, what="A's leases on B")
            assert seen and time.monotonic() - started < 0.5 + 0.2
            assert (await b.state() or {})["inflight"] == {}, "B's own in-flight stays its own"
        await until(lambda: _leases_are(b, {}), within=0.5 + 0.5, what="A's releases on B")

        # Approximate affinity (no KV events here) learned by A's decisions reaches B as well.
        before = (await b.state() or {})["prefix"]["approximateBlocks"]
        async with held_streams(a.grpc_port, 1, prompt="a long shared system prompt " * 40):
            await until(
                lambda: _approximate_blocks_above(b, before), within=1, what="A's affinity learned on B"
            )

        async with held_streams(a.grpc_port, 3):
            await until(lambda: _leases_are(b, None, total=3), within=1, what="three held on A")
            a.kill()
            started = time.monotonic()
            await until(lambda: _peer_dropped(b), within=3, what="B drops the dead A's leases")
        # B keeps routing on its own.
        async with held_streams(b.grpc_port, 20) as picks:
            assert len(picks) == 20 and set(picks) <= {e.address for e in engines}

        # A comes back with no leases, and is heard again.
        a = Replica(catalog, port_a, port_b, tmp_path / "a2.log")
        stack.push_async_callback(a.stop)
        await a.start()
        await until(lambda: _leases_are(b, {}), within=10, what="A rejoins with 0 leases")


async def test_replicas_with_one_peer_key_share_their_leases(tmp_path: Path) -> None:
    """``--peer-key-file`` on both: the sync runs over CURVE and works as without it."""
    from extproc.peers.curve import new_secret

    key = tmp_path / "peer-key"
    key.write_text(new_secret() + "\n")
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(SimServer(engine_settings())) for _ in range(2)]
        catalog = tmp_path / "catalog.yaml"
        catalog.write_text(catalog_yaml([LocalWorkerSet("llama", LLAMA, [e.address for e in engines])]))
        port_a, port_b = free_port(), free_port()
        a = Replica(catalog, port_a, port_b, tmp_path / "a.log", "--peer-key-file", str(key))
        b = Replica(catalog, port_b, port_a, tmp_path / "b.log", "--peer-key-file", str(key))
        for replica in (a, b):
            stack.push_async_callback(replica.stop)
            await replica.start()
        async with held_streams(a.grpc_port, 4) as picks:
            expected = {e: picks.count(e) for e in set(picks)}
            await until(lambda: _leases_are(b, expected), within=10, what="A's leases on B, over CURVE")


async def _connected(replica: Replica) -> bool:
    state = await replica.state()
    return bool(state and state["peers"] and state["peers"][0]["connected"])


async def _leases_are(replica: Replica, expected: dict[str, int] | None, *, total: int | None = None) -> bool:
    leases = peer_leases(await replica.state())
    if leases is None:
        return False
    if total is not None:
        return sum(leases.values()) == total
    return leases == expected


async def _peer_dropped(replica: Replica) -> bool:
    state = await replica.state()
    return bool(state) and not state["peers"][0]["connected"] and state["peers"][0]["leases"] == {}  # type: ignore[index]


async def _approximate_blocks_above(replica: Replica, floor: int) -> bool:
    state = await replica.state()
    return bool(state) and state["prefix"]["approximateBlocks"] > floor  # type: ignore[index]
