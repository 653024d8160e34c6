"""Poll every ready endpoint's ``/metrics`` and keep the latest :class:`EngineSignals` per endpoint.

One task scrapes all endpoints of the current catalog concurrently, once per ``interval`` seconds
(a large pool spread over the interval rather than in one burst),
so the request path only reads a dict. A scrape that fails keeps the last good signals but records
why; signals older than :data:`STALE_INTERVALS` intervals are marked stale, since load data that old
says little about the next request and a scheduler should fall back to load-blind choices.
Endpoints that leave the catalog are forgotten at once (catalog notification), not at the next tick.

The page also tells which engine serves there (vLLM's or SGLang's metric names). A worker set that
declares its engine (``kinference.buoyant.io/engine``) is checked against it: an endpoint whose
metrics contradict the declaration is a problem of that set (:meth:`EngineScraper.kind_problems`),
logged once when it appears.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from extproc.addresses import join_host_port
from extproc.catalog.model import Catalog
from extproc.catalog.store import CatalogStore
from extproc.engines.metrics_page import MetricsParseError, parse_signals
from extproc.engines.poller import EndpointPoller, LastAnswer
from extproc.scheduling.engine_signals import EngineSignals
from extproc.types import EndpointAddress, EngineKind, WorkerSetKey

log = logging.getLogger(__name__)

#: A /metrics page larger than this (bytes) is refused: vLLM's is tens of KiB even with many LoRAs.
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
#: Signals older than this many scrape intervals are stale.
STALE_INTERVALS = 3.0
#: A pool larger than this is scraped spread over the interval instead of in one burst: a burst of
#: a thousand answers parsed back to back holds the event loop, and every decision waiting on it,
#: for the time of all of them (bench/fleet.py). Smaller pools take one burst, which costs less.
SPREAD_ABOVE = 64
#: Share of the interval a spread round takes to start its scrapes (the rest is room to finish).
SPREAD_SHARE = 0.8
#: A spread round starts its scrapes in groups this many seconds apart at the least (fewer timer
#: wake-ups than one per endpoint).
SPREAD_STEP_S = 0.01


class ScrapeError(Exception):
    """A scrape that returned no usable page (HTTP status, size)."""


@dataclass(frozen=True, slots=True)
class EndpointSignals:
    """What the scraper knows about one endpoint, as of :meth:`EngineScraper.snapshot`."""

    address: EndpointAddress
    url: str
    #: The latest successfully parsed signals (kept across later failures), None if never scraped.
    signals: EngineSignals | None
    #: ``clock()`` (seconds) when ``signals`` was fetched.
    scraped_at: float | None
    #: Why the latest scrape failed; None when it succeeded (or none finished yet).
    error: str | None
    #: ``clock()`` (seconds) of that failure.
    error_at: float | None
    #: Seconds since ``scraped_at`` at snapshot time; None if never scraped.
    age: float | None
    #: No signals, or older than STALE_INTERVALS x interval: do not schedule on them.
    stale: bool

    @property
    def usable(self) -> EngineSignals | None:
        """The signals if fresh, else None: what a scheduler should read."""
        return None if self.stale else self.signals


@dataclass(slots=True)
class _State(LastAnswer[EngineSignals | None]):
    """An endpoint's latest scrape (``value``: its signals, None if its page showed none we know)."""

    #: The latest scrape found nothing listening (refused, reset): the engine is probably gone.
    unreachable: bool = False
    #: The gateway gave up on it and retried elsewhere, cause unknown: avoided until the next scrape.
    suspect: bool = False
    #: The engine its worker set declares, if any.
    declared: EngineKind | None = None
    #: The set it belongs to (the first one, for an address in several).
    worker_set: WorkerSetKey | None = None


def metrics_urls(catalog: Catalog) -> dict[EndpointAddress, str]:
    """The ``/metrics`` URL of every ready endpoint in ``catalog`` (pure), one per address."""
    return {address: url for address, url, _, _ in _targets(catalog)}


def _targets(catalog: Catalog) -> Iterator[tuple[EndpointAddress, str, EngineKind | None, WorkerSetKey]]:
    """Each ready endpoint once, with its ``/metrics`` URL and the first set (in key order) it is in."""
    seen: set[EndpointAddress] = set()
    for key in sorted(catalog.worker_sets):
        ws = catalog.worker_sets[key]
        for endpoint in ws.endpoints:
            if endpoint.address in seen:
                continue
            seen.add(endpoint.address)
            port = endpoint.port if endpoint.metrics_port is None else endpoint.metrics_port
            yield endpoint.address, f"http://{join_host_port(endpoint.ip, port)}/metrics", ws.engine_kind, key


#: Endpoints reconciled at a time when the catalog changes. A larger catalog is followed by a task,
#: a slice per event-loop turn: following 18,000 endpoints at once held the loop ~30-65 ms.
FOLLOW_SLICE = 1000


class EngineScraper(EndpointPoller):
    """Scrapes the catalog's endpoints every ``interval`` seconds (each attempt bounded by ``timeout``).

    ``session`` is borrowed if given (not closed), else one is made in :meth:`start` and closed in
    :meth:`close`. ``clock`` (seconds, monotonic) stamps scrapes and decides staleness.
    """

    def __init__(
        self,
        store: CatalogStore,
        *,
        interval: float = 1.0,
        timeout: float = 0.5,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        on_unreachable: Callable[[EndpointAddress], None] = lambda _address: None,
        on_signals: Callable[[EndpointAddress, EngineSignals], None] = lambda _address, _signals: None,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be positive, got {interval}")
        super().__init__(what="engine metrics scrape", timeout=timeout, clock=clock, session=session)
        self._store = store
        self.interval = interval
        self._max_bytes = max_response_bytes
        self._states: dict[EndpointAddress, _State] = {}
        #: Called once when an endpoint turns unreachable (e.g. to drop what its cache was thought to hold).
        self._on_unreachable = on_unreachable
        #: Called with each successful scrape's signals (e.g. to calibrate profiles).
        self._on_signals = on_signals
        self.rounds = 0
        #: The catalog a follow is pending for, and the task following large catalogs (see _follow).
        self._latest: Catalog | None = None
        self._following: asyncio.Task[None] | None = None
        self._unsubscribe = store.subscribe(self._follow)
        self._follow(store.current)

    async def close(self) -> None:
        self._unsubscribe()
        if self._following is not None:
            self._following.cancel()
        await super().close()

    def usable(self, address: EndpointAddress) -> EngineSignals | None:
        """One endpoint's signals if fresh, else None: the scheduler's per-candidate read (no copies)."""
        state = self._states.get(address)
        if state is None or state.answered_at is None:
            return None
        if self._clock() - state.answered_at > STALE_INTERVALS * self.interval:
            return None
        return state.value

    def reachable(self, address: EndpointAddress) -> bool:
        """False while the endpoint's latest scrape found nothing listening (its process is gone).

        Unknown endpoints and slow or failing-but-answering ones count as reachable: only a refused
        or reset connection is evidence enough to stop sending traffic there.
        """
        state = self._states.get(address)
        return state is None or not (state.unreachable or state.suspect)

    def snapshot(self) -> Mapping[EndpointAddress, EndpointSignals]:
        """Every endpoint of the current catalog, with staleness judged now."""
        now = self._clock()
        limit = STALE_INTERVALS * self.interval
        result: dict[EndpointAddress, EndpointSignals] = {}
        for address, state in self._states.items():
            age = None if state.answered_at is None else now - state.answered_at
            result[address] = EndpointSignals(
                address=address,
                url=state.url,
                signals=state.value,
                scraped_at=state.answered_at,
                error=state.error,
                error_at=state.error_at,
                age=age,
                stale=age is None or age > limit,
            )
        return result

    def debug_state(self) -> dict[str, Any]:
        endpoints: dict[str, Any] = {}
        for address, entry in sorted(self.snapshot().items()):
            state = self._states[address]
            endpoints[address] = {
                "url": entry.url,
                "stale": entry.stale,
                "ageSeconds": None if entry.age is None else round(entry.age, 3),
                "error": entry.error,
                "unreachable": state.unreachable,
                "suspect": state.suspect,
                "scrapes": state.asks,
                "failures": state.failures,
                "signals": None if entry.signals is None else entry.signals.to_debug(),
            }
        return {
            "intervalSeconds": self.interval,
            "timeoutSeconds": self.timeout,
            "rounds": self.rounds,
            "endpoints": endpoints,
        }

    def _follow(self, catalog: Catalog) -> None:
        """Catalog changed (called synchronously by the store): add new endpoints, drop gone ones.

        Up to :data:`FOLLOW_SLICE` endpoints, before and after, are followed at once. More, on a
        running event loop, are followed by a task a slice at a time, so a reload never holds the
        loop (decisions) for long; a newer catalog arriving meanwhile restarts it. Until it is done,
        new endpoints have no signals yet, as they would before their first scrape anyway.
        """
        self._latest = catalog
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        endpoints = sum(len(ws.endpoints) for ws in catalog.worker_sets.values())
        if loop is None or max(endpoints, len(self._states)) <= FOLLOW_SLICE:
            if self._following is None:  # a task in progress takes the latest catalog itself
                for _ in self._reconcile(catalog):
                    pass
                self._latest = None
            return
        if self._following is None:
            self._following = loop.create_task(self._follow_latest())

    async def _follow_latest(self) -> None:
        try:
            while self._latest is not None:
                catalog, self._latest = self._latest, None
                for _ in self._reconcile(catalog):
                    await asyncio.sleep(0)
                    if self._latest is not None:
                        break  # superseded: start over with the newer catalog
        finally:
            self._following = None

    def _reconcile(self, catalog: Catalog) -> Iterator[None]:
        """Make ``_states`` follow ``catalog``, yielding every :data:`FOLLOW_SLICE` endpoints."""
        wanted: set[EndpointAddress] = set()
        states = self._states
        for count, (address, url, kind, key) in enumerate(_targets(catalog), 1):
            wanted.add(address)
            state = states.get(address)
            if state is None or state.url != url:
                state = states[address] = _State(url)
            state.declared, state.worker_set = kind, key
            if not count % FOLLOW_SLICE:
                yield
        for count, address in enumerate(set(states) - wanted, 1):
            del states[address]
            self.forget(address)
            if not count % FOLLOW_SLICE:
                yield

    def kind_problems(self) -> dict[WorkerSetKey, list[str]]:
        """Per worker set, its endpoints whose metrics name another engine than the set declares."""
        problems: dict[WorkerSetKey, list[str]] = {}
        for address, state in sorted(self._states.items()):
            detected = state.value.engine_kind if state.value is not None else None
            if state.worker_set is not None and _contradicts(state.declared, detected):
                problems.setdefault(state.worker_set, []).append(
                    _kind_problem(address, state.declared, detected)
                )
        return problems

    async def round(self) -> None:
        await self.scrape_all()

    def delay(self, elapsed: float) -> float:
        return self.interval - elapsed

    async def scrape_all(self) -> None:
        """One round: every current endpoint, concurrently; returns when all have answered or failed.

        A pool of more than :data:`SPREAD_ABOVE` endpoints starts its scrapes in even groups over
        :data:`SPREAD_SHARE` of the interval, so their answers arrive spread out too.
        """
        targets = [(address, state.url) for address, state in self._states.items()]
        if len(targets) <= SPREAD_ABOVE:
            await asyncio.gather(*(self._scrape_one(address, url) for address, url in targets))
        else:
            await self._scrape_spread(targets)
        self.rounds += 1

    async def _scrape_spread(self, targets: list[tuple[EndpointAddress, str]]) -> None:
        span = self.interval * SPREAD_SHARE
        groups = max(1, min(len(targets), int(span / SPREAD_STEP_S)))
        per_group = -(-len(targets) // groups)
        step = span / groups
        loop = asyncio.get_running_loop()
        due = loop.time()
        tasks: list[asyncio.Task[None]] = []
        try:
            for first in range(0, len(targets), per_group):
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                for address, url in targets[first : first + per_group]:
                    tasks.append(asyncio.create_task(self._scrape_one(address, url)))
                # One group a step even after a stall: late groups never start together.
                due = max(due, loop.time()) + step
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # a round cancelled midway (close) takes its scrapes with it
                task.cancel()

    async def _scrape_one(self, address: EndpointAddress, url: str) -> None:
        signals, error = await self.get(
            address,
            url,
            accept="text/plain",
            max_bytes=self._max_bytes,
            parse=parse_signals,
            error=ScrapeError,
            parse_errors=(MetricsParseError,),
        )
        now = self._clock()
        state = self._states.get(address)
        if state is None or state.url != url:
            return  # the endpoint left (or moved) while we were asking it
        state.suspect = False  # whatever the gateway saw, this scrape is the newer word
        if error is None:
            before = state.value.engine_kind if state.value is not None else None
            detected = signals.engine_kind if signals is not None else None
            if detected != before and _contradicts(state.declared, detected):
                log.warning("%s", _kind_problem(address, state.declared, detected))
            if state.answered(signals, now):
                log.info("engine metrics recovered endpoint=%s", address)
            state.unreachable = False
            if signals is not None:
                self._on_signals(address, signals)
            return
        state.failed(error, now)
        self.warn_sometimes(address, error)
        if error.unreachable:
            self._mark_unreachable(address, state, "its metrics port refused the connection")

    def connection_failed(self, address: EndpointAddress) -> None:
        """The gateway could not connect to ``address`` for a request: as good as a refused scrape.

        Routed around at once, until a scrape succeeds again (within one interval if it was a
        fluke). Addresses outside the catalog are ignored.
        """
        state = self._states.get(address)
        if state is not None:
            self._mark_unreachable(address, state, "the gateway could not connect to it")

    def retried_away(self, address: EndpointAddress) -> None:
        """The gateway retried a request away from ``address`` (refused stream, reset, or a failed
        connection it did not report): avoided until the next scrape says whether it is gone."""
        state = self._states.get(address)
        if state is not None and not state.suspect:
            state.suspect = True
            log.info(
                "engine avoided until its next scrape (the gateway retried away from it) endpoint=%s", address
            )

    def _mark_unreachable(self, address: EndpointAddress, state: _State, why: str) -> None:
        if state.unreachable:
            return
        state.unreachable = True
        log.warning("engine unreachable, routed around until it answers endpoint=%s reason=%r", address, why)
        try:
            self._on_unreachable(address)
        except Exception:
            log.exception("on_unreachable failed endpoint=%s", address)


def _contradicts(declared: EngineKind | None, detected: EngineKind | None) -> bool:
    return declared is not None and detected is not None and declared != detected


def _kind_problem(address: EndpointAddress, declared: EngineKind | None, detected: EngineKind | None) -> str:
    return (
        f"endpoint {address} serves {detected} metrics but its worker set declares "
        f"kinference.buoyant.io/engine: {declared}"
    )
