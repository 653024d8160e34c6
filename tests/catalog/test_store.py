"""The catalog store: one current snapshot, swapped whole, observers notified."""

from __future__ import annotations

import logging

import pytest

from extproc.catalog.model import Catalog, ObjectProblem
from extproc.catalog.store import CatalogStore


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
