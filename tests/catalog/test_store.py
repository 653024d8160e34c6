"""The catalog store: one current snapshot, swapped whole, observers notified."""

from __future__ import annotations

import dataclasses
import logging
import weakref

import pytest

from catalog.test_build import build, eps, iws, svc
from extproc.catalog.model import Catalog, ObjectProblem
from extproc.catalog.store import CatalogStore, take_apart


def _catalog(tag: str) -> Catalog:
    return Catalog(problems=(ObjectProblem("Service", "default", tag, "test"),))


def test_store_starts_empty_and_not_loaded() -> None:
    """Before any source publishes, readiness can tell the catalog is not loaded yet."""
    store = CatalogStore()
    assert (store.current, store.loaded, store.generation) == (Catalog(), False, 0)


def test_publish_swaps_the_snapshot() -> None:
    """Each publish replaces the catalog whole; a reader's earlier snapshot is untouched."""
    store = CatalogStore()
    first, second = _catalog("a"), _catalog("b")
    store.publish(first)
    held = store.current
    store.publish(second)
    assert (held, store.current, store.loaded, store.generation) == (first, second, True, 2)


def test_subscribers_see_every_publish_in_order() -> None:
    """Observers get each new catalog after it is current."""
    store = CatalogStore()
    seen: list[tuple[str, Catalog, bool]] = []
    store.subscribe(lambda c: seen.append(("one", c, store.current is c)))
    store.subscribe(lambda c: seen.append(("two", c, store.current is c)))
    catalog = _catalog("a")
    store.publish(catalog)
    assert seen == [("one", catalog, True), ("two", catalog, True)]


def test_failing_subscriber_is_logged_and_does_not_stop_others(caplog: pytest.LogCaptureFixture) -> None:
    """A buggy observer cannot keep routing-table updates from the others."""
    store = CatalogStore()
    seen: list[Catalog] = []

    def broken(_: Catalog) -> None:
        raise RuntimeError("observer bug")

    store.subscribe(broken)
    store.subscribe(seen.append)
    with caplog.at_level(logging.ERROR, logger="extproc.catalog.store"):
        store.publish(_catalog("a"))
    assert seen == [_catalog("a")]
    assert store.current == _catalog("a")
    assert "catalog subscriber failed generation=1" in caplog.text
    assert "observer bug" in caplog.text


def test_unsubscribe_stops_notifications() -> None:
    """An observer that unsubscribes is not called again (and unsubscribing twice is harmless)."""
    store = CatalogStore()
    seen: list[Catalog] = []
    unsubscribe = store.subscribe(seen.append)
    store.publish(_catalog("a"))
    unsubscribe()
    unsubscribe()
    store.publish(_catalog("b"))
    assert seen == [_catalog("a")]


def _two_sets() -> Catalog:
    return build(
        iws("a", models=[{"name": "m-a"}]),
        svc("a"),
        eps("a-1", "a", ["127.0.0.1"]),
        iws("b", models=[{"name": "m-b"}]),
        svc("b"),
        eps("b-1", "b", ["127.0.0.2"]),
    )


def test_taking_apart_never_touches_a_catalog_still_in_use() -> None:
    """A replaced catalog a reader still holds (or whose tables a newer catalog shares) stays whole."""
    held = _two_sets()
    take_apart([held])
    assert set(held.worker_sets) == {"default/a", "default/b"} and set(held.routes) == {"m-a", "m-b"}
    shared = _two_sets()
    newer = dataclasses.replace(shared, problems=(ObjectProblem("Service", "default", "x", "test"),))
    del shared
    retired = [Catalog(worker_sets=newer.worker_sets, routes=newer.routes)]
    take_apart(retired)
    assert retired == []
    assert set(newer.worker_sets) == {"default/a", "default/b"} and set(newer.routes) == {"m-a", "m-b"}


def test_a_catalog_nothing_else_holds_is_freed() -> None:
    catalog = _two_sets()
    gone = weakref.ref(catalog)
    retired = [catalog]
    del catalog
    take_apart(retired)
    assert gone() is None
