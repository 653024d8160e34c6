"""Garbage-collector pauses are timed by generation; a young generation grown large is collected."""

from __future__ import annotations

import asyncio
import gc
import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram

from extproc.serve.memory import GcWatch, bound_young_generation


def _count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value("pauses_seconds_count", {"generation": generation})
    return value or 0.0


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


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


async def test_a_young_generation_grown_past_the_bound_is_collected_on_the_loop() -> None:
    registry = CollectorRegistry()
    bounded = Counter("bounded", "young collections caused", registry=registry)
    thresholds = gc.get_threshold()
    # CPython's own trigger kept from firing, as churn keeps it under its threshold in serve.
    gc.set_threshold(1_000_000, thresholds[1], thresholds[2])
    task = asyncio.create_task(bound_young_generation(bounded, interval=0.01, max_objects=2_000))
    try:
        gc.collect()
        garbage = [_Cycle() for _ in range(3_000)]
        canary = weakref.ref(garbage[0])
        del garbage
        assert canary() is not None  # only a collection can free it
        for _ in range(100):
            await asyncio.sleep(0.01)
            if canary() is None:
                break
        assert canary() is None
        assert registry.get_sample_value("bounded_total") == 1
        # Small young generations are left to CPython's own trigger.
        small = [_Cycle() for _ in range(100)]
        small_canary = weakref.ref(small[0])
        del small
        await asyncio.sleep(0.1)
        assert small_canary() is not None
        assert registry.get_sample_value("bounded_total") == 1
    finally:
        task.cancel()
        gc.set_threshold(*thresholds)
