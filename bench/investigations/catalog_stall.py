"""How long a catalog file edit can stall `serve`'s event loop (the request path), per kind of file.

A real `Server` (file source, polled every 50 ms) runs in this process; a 1 ms periodic timer on
its loop records how late it fires (the loop's lag) while the catalog file is replaced by each of:
a large valid catalog (N Services + EndpointSlices + worker sets, just under --max-catalog-bytes),
an alias bomb, garbage bytes, an empty file, and a file over the size limit. For each, the report
gives the worst lag seen from the edit until AFTER_S seconds after the source has judged the file
(what applying a catalog costs shows there, and so does the first full collection after it),
whether the catalog in use changed, the longest collector pauses, and the peak RSS growth.

Requests leave cyclic garbage behind, and that is what makes the collector run: a task on the loop
stands in for them (``GARBAGE_PER_S`` small reference cycles a second, a rough stand-in, not a
measured figure), so collections happen during and after a reload as they would under traffic.
Writes ``bench/results/catalog_stall.{json,md}``.

    python bench/investigations/catalog_stall.py [--services 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench harness

from machine import machine, provenance, record

from extproc.demo.catalog import LocalWorkerSet, catalog_documents
from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings
from extproc.sources.file import FileSource, compile_documents

HERE = Path(__file__).resolve().parents[1]  # bench/: results/ and the harness are there
#: Seconds the loop keeps being watched after the file was judged.
AFTER_S = 2.0
#: Reference cycles made and dropped per second on the loop, standing in for requests' garbage.
GARBAGE_PER_S = 5000
ALIAS_BOMB = (
    b"a: &a ["
    + b",".join([b'"lol"'] * 9)
    + b"]\n"
    + b"".join(
        f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n".encode()
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
)


def large_catalog(services: int) -> bytes:
    sets = [
        LocalWorkerSet(f"ws-{i}", f"model-{i}", [f"127.0.{i // 250}.{i % 250 + 1}:8000"])
        for i in range(services)
    ]
    return yaml.safe_dump_all(catalog_documents(sets), sort_keys=False).encode()


async def make_garbage(per_s: int) -> None:
    """Make and drop ``per_s`` small reference cycles a second (in 100 batches), until cancelled."""
    batch = max(1, per_s // 100)
    while True:
        for _ in range(batch):
            node: dict[str, object] = {"payload": [0, 1, 2]}
            node["self"] = node
        await asyncio.sleep(0.01)


class LagProbe:
    """A 1 ms timer on the loop; ``worst`` is the latest it fired since the last ``reset``.

    It also keeps the cyclic collector's pauses since the reset (``gc_pauses``, ms, the longest
    first): a full collection holds the GIL, so it stalls the loop from whichever thread it runs in.
    """

    def __init__(self) -> None:
        self.worst = 0.0
        self.gc_pauses: list[float] = []
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_pauses.append((time.perf_counter() - self._gc_started) * 1000)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, loop.time() - due)

    def reset(self) -> None:
        self.worst = 0.0
        self.gc_pauses = []

    def longest_gc_pauses(self) -> list[float]:
        return [round(ms, 1) for ms in sorted(self.gc_pauses, reverse=True)[:3]]

    async def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def measure(services: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="extproc-stall-"))
    path = tmp / "catalog.yaml"
    base = large_catalog(20)
    path.write_bytes(base)
    limit = 16 * 1024 * 1024
    big = large_catalog(services)
    # (what the file becomes, its bytes, what the file held before)
    cases = [
        ("large valid catalog", big, base),
        ("small catalog replacing the large one", base, big),
        ("alias bomb", ALIAS_BOMB, base),
        ("garbage", b"\x00\xff" * 1000 + b"not yaml: [\n", base),
        ("empty", b"", base),
        ("over the size limit", b"# padding\n" * (limit // 10 + 1), base),
    ]
    base_sets = compile_documents(base, {}, path=path).catalog.worker_sets
    big_sets = compile_documents(big, {}, path=path).catalog.worker_sets
    settings = ServeSettings(
        source=SourceSettings.parse(f"file:{path}", poll_interval=0.05, max_bytes=limit),
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        scrape_interval=0,
    )
    results: dict[str, Any] = {
        "machine": machine(),
        "services": services,
        "after_s": AFTER_S,
        "garbage_per_s": GARBAGE_PER_S,
        "cases": [],
    }
    async with Server(settings) as server:
        source = server.source
        assert isinstance(source, FileSource)
        probe = LagProbe()
        probe.start()
        garbage = asyncio.create_task(make_garbage(GARBAGE_PER_S))
        for name, content, before in cases:
            await asyncio.to_thread(_replace, path, before)
            await _settle(server, expected_sets=len(big_sets) if before is big else len(base_sets))
            generation, errors = server.store.generation, source.reloads_failed
            rss_before = rss_mb()
            probe.reset()
            started = time.monotonic()
            # Written from a worker thread: the harness's own 15 MB write must not count as lag.
            await asyncio.to_thread(_replace, path, content)
            while server.store.generation == generation and source.reloads_failed == errors:
                if time.monotonic() - started > 300:
                    break
                await asyncio.sleep(0.01)
            judged = time.monotonic() - started
            await asyncio.sleep(AFTER_S)
            worst, pauses = probe.worst, probe.longest_gc_pauses()
            # What the next full collection will cost, whenever the collector gets to it: a reload
            # that left objects for it to walk shows here, after the window.
            forced = time.perf_counter()
            gc.collect()
            next_full_ms = (time.perf_counter() - forced) * 1000
            results["cases"].append(
                {
                    "file": name,
                    "bytes": len(content),
                    "judged_after_s": round(judged, 2),
                    "worst_loop_lag_ms": round(worst * 1000, 1),
                    "longest_gc_pauses_ms": pauses,
                    "next_full_collection_ms": round(next_full_ms, 1),
                    "catalog_replaced": server.store.generation != generation,
                    "error": server.source.last_error,
                    "peak_rss_growth_mb": round(rss_mb() - rss_before, 1),
                    "worker_sets_routed": len(server.store.current.worker_sets),
                }
            )
            print(json.dumps(results["cases"][-1]))
        garbage.cancel()
        await probe.stop()
    return results


def _replace(path: Path, content: bytes) -> None:
    """Replace the file in one step, as editors and ConfigMap mounts do (no half-written reads)."""
    staged = path.with_suffix(".staged")
    staged.write_bytes(content)
    os.replace(staged, path)


async def _settle(server: Server, *, expected_sets: int) -> None:
    """Wait until the catalog the case starts from is the one in use."""
    for _ in range(6000):
        if server.source.last_error is None and len(server.store.current.worker_sets) == expected_sets:
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"the starting catalog ({expected_sets} worker sets) never loaded")


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        "# Catalog edits and the event loop",
        "",
        f"{provenance(m)}. The target (issue 14): no edit stalls decisions for more than 50 ms.",
        "",
        "| file | bytes | judged after s | worst loop lag ms | catalog replaced | routed sets after "
        "| peak RSS growth MB | longest GC pauses ms | next full collection ms |",
        "|---|--:|--:|--:|---|--:|--:|---|--:|",
    ]
    for c in results["cases"]:
        lines.append(
            f"| {c['file']} | {c['bytes']:,} | {c['judged_after_s']} | {c['worst_loop_lag_ms']} | "
            f"{'yes' if c['catalog_replaced'] else 'no'} | {c['worker_sets_routed']} | "
            f"{c['peak_rss_growth_mb']} | {', '.join(map(str, c.get('longest_gc_pauses_ms', []))) or '-'} | "
            f"{c.get('next_full_collection_ms', '-')} |"
        )
    lines += [
        "",
        f"Worst loop lag: from the edit until {results.get('after_s', 0)} s after the file was judged. "
        f"A task on the loop made {results.get('garbage_per_s', 0):,} reference cycles a second, "
        "standing in for requests' garbage (it is what makes the collector run). "
        "Next full collection: one forced after the window, timed: what the collector pays "
        "later for what the reload left it to walk (a stall of the loop too, whenever it comes).",
        "",
        "The parse runs in a worker thread with full collections paused (young ones go on) and frees",
        "its documents a few at a time. serve keeps its startup heap frozen; at the end of a parse",
        "that succeeded, the young generations are collected and the new catalog is frozen too,",
        "without a full collection (a successful parse leaves no cyclic garbage, and walking the",
        "new catalog held the GIL ~90 ms for 18,000 sets); a failed parse gets a full collection.",
        "The next full collection then walks only young objects. The loop also pays for applying a",
        "catalog: swapping the routing tables and freeing the catalog it replaces, in proportion to",
        "the number of worker sets.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=8000)
    p.add_argument("--out", type=Path, default=HERE / "results" / "catalog_stall.json")
    args = p.parse_args()
    results = asyncio.run(measure(args.services))
    record(args.out, results, report)


if __name__ == "__main__":
    main()
