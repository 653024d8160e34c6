"""Memory management seen from serve: freed heap handed back, and the garbage collector's pauses.

**malloc_trim.** Give freed heap memory back to the system now and then (glibc's ``malloc_trim``).

The tokenizer's segment tree (``--tokenize-cache-mb``) keeps replacing entries of a few hundred
bytes to tens of kilobytes; glibc keeps the pages of the holes they leave, so serve's RSS creeps for a while
after the cache has filled (~2-3 MB for a full 64 MiB cache: the pages are free, not leaked).
``malloc_trim(0)`` hands whole free pages back; it took under 1 ms on that heap, in a worker thread.
Where there is no glibc (musl), nothing is done.

**GC pauses.** The cyclic garbage collector stops the event loop while it runs; a full collection
over a large heap (the prefix index, the tokenizers' caches) can take tens of milliseconds, which
every request in flight waits. :class:`GcWatch` times each collection, by generation, and
:func:`freeze_startup_heap` takes what serve loaded at start (modules, tokenizers, the first catalog:
~75 ms of every full collection, bench/results/long_prompts.md) out of the collector's walks.

**Young collections that fire late.** CPython (3.11) collects the young generation when container
objects allocated minus those deallocated pass 700, and deallocating *old* objects counts too. Under
churn (segments evicted from the tokenizer's cache, requests ending) the count stays low while the
young generation grows: a probe saw ~23,000 objects in it, the leftovers of ~900 gRPC streams
(grpcio leaves 5 cyclic objects per stream), collected in one go in ~10 ms by whichever thread
allocated next, a tokenizing thread included, holding the GIL
(docs/investigations/long_prompts_decided_runs.md). :func:`bound_young_generation` looks at its size on
the loop every 50 ms and collects it past :data:`YOUNG_MAX_OBJECTS`.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any

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


def freeze_startup_heap() -> int:
    """Move every object alive now out of the cyclic collector's reach (``gc.freeze``); how many.

    Called once serve has loaded everything it keeps for its life and before it takes requests, so
    what is frozen is permanent or freed by reference counts (nothing of it is cyclic garbage). Full
    collections then walk only what was made since: a serve with a 128k-vocabulary tokenizer paused
    ~75 ms per full collection, about ten times less once frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


#: How often :func:`bound_young_generation` looks at the young generation.
YOUNG_CHECK_INTERVAL_S = 0.05
#: The young generation's size past which it is collected at once. In serve under load, young
#: collections of ~2,500 objects took ~3 ms and one of ~23,000 ~10 ms (gRPC's objects are slow to
#: free): this keeps them to a few ms, on the loop, where nothing else holds the GIL meanwhile.
YOUNG_MAX_OBJECTS = 5_000


async def bound_young_generation(
    collected: Counter, interval: float = YOUNG_CHECK_INTERVAL_S, max_objects: int = YOUNG_MAX_OBJECTS
) -> None:
    """Every ``interval`` s, collect the young generation if it holds over ``max_objects`` objects
    (see the module docstring); ``collected`` counts the collections this caused.

    Listing the generation costs ~4 ns an object here (~5 µs for 1,300, ~70 µs for 15,000).
    """
    while True:
        await asyncio.sleep(interval)
        if gc.isenabled() and len(gc.get_objects(0)) > max_objects:
            gc.collect(0)
            collected.inc()


class GcWatch:
    """Times each collection into ``seconds`` (labelled by generation) while installed.

    Nothing here thaws the frozen heap: a catalog reload freezes what it adds after collecting
    (see ``extproc.sources.file``), so full collections keep walking only what is young.
    """

    def __init__(self, seconds: Histogram) -> None:
        self._seconds = seconds
        self._started = 0.0

    def install(self) -> None:
        if self._on_collect not in gc.callbacks:
            gc.callbacks.append(self._on_collect)

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started:
            self._seconds.labels(str(info.get("generation"))).observe(time.perf_counter() - self._started)
            self._started = 0.0
