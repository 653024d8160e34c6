"""The gRPC service against a real grpc.aio server: what reaches the port that Envoy would never send."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from waiting import eventually

from extproc.pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.protocol import service
from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings
from protocol.test_stream import body, chat, headers, response_headers

DATA = Path(__file__).resolve().parents[1] / "data" / "catalog.yaml"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{DATA}"),
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        scrape_interval=0,
    )
    async with Server(settings) as running:
        yield running


async def _send(channel: grpc.aio.Channel, payload: bytes) -> list[bytes]:
    call = channel.stream_stream(PROCESS, request_serializer=lambda b: b, response_deserializer=lambda b: b)()
    await call.write(payload)
    await call.done_writing()
    return [answer async for answer in call]


async def test_undecodable_messages_get_invalid_argument_without_tracebacks(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that are no ProcessingRequest end that stream with INVALID_ARGUMENT; the log stays quiet
    (at most one warning, no traceback) and the next well-formed stream is served."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        with caplog.at_level(logging.WARNING):
            for _ in range(5):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await _send(channel, b"\xff\xff\xff\xff not protobuf")
                assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "ProcessingRequest" in (failed.value.details() or "")
        assert len([r for r in caplog.records if "not decodable" in r.getMessage()]) <= 1
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        request = ep.ProcessingRequest()
        header = request.request_headers.headers.headers.add()
        header.key, header.raw_value = ":path", b"/v1/models"
        method = request.request_headers.headers.headers.add()
        method.key, method.raw_value = ":method", b"GET"
        request.request_headers.end_of_stream = True
        [answer] = await _send(channel, request.SerializeToString())
    assert ep.ProcessingResponse.FromString(answer).immediate_response.status.code == 200
    assert metric(server, "extproc_requests_total", outcome="malformed_message") == 5


def _models_request() -> bytes:
    request = ep.ProcessingRequest()
    for key, value in ((":path", b"/v1/models"), (":method", b"GET")):
        header = request.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value
    request.request_headers.end_of_stream = True
    return request.SerializeToString()


async def test_a_burst_of_new_streams_is_served_in_full(server: Server) -> None:
    """3,000 streams opened at once on one connection (a traffic spike through one Envoy worker)
    are all answered: none is cancelled while it waits for the server to take it."""
    payload = _models_request()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        answers = await asyncio.gather(
            *(_send(channel, payload) for _ in range(3000)), return_exceptions=True
        )
    failures = [a for a in answers if isinstance(a, BaseException)]
    assert not failures, f"{len(failures)} of 3000 failed, e.g. {failures[0]!r}"
    assert all(ep.ProcessingResponse.FromString(a[0]).immediate_response.status.code == 200 for a in answers)


def _accounting_request(destination: str) -> bytes:
    """The request headers an accounting filter (observability mode) sends for a routed request."""
    request = ep.ProcessingRequest(observability_mode=True)
    for key, value in ((":path", "/v1/chat/completions"), ("x-gateway-destination-endpoint", destination)):
        header = request.request_headers.headers.headers.add()
        header.key, header.raw_value = key, value.encode()
    return request.SerializeToString()


async def test_an_accounting_stream_counts_until_the_half_close_and_takes_envoys_reset_quietly(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request counts in flight until its accounting stream is half-closed (the response ended),
    not until the stream's end; the reset Envoy sends right after (while serve still holds the
    stream open, which spares grpc.aio a per-stream leak) is no cancellation."""
    monkeypatch.setattr(service, "CLOSE_WAIT_S", 30.0)  # as long as this test may take
    endpoint = "127.0.0.1:8000"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.stream_stream(
            PROCESS, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )()
        await call.write(_accounting_request(endpoint))
        await eventually(lambda: in_flight(server).get(endpoint) == 1, what="counted")
        await call.done_writing()
        await eventually(lambda: sum(in_flight(server).values()) == 0, what="released at the half-close")
        assert call.cancel()  # it was still open, waiting for the reset
    await eventually(
        lambda: metric(server, "extproc_streams_ended_total", kind="accounting", how="closed") == 1,
        what="the stream counted as closed",
    )
    assert metric(server, "extproc_streams_ended_total", kind="accounting", how="cancelled") == 0


async def test_a_request_abandoned_before_its_response_releases_its_count_quietly(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A client leaving before the response's headers makes Envoy reset the routing stream while
    serve waits for them: the count goes, the stream counts as cancelled, nothing is logged, and the
    receive that was waiting finishes on its own (none is left pending)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        with caplog.at_level(logging.WARNING):
            calls = []
            for _ in range(20):
                call = channel.stream_stream(PROCESS)()
                for message in (headers(), body(chat("chat"))):
                    await call.write(message.SerializeToString())
                    await call.read()
                calls.append(call)
            assert sum(in_flight(server).values()) == 20
            for call in calls:
                assert call.cancel()
            await eventually(lambda: sum(in_flight(server).values()) == 0, what="released at the reset")
            await eventually(
                lambda: metric(server, "extproc_streams_ended_total", kind="routing", how="cancelled") == 20,
                what="counted as reset",
            )
            await eventually(lambda: not service._READS, what="every receive finished")
    noise = [r for r in caplog.records if r.name.startswith(("extproc.protocol", "asyncio", "grpc"))]
    assert not noise, caplog.text


async def _routing_exchange(call: Any, response_body_mode: int) -> list[ep.ProcessingResponse]:
    """Envoy's messages for one BUFFERED chat up to the response headers, with each answer."""
    first = headers()
    first.protocol_config.response_body_mode = response_body_mode  # type: ignore[assignment]
    answers = []
    for message in (first, body(chat("chat")), response_headers()):
        await call.write(message)
        answers.append(await call.read())
    return answers


async def test_a_routing_stream_ends_itself_once_its_last_message_is_answered(server: Server) -> None:
    """Envoy sends nothing after the response headers when it sends no response body: serve ends
    the stream itself (shortly, if Envoy has not closed it first), and the request's count goes."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        answers = await _routing_exchange(call, pm.ProcessingMode.NONE)
        assert [a.WhichOneof("response") for a in answers] == [
            "request_headers",
            "request_body",
            "response_headers",
        ]
        # No half-close from us: the server ends it.
        assert await asyncio.wait_for(call.code(), timeout=10) == grpc.StatusCode.OK
    await eventually(lambda: sum(in_flight(server).values()) == 0, what="the routing stream's count released")


async def test_a_routing_stream_keeps_reading_when_the_gateway_sends_response_bodies(server: Server) -> None:
    """A gateway configured to send response bodies gets them answered after the response headers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await _routing_exchange(call, pm.ProcessingMode.STREAMED)
        chunk = ep.ProcessingRequest()
        chunk.response_body.body, chunk.response_body.end_of_stream = b"data: {}\n\n", True
        await call.write(chunk)
        answer = await asyncio.wait_for(call.read(), timeout=10)
        assert answer.WhichOneof("response") == "response_body"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


def in_flight(server: Server) -> dict[str, int]:
    """What ``/debug/state`` says is in flight, per endpoint."""
    counts: dict[str, int] = server.debug_state()["inflight"]
    return counts


def metric(server: Server, name: str, **labels: str) -> float:
    """A sample of serve's /metrics, as Prometheus scrapes it (0 when the series is absent)."""
    return server.metrics.registry.get_sample_value(name, labels) or 0.0
