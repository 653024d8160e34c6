"""Give freed heap memory back to the system now and then (glibc's ``malloc_trim``).

The prompt-piece cache (``--tokenize-cache-mb``) keeps replacing entries of a few hundred bytes to
tens of kilobytes; glibc keeps the pages of the holes they leave, so serve's RSS creeps for a while
after the cache has filled (~2-3 MB for a full 64 MiB cache: the pages are free, not leaked).
``malloc_trim(0)`` hands whole free pages back; it took under 1 ms on that heap, in a worker thread.
Where there is no glibc (musl), nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram

log = logging.getLogger(__name__)


def malloc_trim_function() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: int(trim(0))


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``), 0 where there is none."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


async def trim_forever(interval: float, trimmed: Counter, seconds: Histogram) -> None:
    """Every ``interval`` s, ``malloc_trim(0)`` in a worker thread; count what RSS lost and how long."""
    trim = malloc_trim_function()
    if trim is None:
        log.info("no malloc_trim in this C library: freed heap pages stay with the process")
        return
    while True:
        await asyncio.sleep(interval)
        before = resident_bytes()
        started = time.perf_counter()
        await asyncio.to_thread(trim)
        seconds.observe(time.perf_counter() - started)
        trimmed.inc(max(0, before - resident_bytes()))
