"""``serve --workers N`` against one process: decisions/s and CPU per decision, side by side.

One ``serve`` (file catalog, 8 endpoints, no scraping, approximate routing) with 1 and then 2
workers, loaded by the gRPC load client over 4 connections (Envoy keeps one per worker thread; the
kernel gives each connection to one worker), 32 streams in all, 8 s after 2 s of warm-up, twice
each, alternated. CPU is every serve process's (the supervisor and its workers), from /proc. This
machine has 2 cores and the load client runs on them too: the run says how busy the machine was,
and a run whose client could not keep up is not a measure of serve.

    python bench/workers.py [--out bench/results/workers.json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from grpc_load import chat_body, closed_loop, one_stream, request_messages
from machine import machine, machine_busy_seconds, provenance, record, tree_cpu_seconds
from ports import free_port
from stack import wait_http

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

MODEL = "llama-3-8b"
CONNECTIONS, STREAMS, SECONDS = 4, 32, 8.0


async def load(port: int, pid: int) -> dict[str, Any]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(CONNECTIONS)]
    stubs = [ep_grpc.ExternalProcessorStub(c) for c in channels]  # type: ignore[no-untyped-call]
    messages = request_messages(chat_body(MODEL))
    turn = iter(range(10**9))

    async def call() -> str:
        return (await one_stream(stubs[next(turn) % CONNECTIONS], messages)).split(",", 1)[0]

    try:
        await asyncio.gather(*(one_stream(s, messages) for s in stubs))  # every connection up
        cpu0, busy0, t0 = tree_cpu_seconds(pid), machine_busy_seconds(), time.monotonic()
        result = await closed_loop(call, concurrency=STREAMS, duration=SECONDS, warmup=2.0)
        elapsed = time.monotonic() - t0
        serve_cpu = tree_cpu_seconds(pid) - cpu0
        busy = (machine_busy_seconds() - busy0) / elapsed
    finally:
        for channel in channels:
            await channel.close(None)
    decided = result["completed"] * elapsed / result["seconds"]  # the warm-up's calls too, for CPU
    return {
        "decisions_per_s": round(result["per_s"], 1),
        "p50_ms": round(result["latency"]["p50_ms"], 2),
        "p99_ms": round(result["latency"]["p99_ms"], 2),
        "serve_cpu_cores": round(serve_cpu / elapsed, 2),
        "serve_cpu_us_per_decision": round(serve_cpu / decided * 1e6, 1),
        "machine_busy_cores": round(busy, 2),
        "errors": result["errors"],
    }


async def one_arm(workers: int, catalog: Path) -> dict[str, Any]:
    port, admin = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc", "--log-level", "warning", "serve", "--source", f"file:{catalog}",
        "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin}", "--scrape-interval", "0",
        "--workers", str(workers), "--drain-seconds", "0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for i in range(workers):
            await wait_http(f"http://127.0.0.1:{admin + i}/readyz")
        await asyncio.sleep(1.0)  # the workers' peer sync connected
        return {"workers": workers, **await load(port, proc.pid)}
    finally:
        proc.terminate()
        await proc.wait()


async def main_async(catalog: Path) -> dict[str, Any]:
    runs = []
    for _ in range(2):
        for workers in (1, 2):
            print(f"workers {workers} ...", flush=True)
            runs.append(await one_arm(workers, catalog))
    return {"machine": machine(), "runs": runs}


def report(r: dict[str, Any]) -> str:
    lines = [
        "# `serve --workers N`: one port, N processes",
        "",
        provenance(r["machine"]),
        "",
        f"`bench/workers.py`: the gRPC load client over {CONNECTIONS} connections, {STREAMS} streams, "
        f"{SECONDS:g} s, small chats, 8 endpoints, no scraping. This machine has 2 cores and the client "
        "runs on them: with 2 workers, serve and the client compete for the same two cores, so this "
        "measures CPU per decision; decisions/s with a core to spare for the client is not measured here.",
        "",
        "| workers | decisions/s | p50 | p99 | serve CPU (cores) | serve CPU per decision | machine busy "
        "| errors |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for run in r["runs"]:
        lines.append(
            f"| {run['workers']} | {run['decisions_per_s']:.0f} | {run['p50_ms']} ms | {run['p99_ms']} ms | "
            f"{run['serve_cpu_cores']} | {run['serve_cpu_us_per_decision']} µs | "
            f"{run['machine_busy_cores']} of 2 | {run['errors']} |"
        )
    for workers in (1, 2):
        rows = [x for x in r["runs"] if x["workers"] == workers]
        mean = statistics.fmean(x["serve_cpu_us_per_decision"] for x in rows)
        rate = statistics.fmean(x["decisions_per_s"] for x in rows)
        lines.append("")
        lines.append(
            f"- {workers} worker(s): {rate:.0f} decisions/s, {mean:.0f} µs of serve CPU per decision (mean)."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "workers.json")
    args = parser.parse_args()
    catalog = Path("/tmp/workers-bench-catalog.yaml")
    endpoints = [f"127.0.0.{i + 2}:8000" for i in range(8)]
    catalog.write_text(catalog_yaml([LocalWorkerSet("llama", MODEL, endpoints)]))
    record(args.out, asyncio.run(main_async(catalog)), report)


if __name__ == "__main__":
    main()
