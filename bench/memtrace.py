"""Run ``extproc`` with memory tracing, for finding what grows in a long run (see soak.py --memtrace).

Every ``EXTPROC_MEMTRACE_EVERY`` seconds (60) a daemon thread appends one JSON line to
``$EXTPROC_MEMTRACE_DIR/memtrace.jsonl``: RSS, what Python's allocators hold (tracemalloc), and
what glibc's malloc holds in use and free in its arenas (mallinfo2: fragmentation shows as free
bytes that RSS keeps), Python's allocated blocks; and it dumps the tracemalloc snapshot beside it,
to compare offline. ``EXTPROC_MEMTRACE_FRAMES=0`` skips tracemalloc: its tracing slows serve by
half and each snapshot stalls it for seconds (Envoy then answers 500), so the cheap counters come
first; ``EXTPROC_MEMTRACE_SNAPSHOTS=0`` traces but only logs the traced total.

    EXTPROC_MEMTRACE_DIR=/tmp/mt python bench/memtrace.py serve ...
    python bench/memtrace.py compare /tmp/mt/snapshot-001.bin /tmp/mt/snapshot-009.bin
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from machine import malloc_bytes

from extproc.cli import main


def mallinfo() -> dict[str, float]:
    in_use, free = malloc_bytes()
    return {"malloc_in_use_mb": round(in_use / 2**20, 2), "malloc_free_mb": round(free / 2**20, 2)}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def dump_forever(out_dir: Path, every: float, snapshots: bool) -> None:
    """Each round: one summary line, and the snapshot itself (compared offline: comparing here
    would hold the GIL for seconds and stall serve)."""
    started = time.monotonic()
    for number in itertools.count():
        time.sleep(every)
        line: dict[str, float] = {
            "at_s": round(time.monotonic() - started),
            "rss_mb": round(rss_mb(), 2),
            "python_blocks": sys.getallocatedblocks(),
            **mallinfo(),
        }
        if tracemalloc.is_tracing():
            line["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
            if snapshots:
                tracemalloc.take_snapshot().dump(str(out_dir / f"snapshot-{number:03d}.bin"))
        with (out_dir / "memtrace.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def compare(first: Path, last: Path, top: int = 25) -> None:
    """Print the source lines whose memory grew most between two dumped snapshots."""
    before, after = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(last))
    for stat in after.compare_to(before, "lineno")[:top]:
        print(f"{stat.size_diff / 2**20:+8.2f} MB {stat.count_diff:+8d}  {stat.traceback}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"]:
        compare(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    out_dir = Path(os.environ.get("EXTPROC_MEMTRACE_DIR", "."))
    frames = int(os.environ.get("EXTPROC_MEMTRACE_FRAMES", "1"))
    if frames:  # 0: only the cheap counters (tracing slows serve, and a snapshot stalls it)
        tracemalloc.start(frames)
    threading.Thread(
        target=dump_forever,
        args=(
            out_dir,
            float(os.environ.get("EXTPROC_MEMTRACE_EVERY", "60")),
            os.environ.get("EXTPROC_MEMTRACE_SNAPSHOTS", "1") != "0",
        ),
        daemon=True,
    ).start()
    sys.exit(main())
