"""Garbage-collector pauses are timed by generation."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Histogram

from extproc.serve.memory import GcWatch


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
