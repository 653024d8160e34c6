"""The running server's side doors: gRPC health, /metrics, /debug/ routes (real sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from waiting import eventually

from extproc.admin import is_loopback
from extproc.errors import ConfigError
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings

DATA = Path(__file__).resolve().parents[1] / "data" / "catalog.yaml"
Status = health_pb2.HealthCheckResponse


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{DATA}"), listen="127.0.0.1:0", admin_listen="127.0.0.1:0"
    )
    async with Server(settings) as running:
        yield running


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        ("", Status.SERVING),
        ("liveness", Status.SERVING),
        ("readiness", Status.SERVING),
        ("envoy.service.ext_proc.v3.ExternalProcessor", Status.SERVING),
        ("something.Else", Status.SERVICE_UNKNOWN),
    ],
    ids=["overall", "liveness", "readiness", "ext-proc", "unknown"],
)
async def test_grpc_health(server: Server, service: str, expected: int) -> None:
    """Health names answer as the endpoint picker protocol expects; unknown names are not an error."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert answer.status == expected


async def test_not_ready_until_catalog_loaded() -> None:
    """Before the catalog is loaded, readiness says NOT_SERVING while liveness says SERVING."""
    settings = ServeSettings(source=SourceSettings.parse(f"file:{DATA}"), listen="127.0.0.1:0")
    server = Server(settings)
    from extproc.protocol.health import HealthService

    health = HealthService(lambda: server.store.loaded)
    assert health.status("readiness") == Status.NOT_SERVING
    assert health.status("liveness") == Status.SERVING
    server.store.publish(server.source.load())
    assert health.status("readiness") == Status.SERVING


async def test_metrics_and_debug_state(server: Server) -> None:
    """/metrics exposes catalog and request metrics; /debug/state shows routes and in-flight counts."""
    lease = server.control.acquire(server.store.current.routes["chat"].endpoints[0].address)  # type: ignore[index]
    base = f"http://127.0.0.1:{server.admin_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
        async with s.get(base + "/debug/state") as r:
            state = await r.json()
        async with s.post(base + "/debug/state") as r:
            assert r.status == 405, "the admin port is read-only"
    server.control.release(lease)
    assert 'extproc_worker_set_ready_endpoints{worker_set="default/llama-3-8b"} 2.0' in text
    assert 'extproc_inflight_requests{endpoint="127.0.0.1:8000"} 1.0' in text
    assert "extproc_catalog_models 4.0" in text
    assert state["catalog"]["routes"]["chat"]["upstreamModel"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert state["inflight"] == {"127.0.0.1:8000": 1}


@pytest.mark.parametrize("which", ["listen", "admin_listen"], ids=["grpc", "admin"])
async def test_taken_port_is_a_clear_config_error(which: str) -> None:
    """A port already in use (even by another serve) stops start-up with the flag named."""
    holder = ServeSettings(
        source=SourceSettings.parse(f"file:{DATA}"), listen="127.0.0.1:0", admin_listen="127.0.0.1:0"
    )
    async with Server(holder) as first:
        taken = first.grpc_port if which == "listen" else first.admin_port
        ports = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", which: f"127.0.0.1:{taken}"}
        second = Server(ServeSettings(source=SourceSettings.parse(f"file:{DATA}"), **ports))
        flag = "--" + which.replace("_", "-")
        with pytest.raises(ConfigError, match=flag):
            await second.start()


async def test_broken_catalog_edit_is_counted_and_keeps_routes(tmp_path: Path) -> None:
    """A catalog file that stops parsing keeps the last catalog and shows up as a failed reload."""
    path = tmp_path / "catalog.yaml"
    path.write_text(DATA.read_text())
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{path}", poll_interval=0.02),
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
    )
    async with Server(settings) as server, aiohttp.ClientSession() as s:
        path.write_text("kind: [unclosed\n")
        failed = 'extproc_catalog_reloads_total{result="failed"} 1.0'
        for _ in range(250):
            async with s.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r:
                if failed in await r.text():
                    break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the failed reload never showed in /metrics")
        assert server.store.current.resolve("chat") is not None


def _outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), None without one."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("198.51.100.1", 9))  # TEST-NET-2: routed, never reached
            address: str = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


async def test_debug_routes_answer_loopback_clients_only() -> None:
    """Bound to all addresses (as deployed, for Prometheus), /metrics answers anyone but the
    /debug/ routes answer a client from another address with a 403 saying why."""
    address = _outward_address()
    if address is None:
        pytest.skip("no non-loopback address to connect from")
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{DATA}"), listen="127.0.0.1:0", admin_listen="0.0.0.0:0"
    )
    async with Server(settings) as running, aiohttp.ClientSession() as s:
        outside = f"http://{address}:{running.admin_port}"
        async with s.get(outside + "/metrics") as r:
            assert r.status == 200
        for path in ("/debug/state", "/debug/worker-sets"):
            async with s.get(outside + path) as r:
                assert r.status == 403
                assert "loopback clients only" in (await r.json())["error"]
            async with s.get(f"http://127.0.0.1:{running.admin_port}{path}") as r:
                assert r.status == 200


async def test_worker_sets_route_is_the_state_section(server: Server) -> None:
    """/debug/worker-sets (what the reconciler polls) is /debug/state's workerSetStatus, compact."""
    base = f"http://127.0.0.1:{server.admin_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/debug/worker-sets") as r:
            body = await r.read()
        async with s.get(base + "/debug/state") as r:
            state = await r.json()
    assert b"\n" not in body
    assert orjson.loads(body) == state["workerSetStatus"]
    assert "default/llama-3-8b" in state["workerSetStatus"]


@pytest.mark.parametrize(
    ("remote", "allowed"),
    [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("10.0.0.5", False), ("fd00::2", False),
     (None, False), ("junk", False)],
)  # fmt: skip
def test_loopback_check(remote: str | None, allowed: bool) -> None:
    """Only loopback peers pass; an unknown peer does not."""
    assert is_loopback(remote) is allowed


async def test_sigterm_drain_reports_not_serving_but_keeps_answering() -> None:
    """While draining, health says NOT_SERVING (liveness stays SERVING) and new streams are still
    answered; after --drain-seconds the server stops."""
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{DATA}"),
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        drain_seconds=1.0,
        scrape_interval=0,
    )
    stop = asyncio.Event()
    server = Server(settings)
    await server.start()
    drained = asyncio.create_task(_drain_then_stop(server, stop))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stop.set()
            await eventually(lambda: server.draining, what="the drain begun")
            readiness = await health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
            liveness = await health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert (readiness.status, liveness.status) == (Status.NOT_SERVING, Status.SERVING)
            answer = await _models(channel)
            assert answer.immediate_response.status.code == 200  # a new stream, served while draining
        await asyncio.wait_for(drained, 10)
    finally:
        await server.stop()


async def _drain_then_stop(server: Server, stop: asyncio.Event) -> None:
    await stop.wait()
    await server.drain()
    await server.stop()


async def _models(channel: grpc.aio.Channel) -> ep.ProcessingResponse:
    """One bodiless ``GET /v1/models`` ext_proc stream."""
    request = ep.ProcessingRequest()
    for key, value in ((":path", b"/v1/models"), (":method", b"GET")):
        header = request.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value
    request.request_headers.end_of_stream = True
    call = channel.stream_stream(
        "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
        request_serializer=ep.ProcessingRequest.SerializeToString,
        response_deserializer=ep.ProcessingResponse.FromString,
    )()
    await call.write(request)
    await call.done_writing()
    [answer] = [a async for a in call]
    return answer
