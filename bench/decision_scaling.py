"""What one routing decision costs serve's event loop as the pool grows: 8 to 1,000 endpoints.

In this process, no gRPC and no sockets: a ``RequestStream`` handles the messages Envoy sends for
one request (headers, body, end of body, response headers) and closes, as in
``grpc_load.stream_logic_us``, against a catalog of one worker set of N endpoints. Three arms:

- ``precise``: the model has the real Llama 3 tokenizer and the set declares KV events (the index
  is empty: no engine runs, so every endpoint is cold);
- ``approximate``: no tokenizer and no KV events (prompt chunks matched against earlier decisions);
- ``approximate, all scored``: the same with ``--score-all-endpoints``, as before pools were cut
  to a bounded candidate set (``extproc.scheduling.candidates``).

The body is a 64-byte chat. Best of 5 repeats (this VM's speed drifts); µs per request, and per
endpoint beyond the smallest pool. Writes ``bench/results/decision_scaling.{json,md}``.

    python bench/decision_scaling.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from grpc_load import chat_body, request_messages, response_headers_message
from machine import machine, provenance, record

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.protocol.stream import Pending, RequestStream
from extproc.serve.app import Server
from extproc.settings import CandidateSettings, PrefixSettings, ServeSettings, SourceSettings, TokenizerSpec
from extproc.sources.file import FileSource

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))
from fetch_tokenizers import ensure  # noqa: E402

MODEL = "bench-model"
SIZES = (8, 64, 256, 1000)
MODES = ("precise", "approximate", "approximate, all scored")
REPEATS = 5
REQUESTS = 2000


def catalog(tmp: Path, endpoints: int, precise: bool) -> Path:
    addresses = [f"127.0.{i // 250}.{i % 250 + 1}:8000" for i in range(endpoints)]
    # Never connected to: the server is built, not started.
    kv_ports = {a: (9000 + i, None) for i, a in enumerate(addresses)} if precise else {}
    path = tmp / f"catalog-{endpoints}-{int(precise)}.yaml"
    path.write_text(catalog_yaml([LocalWorkerSet("bench", MODEL, addresses, kv_ports=kv_ports)]))
    return path


async def handle_stream(server: Server, messages: list[ep.ProcessingRequest]) -> None:
    """One request's ext_proc messages handled as serve's gRPC service does, without gRPC."""
    stream = RequestStream(server.control, server.metrics, server.stream_options)
    for message in messages:
        answer = stream.handle(message)
        if isinstance(answer, Pending):
            await answer.wait()
    stream.close()


async def per_request_us(path: Path, precise: bool, score_all: bool) -> float:
    prefix = PrefixSettings(tokenizers=(TokenizerSpec(MODEL, str(ensure("llama3"))),) if precise else ())
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{path}"),
        seed=1,
        prefix=prefix,
        candidates=CandidateSettings(score_all=score_all),
    )
    server = Server(settings)
    assert isinstance(server.source, FileSource)
    server.store.publish(server.source.load())
    messages = [*request_messages(chat_body(MODEL)), response_headers_message()]
    for _ in range(REQUESTS // 4):
        await handle_stream(server, messages)
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(REQUESTS):
            await handle_stream(server, messages)
        best = min(best, (time.perf_counter() - started) / REQUESTS * 1e6)
    return best


async def run() -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "us": {mode: {} for mode in MODES}}
    with tempfile.TemporaryDirectory(prefix="extproc-scaling-") as tmp:
        for mode in MODES:
            for size in SIZES:
                path = catalog(Path(tmp), size, mode == "precise")
                results["us"][mode][str(size)] = await per_request_us(
                    path, mode == "precise", mode.endswith("all scored")
                )
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        "# One routing decision's cost on the event loop, by pool size",
        "",
        f"{provenance(results['machine'])}. In-process `RequestStream` logic for a 64-byte chat (no gRPC); "
        f"best of {REPEATS} runs of {REQUESTS} requests; µs per request.",
        "",
        "| mode | " + " | ".join(f"{n} endpoints" for n in SIZES) + " | µs per endpoint |",
        "|---|" + "--:|" * (len(SIZES) + 1),
    ]
    for mode in MODES:
        us = results["us"][mode]
        slope = (us[str(SIZES[-1])] - us[str(SIZES[0])]) / (SIZES[-1] - SIZES[0])
        lines.append(f"| {mode} | " + " | ".join(f"{us[str(n)]:.0f}" for n in SIZES) + f" | {slope:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "decision_scaling.json")
    args = parser.parse_args()
    record(args.out, asyncio.run(run()), report)


if __name__ == "__main__":
    main()
