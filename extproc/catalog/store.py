"""The one owner of the current :class:`Catalog`: sources publish into it, everything else reads.

Publishing replaces one reference, so a reader that took ``store.current`` keeps a consistent
snapshot for as long as it needs; nothing is mutated in place, so no lock is needed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

from extproc.catalog.model import Catalog

logger = logging.getLogger(__name__)

Subscriber = Callable[[Catalog], None]


class CatalogStore:
    """Holds the latest catalog and tells observers (KV subscribers, pollers) when it changes."""

    def __init__(self) -> None:
        self._current = Catalog()
        self._generation = 0
        self._subscribers: list[Subscriber] = []

    @property
    def current(self) -> Catalog:
        """The latest published catalog (empty until the first publish)."""
        return self._current

    @property
    def loaded(self) -> bool:
        """False until a source has published once: readiness should wait for it."""
        return self._generation > 0

    @property
    def generation(self) -> int:
        """How many catalogs have been published; lets observers skip work they already did."""
        return self._generation

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call ``callback(catalog)`` after every publish; returns a function that unsubscribes."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def publish(self, catalog: Catalog) -> None:
        """Swap in ``catalog``, then notify subscribers; a failing subscriber never blocks the others."""
        self._current = catalog
        self._generation += 1
        for callback in list(self._subscribers):
            try:
                callback(catalog)
            except Exception:
                # A subscriber bug must not stop routing-table updates reaching the others.
                logger.exception(
                    "catalog subscriber failed generation=%d callback=%r", self._generation, callback
                )


def take_apart(retired: list[Catalog]) -> None:
    """Free replaced catalogs a few entries at a time; meant for a worker thread.

    Dropping a catalog of 18,000 worker sets frees its objects in one uninterruptible call (~25 ms
    during which the event loop cannot run). Popping its tables' entries one by one lets the thread
    yield the GIL between them. Only what nothing else refers to is taken apart: a catalog still in
    use somewhere, or a table another catalog shares, is just let go (CPython's reference counts
    say so, and nothing can take a new reference to an object nothing refers to).
    """
    while retired:
        catalog = retired.pop()
        if sys.getrefcount(catalog) > 2:  # `catalog` and getrefcount's argument
            continue
        for table in (catalog.routes, catalog.worker_sets, catalog.context_windows):
            # the catalog's slot, `table` and the argument
            if isinstance(table, dict) and sys.getrefcount(table) <= 3:
                while table:
                    table.popitem()
        del catalog
