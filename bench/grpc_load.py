"""A gRPC load client that plays Envoy's side of FULL_DUPLEX_STREAMED ext_proc streams.

Each stream does what Envoy 1.40 does for a small non-streaming POST: ``request_headers`` (with
``protocol_config.request_body_mode = FULL_DUPLEX_STREAMED``), one ``request_body`` chunk with
``end_of_stream=false``, an empty chunk with ``end_of_stream=true``; it reads the headers answer
and the streamed body answer(s), sends ``response_headers``, reads that answer and half-closes,
then waits for the server to end the stream. One stream = one routing decision.

Importable (:func:`run_load`) and runnable against any ``extproc serve``::

    python bench/grpc_load.py --target 127.0.0.1:9002 --concurrency 16 --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
import timeit
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import orjson
from machine import machine_busy_seconds, proc_cpu_seconds

from extproc.pb.envoy.config.core.v3 import base_pb2 as core
from extproc.pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

#: A hard cap on calls per run, whatever the duration (every load loop is bounded twice).
MAX_CALLS = 2_000_000
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # grpc-stubs lacks it


def chat_body(model: str, prompt_bytes: int = 64) -> bytes:
    """A small OpenAI chat request whose user message is about ``prompt_bytes`` long."""
    words = ("the quick brown fox jumps over the lazy dog " * (prompt_bytes // 44 + 1))[:prompt_bytes]
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 16})


def _headers(pairs: list[tuple[str, str]], *, end_of_stream: bool) -> ep.HttpHeaders:
    headers = ep.HttpHeaders(end_of_stream=end_of_stream)
    for key, value in pairs:
        headers.headers.headers.append(core.HeaderValue(key=key, raw_value=value.encode()))
    return headers


def request_messages(body: bytes, path: str = "/v1/chat/completions") -> list[ep.ProcessingRequest]:
    """The three request-side messages Envoy sends in FULL_DUPLEX_STREAMED for one POST."""
    pairs = [
        (":authority", "127.0.0.1:8080"),
        (":path", path),
        (":method", "POST"),
        (":scheme", "http"),
        ("user-agent", "bench/1.0"),
        ("content-type", "application/json"),
        ("x-forwarded-proto", "http"),
        ("x-request-id", str(uuid.uuid4())),
    ]
    first = ep.ProcessingRequest(request_headers=_headers(pairs, end_of_stream=False))
    first.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    return [
        first,
        ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=False)),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=b"", end_of_stream=True)),
    ]


def response_headers_message() -> ep.ProcessingRequest:
    pairs = [(":status", "200"), ("content-type", "application/json"), ("content-length", "400")]
    return ep.ProcessingRequest(response_headers=_headers(pairs, end_of_stream=False))


class StreamError(Exception):
    """The server answered something Envoy would not have accepted for this exchange."""


class Exchange(NamedTuple):
    """One ext_proc stream as the load client saw it."""

    #: The ``host:port`` the server picked.
    destination: str
    #: Seconds from opening the stream to reading the routing answer (the request-headers answer,
    #: which FULL_DUPLEX_STREAMED gets once the body has ended): what the request waits for its
    #: route, as Envoy times its own ext_proc call (``request_header_latency_us``).
    decided_s: float
    #: Seconds of the whole stream: the above, the body echoed back, the response-headers exchange
    #: (which a real request has after its engine answers) and the close.
    whole_s: float


async def one_stream(stub: ep_grpc.ExternalProcessorStub, messages: list[ep.ProcessingRequest]) -> str:
    """Run one Envoy-like stream; return the destination the server picked."""
    return (await exchange(stub, messages)).destination


async def exchange(stub: ep_grpc.ExternalProcessorStub, messages: list[ep.ProcessingRequest]) -> Exchange:
    """Run one Envoy-like stream, timed: see :class:`Exchange`."""
    started = time.perf_counter()
    call = stub.Process()
    for message in messages:
        await call.write(message)
    destination = ""
    decided = None
    body_done = False
    while not body_done:
        answer = await call.read()
        if answer is _EOF:
            raise StreamError("server ended the stream before answering the body")
        kind = answer.WhichOneof("response")
        if kind == "request_headers":
            decided = time.perf_counter()
            for option in answer.request_headers.response.header_mutation.set_headers:
                if option.header.key == "x-gateway-destination-endpoint":
                    destination = option.header.raw_value.decode()
        elif kind == "request_body":
            body_done = answer.request_body.response.body_mutation.streamed_response.end_of_stream
        else:
            raise StreamError(f"unexpected answer {kind!r}")
    await call.write(response_headers_message())
    answer = await call.read()
    if answer is _EOF or answer.WhichOneof("response") != "response_headers":
        raise StreamError("no response_headers answer")
    # As Envoy does once nothing more is to be sent: close the stream without waiting for its end
    # (serve, done too, waits for that close: see CLOSE_WAIT_S in extproc/protocol/service.py).
    await call.done_writing()
    call.cancel()
    if not destination or decided is None:
        raise StreamError("no destination in the headers answer")
    return Exchange(destination, decided - started, time.perf_counter() - started)


def self_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max in milliseconds (nearest-rank on sorted samples)."""
    if not samples:
        return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "mean_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))] * 1000

    return {
        "p50_ms": rank(0.50),
        "p90_ms": rank(0.90),
        "p99_ms": rank(0.99),
        "mean_ms": statistics.fmean(ordered) * 1000,
        "max_ms": ordered[-1] * 1000,
    }


async def closed_loop(
    call: Callable[[], Awaitable[str]],
    *,
    concurrency: int,
    duration: float,
    warmup: float = 1.0,
    pids: Mapping[str, int] | None = None,
    max_calls: int = MAX_CALLS,
    samples: list[float] | None = None,
) -> dict[str, Any]:
    """``concurrency`` workers each awaiting ``call()`` back to back for ``warmup + duration`` s (and at
    most ``max_calls`` in all); only the last ``duration`` s are measured (their latencies also go to
    ``samples``, when given, to pool measures). ``call`` returns a label
    (e.g. the picked endpoint) that is counted. CPU is CPU-seconds per wall second (1.0 = one core)
    of each process in ``pids``, of this process ("bench") and of the whole machine ("machine": anything
    well above the sum of the others is another workload stealing cores), over the measured window."""
    latencies: list[float] = []
    labels: dict[str, int] = {}
    errors: list[str] = []
    measuring = False
    deadline = time.monotonic() + warmup + duration

    async def worker() -> None:
        for _ in range(max_calls // concurrency):
            if time.monotonic() >= deadline:
                return
            started = time.perf_counter()
            try:
                label = await call()
            except Exception as exc:
                if measuring:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            if measuring:
                latencies.append(time.perf_counter() - started)
                labels[label] = labels.get(label, 0) + 1

    pids = dict(pids or {})
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(warmup)
        measuring = True
        cpu0 = {name: proc_cpu_seconds(pid) for name, pid in pids.items()}
        self0, all0, t0 = self_cpu_seconds(), machine_busy_seconds(), time.monotonic()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        cpu = {name: (proc_cpu_seconds(pid) - cpu0[name]) / elapsed for name, pid in pids.items()}
        cpu["bench"] = (self_cpu_seconds() - self0) / elapsed
        cpu["machine"] = (machine_busy_seconds() - all0) / elapsed
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if samples is not None:
        samples.extend(latencies)
    return {
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "completed": len(latencies),
        "errors": len(errors),
        "per_s": len(latencies) / elapsed,
        "latency": percentiles(latencies),
        "cpu": cpu,
        "labels": labels,
        "first_error": errors[0] if errors else None,
    }


async def run_load(
    target: str,
    *,
    concurrency: int,
    duration: float,
    body: bytes,
    server_pid: int | None = None,
    warmup: float = 1.0,
) -> dict[str, Any]:
    """Decisions/s of the ext_proc server at ``target``: Envoy-like streams on one channel (Envoy uses
    one HTTP/2 connection per worker thread), labelled by the first endpoint picked."""
    options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        messages = request_messages(body)

        async def call() -> str:
            return (await one_stream(stub, messages)).split(",", 1)[0]

        pids = {"serve": server_pid} if server_pid is not None else {}
        return await closed_loop(call, concurrency=concurrency, duration=duration, warmup=warmup, pids=pids)


def stream_logic_us(catalog: Path, body: bytes, repeats: int = 5) -> float | str:
    """Microseconds of the product's own per-stream work with no gRPC at all: a RequestStream handles
    the same messages (headers, body, eos, response headers) and closes, against the same catalog.
    Uses internal constructors, so a changed signature gives a note instead of failing the run."""
    try:
        return _stream_logic_us(catalog, body, repeats)
    except Exception as exc:
        return f"unavailable: {type(exc).__name__}: {exc}"


def _stream_logic_us(catalog: Path, body: bytes, repeats: int) -> float:
    from extproc.protocol.stream import RequestStream
    from extproc.serve.app import Server
    from extproc.settings import ServeSettings, SourceSettings
    from extproc.sources.file import FileSource

    server = Server(ServeSettings(source=SourceSettings.parse(f"file:{catalog}"), seed=1))
    assert isinstance(server.source, FileSource)  # a file: source, so its catalog loads now
    server.store.publish(server.source.load())
    messages = [*request_messages(body), response_headers_message()]

    def one() -> None:
        stream = RequestStream(server.control, server.metrics, server.stream_options)
        for message in messages:
            stream.handle(message)
        stream.close()

    timer = timeit.Timer(one)
    number, _ = timer.autorange()
    return min(timer.repeat(repeats, number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="ext_proc server host:port (loopback)")
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--server-pid", type=int, default=None, help="to report the server's CPU use")
    args = parser.parse_args()
    result = asyncio.run(
        run_load(
            args.target,
            concurrency=args.concurrency,
            duration=min(args.duration, 600.0),
            body=chat_body(args.model),
            server_pid=args.server_pid,
        )
    )
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
