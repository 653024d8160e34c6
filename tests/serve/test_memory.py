"""The periodic malloc_trim: freed heap pages really go back to the system, and it is counted."""

from __future__ import annotations

import asyncio
import ctypes

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from waiting import eventually

from extproc.serve.memory import malloc_trim_function, resident_bytes, trim_forever

pytestmark = pytest.mark.skipif(malloc_trim_function() is None, reason="no glibc malloc_trim here")


def _fragment_the_heap() -> None:
    """Allocate 2,000 blocks of 16 KiB below glibc's mmap threshold (so on the heap), touch them,
    then free all but every 50th: the holes hold whole free pages that RSS still counts."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    for _ in range(2000):
        p = libc.malloc(16384)
        ctypes.memset(p, 1, 16384)
        blocks.append(p)
    for i, p in enumerate(blocks):
        if i % 50:
            libc.free(p)


async def test_trimming_gives_freed_heap_pages_back_and_counts_them() -> None:
    registry = CollectorRegistry()
    trimmed = Counter("trimmed_bytes", "", registry=registry)
    seconds = Histogram("trim_seconds", "", registry=registry)
    _fragment_the_heap()
    before = resident_bytes()
    task = asyncio.create_task(trim_forever(0.01, trimmed, seconds))
    try:
        await eventually(lambda: bool(registry.get_sample_value("trim_seconds_count")), what="a trim")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    released = registry.get_sample_value("trimmed_bytes_total") or 0.0
    # ~31 MB were freed in 16 KiB holes between live blocks: most of it goes back.
    assert released > 10 * 2**20, (before, released)
    assert resident_bytes() < before - 10 * 2**20
