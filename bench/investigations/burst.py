"""Bursts of new ext_proc streams: does `serve` take every one, however many arrive at once?

Envoy opens one gRPC stream per HTTP request, so a traffic spike is a burst of new streams on a
few HTTP/2 connections. This starts `serve` (a subprocess, a small catalog, no engines needed: the
destination is all a stream waits for) and opens N streams at once over one channel, unpaced,
each playing Envoy's FULL_DUPLEX_STREAMED exchange (``grpc_load.one_stream``). Recorded per
burst: streams answered, streams that failed and with what gRPC status, and how long the burst
took. With ``--before PATH`` the same bursts also run against the `serve` of another checkout
(e.g. a git worktree of an older commit), side by side in one run.

Writes ``bench/results/burst.{json,md}`` (``--out`` to write elsewhere).

    python bench/investigations/burst.py [--before ../worktree-of-old-commit]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from grpc_load import chat_body, one_stream, request_messages
from machine import machine, provenance, record

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))
from ports import free_port  # noqa: E402

MODEL = "bench-model"
BURSTS = (1000, 2000, 3000, 10000)


@contextlib.asynccontextmanager
async def serve(repo: Path, catalog: Path) -> AsyncIterator[int]:
    """`python -m extproc serve` from ``repo``'s source; yields its gRPC port once it listens."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc", "--log-level", "warning", "serve",
        "--source", f"file:{catalog}", "--listen", f"127.0.0.1:{port}",
        "--admin-listen", "127.0.0.1:0", "--scrape-interval", "0",
        env=env, cwd=str(repo),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"serve from {repo} did not listen within 20 s") from None
                await asyncio.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def burst(port: int, streams: int) -> dict[str, Any]:
    body = chat_body(MODEL)
    outcomes: collections.Counter[str] = collections.Counter()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        await one_stream(stub, request_messages(body))  # connected and warm

        async def one() -> None:
            try:
                await one_stream(stub, request_messages(body))
                outcomes["ok"] += 1
            except grpc.aio.AioRpcError as exc:
                outcomes[f"{exc.code().name}: {exc.details()}"] += 1

        started = time.monotonic()
        await asyncio.gather(*(one() for _ in range(streams)))
        seconds = time.monotonic() - started
    return {
        "streams": streams,
        "ok": outcomes.pop("ok", 0),
        "failed": dict(outcomes),
        "seconds": round(seconds, 2),
    }


async def measure(before: Path | None) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="extproc-burst-") as tmp:
        catalog = Path(tmp) / "catalog.yaml"
        endpoints = [f"127.0.0.{i}:8000" for i in range(1, 5)]
        catalog.write_text(catalog_yaml([LocalWorkerSet("bench", MODEL, endpoints)]))
        checkouts = [("before", before)] if before is not None else []
        checkouts.append(("this checkout", REPO))
        for label, repo in checkouts:
            for streams in BURSTS:
                async with serve(repo, catalog) as port:  # a fresh server per burst
                    row = {"serve": label, **await burst(port, streams)}
                print(json.dumps(row), file=sys.stderr)
                results["runs"].append(row)
    return results


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# Bursts of new ext_proc streams",
        "",
        f"{provenance(m)}. One gRPC channel (one HTTP/2 "
        "connection, as from one Envoy worker) opens every stream of a burst at once; `serve` and "
        "the client share the cores.",
        "",
        "| serve | streams | answered | failed | seconds |",
        "|---|--:|--:|---|--:|",
    ]
    for r in results["runs"]:
        failed = "; ".join(f"{n} {what}" for what, n in r["failed"].items()) or "0"
        lines.append(f"| {r['serve']} | {r['streams']:,} | {r['ok']:,} | {failed} | {r['seconds']} |")
    lines += [
        "",
        "Where the failures came from: gRPC core holds new calls until the application asks for "
        "them, and cancels them once more than `grpc.server.max_pending_requests` wait (default "
        "1,000; all of them past `..._hard_limit`, 3,000), resetting the HTTP/2 stream (the client "
        "sees `INTERNAL`). `serve`'s loop takes calls one at a time, so a burst outruns it. `serve` "
        "now allows 10,000 waiting calls, as many as one connection may open streams.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    p.add_argument("--out", type=Path, default=HERE / "results" / "burst.json")
    args = p.parse_args()
    results = asyncio.run(measure(args.before))
    record(args.out, results, report)


if __name__ == "__main__":
    main()
