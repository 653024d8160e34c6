"""Run ``extproc`` with memory tracing, for finding what grows in a long run (see soak.py --memtrace).

Every ``EXTPROC_MEMTRACE_EVERY`` seconds (60) a daemon thread appends one JSON line to
``$EXTPROC_MEMTRACE_DIR/memtrace.jsonl``: RSS, what Python's allocators hold (tracemalloc), what
glibc's malloc holds in use and free in its arenas (mallinfo2: fragmentation shows as free bytes
that RSS keeps), and the 15 source lines whose traced memory grew most since the first dump.

    EXTPROC_MEMTRACE_DIR=/tmp/mt python bench/memtrace.py serve ...
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from extproc.cli import main


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def mallinfo() -> dict[str, float]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {
        "malloc_in_use_mb": round((info.uordblks + info.hblkhd) / 2**20, 2),
        "malloc_free_mb": round(info.fordblks / 2**20, 2),
    }


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def dump_forever(out: Path, every: float) -> None:
    first = tracemalloc.take_snapshot()
    started = time.monotonic()
    while True:
        time.sleep(every)
        snap = tracemalloc.take_snapshot()
        current, _ = tracemalloc.get_traced_memory()
        growth = [
            f"{s.size_diff / 2**20:+.2f} MB {s.count_diff:+d} {s.traceback}"
            for s in snap.compare_to(first, "lineno")[:15]
        ]
        line = {
            "at_s": round(time.monotonic() - started),
            "rss_mb": round(rss_mb(), 2),
            "traced_mb": round(current / 2**20, 2),
            **mallinfo(),
            "top_growth": growth,
        }
        with out.open("a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    out_dir = Path(os.environ.get("EXTPROC_MEMTRACE_DIR", "."))
    tracemalloc.start(int(os.environ.get("EXTPROC_MEMTRACE_FRAMES", "1")))
    threading.Thread(
        target=dump_forever,
        args=(out_dir / "memtrace.jsonl", float(os.environ.get("EXTPROC_MEMTRACE_EVERY", "60"))),
        daemon=True,
    ).start()
    sys.exit(main())
