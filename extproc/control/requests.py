"""Request control: one request's life in one place.

The protocol layer (:mod:`extproc.protocol`) asks for a decision and reports what Envoy told it;
everything in between happens here, in order:

1. **resolve** the model to its route, once, against one catalog snapshot (the decision that
   follows uses the same snapshot, even across the await of tokenizing off the loop);
2. **tokenize** the prompt first when it is long (off the event loop, bounded in queue and time);
3. **decide** (:class:`~extproc.scheduling.scheduler.Scheduler`);
4. **lease**: the request counts in the :class:`~extproc.control.load.LoadView` as a
   :class:`~extproc.control.load.Lease` held by this replica, with its predicted prefill;
5. **offer** the lease to the request's accounting stream (:mod:`extproc.control.handover`), which
   holds it until the response ends;
6. **first token**: the response began, the prefill is over;
7. **release**: the routing stream ended and no accounting stream claimed the lease, or the
   accounting stream ended.

When every candidate is saturated, the decision raises :class:`~extproc.errors.Saturated`, and the
request waits for room in :mod:`extproc.control.flow` (by its objective's priority and its fairness
ID), is decided again when its turn comes, and continues at step 4; or it gets 429 at once.

This is also the seam where peer sync (peers' leases added to the same load view) plugs in;
policies and the protocol layer do not change for it.
"""

from __future__ import annotations

import itertools
import secrets
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from extproc.catalog.model import Catalog, Route
from extproc.control.flow import (
    BYTES_PER_TOKEN,
    DEFAULT_FAIRNESS_ID,
    TYPICAL_OUTPUT_TOKENS,
    FlowControl,
    FlowMetrics,
    RequestClass,
)
from extproc.control.handover import LeaseHandover
from extproc.control.load import Lease, LoadView
from extproc.control.peers import SharedAccounting
from extproc.errors import ModelNotFound, NoReadyEndpoint, Saturated
from extproc.openai import InferenceRequest
from extproc.scheduling.prefix import Tokenized
from extproc.scheduling.scheduler import Decision, Scheduler, all_endpoints
from extproc.settings import FlowSettings
from extproc.telemetry import clip
from extproc.types import EndpointAddress


class RoutedRequest:
    """A routed request as its routing stream sees it: the decision, and what to report."""

    __slots__ = ("_control", "decision", "lease", "token", "waited")

    def __init__(
        self, control: RequestControl, decision: Decision, lease: Lease, token: str, waited: float = 0.0
    ) -> None:
        self._control = control
        self.decision = decision
        self.lease = lease
        #: The token the lease is offered under (the accounting stream claims it with it).
        self.token = token
        #: Seconds it waited for room in a saturated pool (0: routed at once).
        self.waited = waited

    def response_started(self) -> None:
        """The engine answered (response headers): its prefill is done, the request decodes."""
        self._control.load.prefill_over(self.lease.key)

    def stream_ended(self) -> None:
        """The routing stream ended: the handover releases an unclaimed lease, now or after a grace."""
        self._control.handover.routing_ended(self.token)

    def unreachable(self, address: EndpointAddress) -> None:
        """Envoy could not connect to ``address`` (one of this request's pick or fallbacks)."""
        self._control.on_unreachable(address)

    def retried_away(self) -> None:
        """Envoy gave up on the pick and a retry elsewhere answered."""
        self._control.on_retried_away(self.lease.endpoint)


class RequestControl:
    """Owns every request's route, decision and lease in this replica."""

    def __init__(
        self,
        *,
        catalog: Callable[[], Catalog],
        scheduler: Scheduler,
        load: LoadView,
        owner: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_unreachable: Callable[[EndpointAddress], None] | None = None,
        on_retried_away: Callable[[EndpointAddress], None] | None = None,
        flow: FlowSettings | None = None,
        flow_metrics: FlowMetrics | None = None,
    ) -> None:
        self._catalog = catalog
        self.scheduler = scheduler
        self.load = load
        #: This replica's name on its leases (unique per process).
        self.owner = owner or secrets.token_hex(4)
        self._clock = clock
        self._numbers = itertools.count()
        self.handover = LeaseHandover(self.release, owner=self.owner, clock=clock)
        #: Requests whose routing and accounting streams reached different replicas (peer sync on).
        self.shared: SharedAccounting | None = None
        self.on_unreachable = on_unreachable or (lambda _address: None)
        self.on_retried_away = on_retried_away or (lambda _address: None)
        #: The catalog last looked at by :meth:`accounting_lease` (weakly: a replaced catalog is
        #: freed off the event loop), and its endpoint addresses.
        self._addresses_of: tuple[weakref.ref[Catalog] | None, frozenset[str]] = (None, frozenset())
        #: Where saturated requests wait (none given: nowhere, 429 at once). A lease that ends
        #: may free a seat, so it wakes the queues.
        self.flow: FlowControl[RoutedRequest] = FlowControl(
            flow or FlowSettings(max_queue=0),
            flow_metrics,
            on_lost=lambda routed: routed.stream_ended(),
            clock=clock,
        )
        load.on_release.append(lambda _lease: self.flow.wake())

    # -- the routing stream ---------------------------------------------------------------------

    def route(
        self,
        request: InferenceRequest | None,
        subset: frozenset[str] | None = None,
        klass: RequestClass | None = None,
    ) -> RoutedRequest | Coroutine[Any, Any, RoutedRequest]:
        """Decide for ``request`` (None: a bodiless request, for any endpoint) and lease the pick.

        Returns a coroutine to await instead when the prompt is tokenized off the loop first, or
        when the pool is saturated and the request waits for room (``klass``: its objective and
        fairness ID). Raises :class:`~extproc.errors.RequestError` for what the client should be told.
        """
        catalog = self._catalog()
        if request is None:
            return self._lease(self.scheduler.decide(catalog, None, None, subset))
        route = _resolve(catalog, request)
        matcher = self.scheduler.prefix
        if matcher is not None and matcher.tokenizes_first(route, request):
            return self._route_tokenized(catalog, route, request, subset, klass)
        if self.flow.busy(route.worker_sets):
            return self._wait_for_room(_behind(route), catalog, route, request, subset, klass, None)
        try:
            return self._lease(self.scheduler.decide(catalog, route, request, subset))
        except Saturated as saturated:
            return self._wait_for_room(saturated, catalog, route, request, subset, klass, None)

    async def _route_tokenized(
        self,
        catalog: Catalog,
        route: Route,
        request: InferenceRequest,
        subset: frozenset[str] | None,
        klass: RequestClass | None,
    ) -> RoutedRequest:
        assert self.scheduler.prefix is not None
        tokenized = await self.scheduler.prefix.prompt_tokens(route, request, catalog)
        if self.flow.busy(route.worker_sets):
            return await self._wait_for_room(
                _behind(route), catalog, route, request, subset, klass, tokenized
            )
        try:
            return self._lease(self.scheduler.decide(catalog, route, request, subset, tokenized))
        except Saturated as saturated:
            return await self._wait_for_room(saturated, catalog, route, request, subset, klass, tokenized)

    def _wait_for_room(
        self,
        saturated: Saturated,
        catalog: Catalog,
        route: Route,
        request: InferenceRequest,
        subset: frozenset[str] | None,
        klass: RequestClass | None,
        tokenized: Tokenized | None,
    ) -> Coroutine[Any, Any, RoutedRequest]:
        """The wait of a request whose pool is saturated; raises the 429 at once when it may not wait."""
        klass = klass or RequestClass()
        objective = None if klass.objective is None else catalog.objective(klass.objective, route)
        priority = 0 if objective is None else objective.priority
        if priority < 0 or not self.flow.enabled:
            raise self.flow.refuse(saturated, priority)
        prompt = saturated.prompt_tokens
        if prompt is None:
            prompt = len(request.body) // BYTES_PER_TOKEN
        cost = prompt + (request.max_tokens or TYPICAL_OUTPUT_TOKENS)
        held_at = self._clock()

        def attempt() -> RoutedRequest:
            # Decided afresh: the catalog, the load and the engines have all moved on meanwhile.
            now = self._catalog()
            decision = self.scheduler.decide(now, _resolve(now, request), request, subset, tokenized)
            return self._lease(decision, waited=self._clock() - held_at)

        return self.flow.hold(
            route.worker_sets,
            attempt,
            priority=priority,
            flow=klass.fairness_id or DEFAULT_FAIRNESS_ID,
            cost=cost,
            why=saturated.message,
        )

    def decide(self, request: InferenceRequest | None, subset: frozenset[str] | None = None) -> Decision:
        """What :meth:`route` would pick now (the prompt tokenized inline), without leasing it:
        for callers that hold their own leases (the replay benchmarks) or only ask (tests)."""
        catalog = self._catalog()
        route = None if request is None else _resolve(catalog, request)
        return self.scheduler.decide(catalog, route, request, subset)

    def _lease(self, decision: Decision, waited: float = 0.0) -> RoutedRequest:
        tokens, seconds = decision.prefill
        lease = self.acquire(
            decision.pick.address,
            model="" if decision.route is None else decision.route.upstream_model,
            prefill_tokens=tokens,
            prefill_seconds=seconds,
        )
        return RoutedRequest(self, decision, lease, self.handover.offer(lease), waited)

    def models(self) -> list[tuple[str, str]]:
        """Every client-facing model name with the upstream name it resolves to, sorted."""
        return [(name, route.upstream_model) for name, route in sorted(self._catalog().routes.items())]

    # -- leases ---------------------------------------------------------------------------------

    def acquire(
        self,
        endpoint: EndpointAddress,
        *,
        model: str = "",
        prefill_tokens: int = 0,
        prefill_seconds: float = 0.0,
    ) -> Lease:
        """A new lease of this replica's on ``endpoint``, counted in the load view until released.

        ``prefill_tokens`` / ``prefill_seconds``: the predicted prefill, so the next predictions
        charge this endpoint for it until it should be done.
        """
        until = self._clock() + prefill_seconds if prefill_tokens > 0 and prefill_seconds > 0 else 0.0
        lease = Lease(self.owner, next(self._numbers), endpoint, model, prefill_tokens, until)
        self.load.add(lease)
        return lease

    def release(self, lease: Lease) -> None:
        """The request ended: it no longer counts (releasing twice is harmless). A peer's lease that
        our accounting stream held: its owner is told to end it."""
        self.load.remove(lease.key)
        if lease.owner != self.owner and self.shared is not None:
            self.shared.let_go(lease)

    # -- the accounting stream ------------------------------------------------------------------

    def accounting_lease(
        self, destination: str, *, token: str = "", prefill_tokens: int = 0, prefill_seconds: float = 0.0
    ) -> Lease | None:
        """The lease an accounting stream holds for the request our answer placed: the routing
        stream's own when it was offered here under ``token`` (one count, not two), else a new one
        on the first address of ``destination`` (charged the predicted prefill only when another
        replica routed it); None when the catalog has no such endpoint."""
        offered = self.handover.claim(token)
        if offered is not None:
            return offered
        if self.shared is not None and (held := self.shared.hold(token, destination)) is not None:
            return held  # a peer routed it: its lease, counted once everywhere, now ours to end
        if self.handover.issued_here(token):
            # Our routing stream for it has ended, at the response headers: the prefill is done.
            prefill_tokens, prefill_seconds = 0, 0.0
        catalog = self._catalog()
        seen = self._addresses_of[0]
        if seen is None or seen() is not catalog:
            self._addresses_of = (weakref.ref(catalog), frozenset(e.address for e in all_endpoints(catalog)))
        address = EndpointAddress(destination.split(",", 1)[0].strip())
        if address not in self._addresses_of[1]:
            return None
        return self.acquire(address, prefill_tokens=prefill_tokens, prefill_seconds=prefill_seconds)


def _behind(route: Route) -> Saturated:
    """The verdict for a request that finds others of its pool waiting: it is not decided first."""
    return Saturated(
        f"every endpoint serving model '{route.client_name}' is saturated (requests are waiting)"
    )


def _resolve(catalog: Catalog, request: InferenceRequest) -> Route:
    route = catalog.resolve(request.model)
    if route is None and (why := catalog.unavailable()) is not None:
        raise NoReadyEndpoint(f"{why}; the model '{clip(request.model, 256)}' may be served once it is")
    if route is None:
        # Clipped: the name is the client's, and may be a megabyte long.
        raise ModelNotFound(f"The model '{clip(request.model, 256)}' does not exist.", param="model")
    return route
