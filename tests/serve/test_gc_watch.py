"""Garbage-collector pauses are timed by generation, and a thawed startup heap is frozen again."""

from __future__ import annotations

import asyncio
import gc
import weakref

from prometheus_client import CollectorRegistry, Histogram

from extproc.serve.memory import GcWatch


def _count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value("pauses_seconds_count", {"generation": generation})
    return value or 0.0


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


def test_each_collection_is_timed_by_generation_until_uninstalled() -> None:
    registry = CollectorRegistry()
    watch = GcWatch(Histogram("pauses_seconds", "gc", ["generation"], registry=registry))
    watch.install()
    watch.install()  # once only
    try:
        gc.collect(0)
        gc.collect(2)
        assert _count(registry, "2") == 1 and _count(registry, "0") >= 1
        total = registry.get_sample_value("pauses_seconds_sum", {"generation": "2"})
        assert total is not None and total > 0
    finally:
        watch.uninstall()
    gc.collect(2)
    assert _count(registry, "2") == 1


async def test_a_thawed_heap_is_frozen_again_after_its_next_full_collection() -> None:
    """A catalog reload thaws the heap (freeze, unfreeze); the next full collection frees the
    garbage made meanwhile, then the heap goes back to frozen."""
    registry = CollectorRegistry()
    pauses = Histogram("pauses_seconds", "gc", ["generation"], registry=registry)
    watch = GcWatch(pauses, asyncio.get_running_loop())
    gc.freeze()
    watch.install()
    try:
        gc.collect(2)
        await asyncio.sleep(0)
        assert watch.refrozen == 0  # still frozen: nothing to do
        gc.unfreeze()  # what a reload does
        probe = weakref.ref(_Cyclic())
        gc.collect(2)
        assert probe() is None  # collected before anything is frozen again
        await asyncio.sleep(0)
        assert watch.refrozen == 1 and gc.get_freeze_count() > 0
    finally:
        watch.uninstall()
        gc.unfreeze()
