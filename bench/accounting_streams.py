"""Native memory a gRPC server keeps per accounting stream: real Envoy, observability mode.

Issue 14's soak grew 122 MB/h with Envoy's accounting filter and 42 MB/h without it. This isolates
that filter's streams. Real Envoy runs the shipped ``gateway.yaml`` without its routing filter, so
only the observability-mode ext_proc filter talks to the servicer, in front of a static backend.
The servicer is *bare*: a child process that reads every message and answers nothing (as
``serve``'s accounting streams do), on grpcio's asyncio server (returning at the half-close, or
waiting for Envoy's reset as ``serve`` now does) or on its thread-pool server. The
child reports glibc ``mallinfo2`` bytes in use (objects collected first) before and after the
measured requests; the difference per request is what the server keeps per stream.

    python bench/accounting_streams.py [--requests 20000]   # -> results/accounting_streams.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from machine import (
    answer_malloc_readings,
    answer_malloc_readings_async,
    kept,
    kept_row,
    machine,
    provenance,
    read_malloc,
    record,
)

from extproc.gateway.config import load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess
from extproc.server.service import ACCOUNTING_LINGER_S

HERE = Path(__file__).resolve().parent
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
WARMUP = 1000
CONCURRENCY = 50
SERVICERS = {
    "aio": "grpc.aio, returning at the half-close (serve before)",
    "aio-linger": "grpc.aio, waiting for Envoy's reset (serve now)",
    "sync": "grpc thread-pool server",
}


def _handlers(process: Any) -> grpc.GenericRpcHandler:
    handler = grpc.stream_stream_rpc_method_handler(process)  # bytes in, nothing out
    return grpc.method_handlers_generic_handler(SERVICE, {"Process": handler})


async def serve_aio(linger: float) -> None:
    """The child, grpc.aio: prints its port, then malloc bytes in use for each line on stdin.

    ``linger``: seconds the handler waits after the half-close before returning (serve's
    ``ACCOUNTING_LINGER_S``), so that Envoy's reset finds it still open.
    """

    async def process(requests: Any, _context: Any) -> Any:
        async for _ in requests:
            pass
        if linger:
            await asyncio.sleep(linger)
        return
        yield  # an async generator that yields nothing, like serve's accounting streams

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(process),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await answer_malloc_readings_async()


def serve_sync() -> None:
    """The child, grpc's thread-pool server: the same protocol."""

    def process(requests: Any, _context: Any) -> Any:
        for _ in requests:
            pass
        return iter(())

    server = grpc.server(ThreadPoolExecutor(max_workers=64))
    server.add_generic_rpc_handlers((_handlers(process),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    answer_malloc_readings()


async def measure(server_kind: str, requests: int) -> dict[str, Any]:
    from stack import free_port, is_accounting_filter, keep_http_filters

    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    backend = free_port()
    await web.TCPSite(runner, "127.0.0.1", backend).start()
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", server_kind, stdin=subprocess.PIPE, stdout=subprocess.PIPE
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
            body_mode="FULL_DUPLEX_STREAMED",
        )
        # Only the accounting filter talks to the servicer: the routing one goes.
        keep_http_filters(config, lambda f: "ext_proc" not in json.dumps(f) or is_accounting_filter(f))
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
            before = await read_malloc(child)
            await send(requests)
            await asyncio.sleep(1.5)  # Envoy's deferred closes end the last streams
            after = await read_malloc(child)
    finally:
        child.kill()
        await child.wait()
        await runner.cleanup()
    return {"requests": requests, **kept(before, after, requests)}


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Native memory a gRPC server keeps per accounting stream (real Envoy, observability mode)",
        "",
        f"{provenance(results['machine'])}; grpcio {grpc.__version__}.",
        "",
        "| servicer | requests | malloc in use before -> after | kept per stream |",
        "|---|--:|--:|--:|",
    ]
    for kind, label in SERVICERS.items():
        if kind in results:
            lines.append(kept_row(label, results[kind]["requests"], results[kind]))
    lines += [
        "",
        "The servicer is bare (no serve code): it reads the messages and answers nothing. Envoy ends "
        "an observability-mode stream by half-closing it and resetting it at once. A grpc.aio "
        "handler that returns at the half-close races that reset, and the race leaves memory "
        "behind (earlier runs: the same on grpcio 1.71.0 and 1.78.0 and with uvloop; a grpc "
        "client that half-closes and cancels at once reproduces part of it). A handler that "
        "waits after the half-close takes the reset while nothing is pending and keeps nothing: "
        f"serve's accounting streams now wait up to {ACCOUNTING_LINGER_S} s "
        "(`extproc/server/service.py`, `ACCOUNTING_LINGER_S`); the request's count still ends at "
        "the half-close.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "accounting_streams.json")
    parser.add_argument("--serve", choices=list(SERVICERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve in ("aio", "aio-linger"):
        asyncio.run(serve_aio(ACCOUNTING_LINGER_S if args.serve == "aio-linger" else 0.0))
        return
    if args.serve == "sync":
        serve_sync()
        return
    results: dict[str, Any] = {"machine": machine()}
    for kind in SERVICERS:
        results[kind] = asyncio.run(measure(kind, args.requests))
    record(args.out, results, report)


if __name__ == "__main__":
    main()
