"""Garbage-collector pauses are timed, by generation, while installed, and not after."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Histogram

from extproc.serve.memory import GcPauses


def _count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value("pauses_seconds_count", {"generation": generation})
    return value or 0.0


def test_each_collection_is_timed_by_generation_until_uninstalled() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses(Histogram("pauses_seconds", "gc", ["generation"], registry=registry))
    pauses.install()
    pauses.install()  # once only
    try:
        cycles = []
        for _ in range(10_000):  # garbage only the cyclic collector frees
            a: list[object] = []
            a.append(a)
            cycles.append(a)
        del cycles
        gc.collect(0)
        gc.collect(2)
        assert _count(registry, "2") >= 1 and _count(registry, "0") >= 1
        total = registry.get_sample_value("pauses_seconds_sum", {"generation": "2"})
        assert total is not None and total > 0
    finally:
        pauses.uninstall()
    before = _count(registry, "2")
    gc.collect(2)
    assert _count(registry, "2") == before
