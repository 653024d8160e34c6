"""Settling rounds of the KV index: the event loop held by rounds inline, against rounds in a thread.

    python bench/settle_rounds.py [--quick] [--blocks N] [--rate R] [--out bench/results/settle_rounds.json]

Each mode runs in a fresh child process: an index over 1,000 sources (a fleet) fed through the
real ingest (:class:`~extproc.kvindex.ingest.IndexIngest`) on a running event loop at a steady
pace (``--rate`` blocks a second), while a probe task sleeps 1 ms at a time and records how late
it wakes (the loop's lag: what a request waiting on the loop would wait). *inline*: every round
runs in ``apply``, as before; *thread*: rounds run in a worker thread (serve's default). The probe's
lag with no ingest at all is measured first in each child: a run whose idle p99 lag passes 5 ms,
or whose ingest fell behind its pace, is marked invalid (the machine could not keep up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from machine import machine, provenance, record

from extproc.kvindex.events import BlockStored, DecodedBatch, Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.types import EndpointAddress

HERE = Path(__file__).resolve().parent
BLOCK = 16
SOURCES = 1000
#: Idle lag p99 above this: the machine is too busy for the numbers to mean anything.
IDLE_P99_LIMIT_MS = 5.0


async def _probe(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        await asyncio.sleep(0.001)
        lags.append(max(0.0, loop.time() - started - 0.001))


def _summary(lags: list[float]) -> dict[str, float]:
    ordered = sorted(lags) or [0.0]
    return {
        "samples": len(lags),
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max_ms": 1000 * ordered[-1],
    }


async def _run(mode: str, blocks: int, rate: float) -> dict[str, Any]:
    sources = [Source(EndpointAddress(f"10.{i // 250}.{i % 250}.1:8000"), 0) for i in range(SOURCES)]
    index = PrefixIndex(max_entries=10**9, max_entries_per_source=10**8, rounds_elsewhere=mode == "thread")
    for source in sources:
        index.add_source(source, namespace="llama", block_size=BLOCK)
    ingest = IndexIngest(index)
    stop = asyncio.Event()
    idle: list[float] = []
    probe = asyncio.create_task(_probe(idle, stop))
    await asyncio.sleep(1.0)
    stop.set()
    await probe
    stop.clear()
    lags: list[float] = []
    probe = asyncio.create_task(_probe(lags, stop))
    rng = random.Random(1)
    # Prompts are windows of one long random text (cheap to cut, distinct enough to key apart).
    text = tuple(rng.choices(range(128_000), k=2_000_000))
    loop = asyncio.get_running_loop()
    started = loop.time()
    made = 0
    while made < blocks:
        # Paced: the batches due by now (at `rate` blocks a second), then the loop's turn.
        due = min(blocks, int((loop.time() - started) * rate) + 32)
        while made < due:
            source = sources[(made // 32) % SOURCES]
            at = rng.randrange(len(text) - 32 * BLOCK)
            hashes = tuple(rng.getrandbits(64) for _ in range(32))
            batch = DecodedBatch(0.0, [BlockStored(hashes, None, text[at : at + 32 * BLOCK], BLOCK)], 0)
            ingest.on_decoded(source, batch)
            made += 32
        await asyncio.sleep(0.001)
    behind = loop.time() - started - blocks / rate
    while ingest.rounds.busy:  # noqa: ASYNC110 - the last round's end comes as a callback on this loop
        await asyncio.sleep(0.01)
    wall = loop.time() - started
    stop.set()
    await probe
    ingest.close()
    stats = index.stats()
    return {
        "mode": mode,
        "blocks": index.blocks(),
        "sources": SOURCES,
        "rounds": stats.settle_rounds,
        "rounds_in_thread": ingest.rounds.in_thread,
        "rounds_waited": ingest.rounds.waited,
        "longest_round_ms": stats.settle_seconds_max * 1000,
        "rate": rate,
        "ingest_s": wall,
        "behind_s": behind,
        "idle_lag": _summary(idle),
        "lag": _summary(lags),
        # Idle lag says the machine was quiet; falling behind the pace says ingest could not keep up.
        "valid": _summary(idle)["p99_ms"] <= IDLE_P99_LIMIT_MS and behind < 0.1 * blocks / rate,
    }


def report(results: dict[str, Any]) -> str:
    lines = [
        "# KV index settling rounds: the event loop inline against a thread",
        "",
        provenance(results["machine"]),
        "",
        f"{results['runs'][0]['blocks']:,} blocks stored over {SOURCES:,} sources through the real ingest "
        f"on a running event loop at {results['runs'][0]['rate']:,.0f} blocks/s (a busy fleet's engines), "
        "in 32-block batches; a probe sleeping 1 ms measures the loop's lag. Each mode in a fresh child "
        "process.",
        "",
        "| mode | rounds (in a thread / waited) | longest round ms | loop lag p50 ms | p99 ms | max ms "
        "| behind the pace s | idle lag p99 ms | valid |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|",
    ]
    for run in results["runs"]:
        lines.append(
            f"| {run['mode']} | {run['rounds']} ({run['rounds_in_thread']} / {run['rounds_waited']}) "
            f"| {run['longest_round_ms']:.0f} | {run['lag']['p50_ms']:.2f} | {run['lag']['p99_ms']:.1f} "
            f"| {run['lag']['max_ms']:.0f} | {run['behind_s']:.2f} | {run['idle_lag']['p99_ms']:.2f} "
            f"| {'yes' if run['valid'] else '**NO**'} |"
        )
    lines += [
        "",
        "*inline*: every round runs inside `apply`, on the loop (the index's behaviour before). *thread*: "
        "rounds run in a worker thread while writes wait and lookups read the index as it was (serve's "
        "default); what arrived meanwhile is worked off 2 ms a loop turn after each round.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2M blocks instead of 8M")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--rate", type=float, default=200_000, help="blocks stored a second (200,000)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "settle_rounds.json")
    parser.add_argument("--mode", choices=("inline", "thread"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks = args.blocks or (2_000_000 if args.quick else 8_000_000)
    if args.mode:
        print(json.dumps(asyncio.run(_run(args.mode, blocks, args.rate))))
        return
    runs = []
    for mode in ("inline", "thread"):
        out = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--blocks", str(blocks), "--rate", str(args.rate)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
        print(f"{mode}: lag max {runs[-1]['lag']['max_ms']:.0f} ms", file=sys.stderr)
    record(args.out, {"machine": machine(), "runs": runs}, report)


if __name__ == "__main__":
    main()
