"""The gRPC floor under a routing decision: serve against an ext_proc servicer that does nothing.

The *floor* is a grpc.aio ``ExternalProcessor`` servicer, in a process of its own, that answers like
serve (the headers answer with a fixed destination once the body has ended, the body echoed
back, the response headers acknowledged) and decides nothing: no parse, no tokenizer, no
scheduler. Against it, serve as ``long_prompts.py`` runs it (threads, the real Llama 3 tokenizer,
8 endpoints that declare KV events). Both are sent a 64-byte chat, one request at a time, in
alternating blocks (this VM's speed drifts within seconds), and timed two ways:

- **load client**: the Python gRPC load client (``grpc_load.exchange``, the client of
  ``long_prompts.py``'s next-turn target), p50 to the routing answer (its target's measure) and of
  the whole ext_proc stream;
- **Envoy**: over HTTP through the shipped gateway to fake engines, Envoy's own latency for its
  ext_proc call on the request headers, p50 (``envoy_timing.py``).

What serve adds to the floor is its decision; the floor itself is grpcio's, and the load client's
Python, which no change to serve's logic can remove. Writes ``bench/results/grpc_floor.{json,md}``.

    python bench/investigations/grpc_floor.py            # ~1 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from envoy_timing import TimedGateway
from grpc_load import chat_body, exchange, one_stream, request_messages
from long_prompts import CHANNEL_OPTIONS, MODEL, start_serve, write_catalog
from machine import machine, provenance, record

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.protocol import messages

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
sys.path.insert(0, str(HERE.parent / "tests"))
from ports import free_port  # noqa: E402

ROUNDS = 4
BLOCK = 100


class FloorServicer(ep_grpc.ExternalProcessorServicer):
    """Answers an ext_proc stream as serve does, routing every request to one endpoint."""

    def __init__(self, destination: str) -> None:
        self.destination = destination

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        body = bytearray()
        async for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind == "request_body":
                body += request.request_body.body
                if request.request_body.end_of_stream:
                    yield messages.routed_headers_response(self.destination, extra={})
                    for answer in messages.streamed_body(bytes(body), end_of_stream=True):
                        yield answer
            elif kind in ("request_trailers", "response_headers"):
                yield messages.acknowledge(kind)
                if kind == "response_headers":
                    return


async def serve_floor(port: int, destination: str) -> None:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    ep_grpc.add_ExternalProcessorServicer_to_server(FloorServicer(destination), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def wait_listening(port: int, within: float = 15.0) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), within)


async def load_client_p50s(targets: dict[str, int]) -> dict[str, dict[str, float]]:
    """p50 ms of a 64-byte chat to its routing answer (``decided``) and of its whole stream
    (``whole``), per target, in alternating blocks."""
    decided: dict[str, list[float]] = {name: [] for name in targets}
    whole: dict[str, list[float]] = {name: [] for name in targets}
    body = chat_body(MODEL)
    async with contextlib.AsyncExitStack() as stack:
        stubs = {}
        for name, port in targets.items():
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
            )
            stubs[name] = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        for stub in stubs.values():  # connected and warm
            for _ in range(50):
                await one_stream(stub, request_messages(body))
        for _ in range(ROUNDS):
            for name, stub in stubs.items():
                for _ in range(BLOCK):
                    timed = await exchange(stub, request_messages(body))
                    decided[name].append(timed.decided_s)
                    whole[name].append(timed.whole_s)
    return {
        kind: {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        for kind, samples in (("decided", decided), ("whole", whole))
    }


async def envoy_p50s(tmp: Path, targets: dict[str, int], endpoints: list[str]) -> dict[str, Any]:
    """p50 ms of Envoy's ext_proc call for a 64-byte chat, per target, in alternating blocks (one
    gateway per target, each in turn)."""
    body = chat_body(MODEL)
    decisions: dict[str, list[float]] = {name: [] for name in targets}
    round_trips: dict[str, list[float]] = {name: [] for name in targets}
    for _ in range(ROUNDS):
        for name, port in targets.items():
            gateway = TimedGateway(tmp, port, endpoints, free_port(), free_port())
            async with gateway:
                for _ in range(20):
                    await gateway.post("warm", body)
                for _ in range(BLOCK):
                    await gateway.post("chat", body)
            decisions[name] += [t.decision_us / 1e3 for t in gateway.timings() if t.kind == "chat"]
            round_trips[name] += gateway.round_trips["chat"]
    return {
        "decision_ms": {name: statistics.median(values) for name, values in decisions.items()},
        "round_trip_ms": {name: statistics.median(values) * 1e3 for name, values in round_trips.items()},
        "logged": {name: len(values) for name, values in decisions.items()},
    }


async def run() -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(grpcio=grpc.__version__)}
    with tempfile.TemporaryDirectory(prefix="extproc-floor-") as tmp:
        endpoints = write_catalog(Path(tmp))
        floor_port = free_port()
        floor = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--servicer", str(floor_port), endpoints[0],
            stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        serve = await start_serve(Path(tmp), "threads")
        try:
            await wait_listening(floor_port)
            targets = {"floor": floor_port, "serve": serve.grpc_port}
            results["load_client_p50_ms"] = await load_client_p50s(targets)
            results["envoy"] = await envoy_p50s(Path(tmp), targets, endpoints)
        finally:
            floor.kill()
            await floor.wait()
            await serve.stop()
    return results


def report(results: dict[str, Any]) -> str:
    client = results["load_client_p50_ms"]
    envoy = results["envoy"]
    rows = [
        ("load client: to the routing answer", client["decided"]),
        ("load client: whole ext_proc stream", client["whole"]),
        ("Envoy: its ext_proc call for the request headers (the decision)", envoy["decision_ms"]),
        ("HTTP round trip through Envoy and a fake engine (client side)", envoy["round_trip_ms"]),
    ]
    lines = [
        "# The gRPC floor under a routing decision",
        "",
        f"{provenance(results['machine'])}; grpcio {results['machine'].get('grpcio')}. A 64-byte chat, "
        f"one at a time, {ROUNDS} alternating blocks of {BLOCK} per target; p50 ms. *floor*: a grpc.aio "
        "servicer that answers like serve and decides nothing; *serve*: threads, real Llama 3 "
        "tokenizer, 8 endpoints with KV events (precise).",
        "",
        "| timed by | floor | serve | serve minus floor |",
        "|---|--:|--:|--:|",
    ]
    for label, p50 in rows:
        lines.append(
            f"| {label} | {p50['floor']:.2f} | {p50['serve']:.2f} | {p50['serve'] - p50['floor']:.2f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "grpc_floor.json")
    parser.add_argument("--servicer", nargs=2, metavar=("PORT", "DESTINATION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.servicer:  # the floor's own process
        uvloop.install()
        asyncio.run(serve_floor(int(args.servicer[0]), args.servicer[1]))
        return
    record(args.out, asyncio.run(run()), report)


if __name__ == "__main__":
    main()
