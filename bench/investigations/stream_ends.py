"""Native memory a gRPC server keeps per ext_proc stream, by how its handler meets Envoy's close.

Envoy ends an ext_proc stream by half-closing it and resetting it at once. Issue 14's soak grew 122
MB/h with Envoy's accounting filter and 42 MB/h without it; this isolates the two filters' streams.
Real Envoy runs the shipped ``gateway.yaml`` with one of its two ext_proc filters, in front of a
static backend, and talks to a *bare* servicer: a child process with no serve code, on grpcio's
asyncio server (or its thread-pool server), whose handler ends the stream one way or another:

- **accounting** (observability mode; the servicer reads and answers nothing): returning at the
  half-close, or waiting ``CLOSE_WAIT_S`` after it as ``serve`` now does;
- **routing** (BUFFERED; answers each message as serve does, the destination on the body):
  reading until Envoy ends the stream, or, once the response headers are answered, reading nothing
  more and waiting as ``serve`` now does, or returning at once (``routing-return``: Envoy leaves a
  BUFFERED stream open after them; ``--response-ms`` makes the answer long, as a model's).

The child reports glibc ``mallinfo2`` bytes in use (objects collected first) after a warm-up and
after each round of requests; the growth per request in the later rounds is what the server keeps
for good per stream (the first round still fills caches).

    python bench/investigations/stream_ends.py [--requests 10000] [--rounds 3] [--response-ms 0]
    # -> bench/results/stream_ends.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from machine import (
    answer_malloc_readings,
    answer_malloc_readings_async,
    machine,
    provenance,
    read_malloc,
    record,
)

from extproc.gateway.config import load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.protocol import messages
from extproc.protocol.service import CLOSE_WAIT_S

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
WARMUP = 1000
CONCURRENCY = 50
#: arm -> (filter, servicer, label)
ARMS = {
    "accounting-return": (
        "accounting",
        "aio",
        "accounting, grpc.aio returning at the half-close (serve before)",
    ),
    "accounting-wait": ("accounting", "aio", "accounting, grpc.aio waiting for Envoy's reset (serve now)"),
    "accounting-threads": (
        "accounting",
        "sync",
        "accounting, grpc thread-pool server returning at the half-close",
    ),
    "routing-read": ("routing", "aio", "routing, grpc.aio reading until Envoy ends it (serve before)"),
    "routing-wait": (
        "routing",
        "aio",
        "routing, grpc.aio done reading after the response headers (serve now)",
    ),
    "routing-return": (
        "routing",
        "aio",
        "routing, grpc.aio returning at once after the response headers",
    ),
}


def _handlers(process: Any) -> grpc.GenericRpcHandler[Any, Any]:
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=ep.ProcessingRequest.FromString, response_serializer=_serialize
    )
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": handler})


def _serialize(response: ep.ProcessingResponse) -> bytes:
    return response.SerializeToString()


def _answers(request: ep.ProcessingRequest, backend: str) -> list[ep.ProcessingResponse]:
    """serve's answers, bare: observability mode gets none, the body gets the destination."""
    kind = request.WhichOneof("request")
    if request.observability_mode or kind is None:
        return []
    if kind == "request_body":
        return [messages.routed_body_response(backend, body=None, extra={})]
    return [messages.acknowledge(kind)]


async def serve_aio(arm: str, backend: str) -> None:
    """The child, grpc.aio: prints its port, then malloc bytes in use for each line on stdin."""
    wait = arm.endswith("-wait")
    done_at_headers = wait or arm == "routing-return"

    async def process(requests: AsyncIterator[ep.ProcessingRequest], _context: Any) -> Any:
        async for request in requests:
            for answer in _answers(request, backend):
                yield answer
            if done_at_headers and request.WhichOneof("request") == "response_headers":
                if wait:
                    await asyncio.sleep(CLOSE_WAIT_S)  # nothing more comes: read nothing, wait
                return
        if wait:
            await asyncio.sleep(CLOSE_WAIT_S)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(process),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await answer_malloc_readings_async()


def serve_sync(backend: str) -> None:
    """The child, grpc's thread-pool server: the same protocol, returning at the half-close."""

    def process(requests: Any, _context: Any) -> Any:
        for request in requests:
            yield from _answers(request, backend)

    server = grpc.server(ThreadPoolExecutor(max_workers=64))
    server.add_generic_rpc_handlers((_handlers(process),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    answer_malloc_readings()


async def measure(arm: str, requests: int, rounds: int, response_ms: float) -> dict[str, Any]:
    from ports import free_port
    from stack import is_accounting_filter, keep_http_filters

    filter_kind, servicer, _ = ARMS[arm]
    app = web.Application()

    async def ok(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not response_ms:
            return web.json_response({"ok": True})
        # A long answer, as a model's: the headers at once, the body response_ms later.
        response = web.StreamResponse(headers={"content-type": "application/json"})
        await response.prepare(request)
        await asyncio.sleep(response_ms / 1000)
        await response.write(b'{"ok": true}')
        await response.write_eof()
        return response

    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    backend = free_port()
    await web.TCPSite(runner, "127.0.0.1", backend).start()
    child = await asyncio.create_subprocess_exec(
        *(sys.executable, __file__, "--serve", arm, "--backend", f"127.0.0.1:{backend}"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert child.stdout is not None
    try:
        port = int(await child.stdout.readline())
        listen = free_port()
        config = render_config(
            load_config(shipped_config("gateway.yaml")),
            listen_port=listen,
            admin_port=free_port(),
            extproc_address=("127.0.0.1", port),
            pool_endpoints=[("127.0.0.1", backend)],
            body_mode="BUFFERED",
        )
        # One ext_proc filter talks to the servicer: the other goes.
        keep_http_filters(
            config,
            lambda f: (
                "ext_proc" not in json.dumps(f) or is_accounting_filter(f) == (filter_kind == "accounting")
            ),
        )
        async with EnvoyProcess(config) as _, aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{listen}/v1/chat/completions"
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

            async def one() -> None:
                async with http.post(url, json=body) as resp:
                    assert resp.status == 200, (resp.status, await resp.text())
                    await resp.read()

            async def send(count: int) -> None:
                for _ in range(count // CONCURRENCY):
                    await asyncio.gather(*(one() for _ in range(CONCURRENCY)))

            await send(WARMUP)
            await asyncio.sleep(1.0)
            readings = [await read_malloc(child)]
            for _ in range(rounds):
                await send(requests)
                await asyncio.sleep(1.5)  # Envoy's deferred closes end the last streams
                readings.append(await read_malloc(child))
    finally:
        child.kill()
        await child.wait()
        await runner.cleanup()
    per_round = [round((b - a) / requests, 1) for a, b in itertools.pairwise(readings)]
    return {
        "filter": filter_kind,
        "servicer": servicer,
        "requests_per_round": requests,
        "in_use_mb": [round(r / 2**20, 2) for r in readings],
        "bytes_per_stream_by_round": per_round,
        "bytes_per_stream": round(statistics.mean(per_round[1:] or per_round), 1),
    }


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Native memory a gRPC server keeps per ext_proc stream, by how it meets Envoy's close",
        "",
        f"{provenance(results['machine'])}; grpcio {grpc.__version__}; waits of {CLOSE_WAIT_S} s.",
        "",
        "| stream, handler | malloc in use after warm-up -> end | per stream, each round "
        "| kept per stream (rounds 2+) |",
        "|---|--:|--:|--:|",
    ]
    for arm, (_, _, label) in ARMS.items():
        r = results["arms"].get(arm)
        if r is None:
            continue
        rounds = ", ".join(f"{b:.0f}" for b in r["bytes_per_stream_by_round"])
        lines.append(
            f"| {label} | {r['in_use_mb'][0]} -> {r['in_use_mb'][-1]} MB | {rounds} B "
            f"| **{r['bytes_per_stream']:.0f} B** |"
        )
    lines += [
        "",
        f"Each round is {results['requests_per_round']:,} requests through real Envoy (BUFFERED, "
        f"{CONCURRENCY} at a time; the backend's body comes {results.get('response_ms', 0):g} ms after "
        "its headers). The servicers are bare: no serve code, serve's answers. Envoy "
        "half-closes a finished ext_proc stream and resets it at once. A handler that has returned "
        "by then races the reset; one still reading when the reset lands leaves its pending "
        "receive behind (grpc/grpc#43360); both keep memory for good. A handler that has stopped "
        "reading and not yet returned takes the reset cleanly, which is what serve now does "
        "(`extproc/protocol/service.py`, `CLOSE_WAIT_S`). Earlier runs of the accounting arms gave "
        "the same on grpcio 1.71.0 and 1.78.0 and with uvloop.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument(
        "--response-ms",
        type=float,
        default=0.0,
        help="the backend sends its body this long after its headers (a long answer, as a model's)",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "stream_ends.json")
    parser.add_argument("--serve", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        if ARMS[args.serve][1] == "sync":
            serve_sync(args.backend)
        else:
            asyncio.run(serve_aio(args.serve, args.backend))
        return
    results: dict[str, Any] = {
        "machine": machine(),
        "requests_per_round": args.requests,
        "response_ms": args.response_ms,
        "arms": {},
    }
    for arm in args.arms:
        results["arms"][arm] = asyncio.run(measure(arm, args.requests, args.rounds, args.response_ms))
        print(arm, results["arms"][arm]["bytes_per_stream_by_round"], flush=True)
    record(args.out, results, report)


if __name__ == "__main__":
    main()
