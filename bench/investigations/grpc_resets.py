"""Native memory a grpc.aio server keeps for each stream its client resets, against streams that end
cleanly (issue 14's soak; grpc/grpc#43360): what Envoy's resets of routing streams cost `serve`.

A grpc.aio server (a child process, bidirectional streams that wait for the next message, as an
ext_proc handler does) takes ``--streams`` streams from this process in each of two ways:

- **reset**: the client cancels the stream while the server waits for a message (what Envoy did to
  about half of the routing streams when the HTTP request finished first);
- **shielded**: the same reset, but the handler reads each message in a task of its own that the
  reset does not cancel (`serve`'s :class:`extproc.protocol.service.Receiver`);
- **closed**: the client half-closes and the server's handler returns (what ending each routing
  stream from `serve` at the response headers would give; tried, and undone for now: see README).

The server reports glibc's ``mallinfo2`` bytes in use before and after (Python objects are
collected first, so what remains is native). Writes ``bench/results/grpc_resets.{json,md}``.

    python bench/investigations/grpc_resets.py [--streams 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from machine import answer_malloc_readings_async, kept, kept_row, machine, provenance, read_malloc, record

from extproc.protocol.service import Receiver

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
#: The method each way of ending a stream is measured on.
METHODS = {
    "reset": "/bench.Streams/Echo",
    "shielded": "/bench.Streams/EchoShielded",
    "closed": "/bench.Streams/Echo",
}


async def echo(requests: AsyncIterator[bytes], _context: grpc.aio.ServicerContext[bytes, bytes]) -> Any:
    async for message in requests:
        yield message


async def echo_shielded(requests: AsyncIterator[Any], _context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    receiver = Receiver(requests)
    while (message := await receiver.next()) is not None:
        yield message


async def serve() -> None:
    """The child: prints its port, then its malloc bytes in use for each line read on stdin."""
    server = grpc.aio.server()
    service = grpc.method_handlers_generic_handler(
        "bench.Streams",
        {
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
            "EchoShielded": grpc.stream_stream_rpc_method_handler(echo_shielded),
        },
    )
    server.add_generic_rpc_handlers((service,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await answer_malloc_readings_async()
    await server.stop(None)


async def measure(way: str, streams: int) -> dict[str, Any]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdout is not None
    try:
        port = int(await child.stdout.readline())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            open_stream = channel.stream_stream(METHODS[way], None, None)

            async def one() -> None:
                call = open_stream(None)
                await call.write(b"x")
                await call.read()
                if way != "closed":
                    call.cancel()
                else:
                    await call.done_writing()
                    await call.read()  # the end of the stream

            for _ in range(500):  # warm: pools and caches of both sides filled
                await one()
            await asyncio.sleep(0.5)
            before = await read_malloc(child)
            for _ in range(streams // 100):
                await asyncio.gather(*(one() for _ in range(100)))
            await asyncio.sleep(1.0)
            after = await read_malloc(child)
    finally:
        child.kill()
        await child.wait()
    return {"streams": streams, **kept(before, after, streams)}


def report(results: dict[str, Any]) -> str:
    lines = [
        "# Native memory a grpc.aio server keeps per stream",
        "",
        f"{provenance(results['machine'])}; grpcio {grpc.__version__}.",
        "",
        "| stream ends by | streams | malloc in use before -> after | kept per stream |",
        "|---|--:|--:|--:|",
    ]
    for way, label in (
        ("reset", "client reset (cancel) while the handler reads"),
        ("shielded", "client reset while a shielded task reads (serve now)"),
        ("closed", "half-close, handler returns"),
    ):
        if way in results:
            lines.append(kept_row(label, results[way]["streams"], results[way]))
    lines += [
        "",
        "A reset stream leaves its pending receive's operation array behind (grpc/grpc#43360, open): "
        "grpc.aio cancels the handler, and the receive with it. Behind Envoy, a request its client "
        "abandons mid-answer resets a stream that is waiting for a message (the routing stream, for "
        "the response headers; the accounting one, for the response's end). `serve` therefore reads "
        "those messages in a task the reset does not cancel: the receive then completes on its own "
        "and frees its operations. `extproc_streams_ended_total{kind,how}` counts how streams end.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=20_000)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "grpc_resets.json")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    results: dict[str, Any] = {"machine": machine()}
    for way in METHODS:
        results[way] = asyncio.run(measure(way, args.streams))
    record(args.out, results, report)


if __name__ == "__main__":
    main()
