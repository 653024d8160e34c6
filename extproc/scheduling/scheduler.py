"""From a request to an ordered list of endpoints: resolve, match prefixes, filter, rank.

The pipeline, once per request:

1. **resolve**: the catalog's route for the model (its ready endpoints serving it), or every
   endpoint for a request without a model;
2. **filter** what needs only the request (:mod:`extproc.scheduling.filters`: the subset hint,
   endpoints whose process is gone);
3. **produce** the prefix match (:mod:`extproc.scheduling.prefix`), then **filter** what needs it
   (context window), then one :class:`~extproc.scheduling.policy.Candidate` per endpoint with load
   and engine signals;
4. **rank** with the policy (:mod:`extproc.scheduling.registry`), cut to the pick + fallbacks.

The scheduler reads the current catalog snapshot and the in-flight counts synchronously; nothing
awaits in the middle of a decision, so a decision always sees one consistent catalog.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.catalog.model import Catalog, Endpoint, Route
from extproc.errors import ModelNotFound, NoReadyEndpoint, Overloaded
from extproc.openai import InferenceRequest
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.filters import AFTER_MATCH, BEFORE_MATCH, FilterContext, wanted
from extproc.scheduling.handover import LeaseHandover
from extproc.scheduling.inflight import InFlight, Lease
from extproc.scheduling.least_in_flight import LeastInFlight
from extproc.scheduling.policy import Candidate, Policy, RequestFacts
from extproc.scheduling.prefix import NO_MATCH, PrefixMatch, PrefixScorer, Tokenized
from extproc.scheduling.signals import EngineSignals
from extproc.telemetry import clip
from extproc.types import EndpointAddress

#: Requests without a model have no prompt to match and no model to predict for: spread by load.
_MODELLESS = LeastInFlight()


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes."""

    #: None for requests routed without a model (bodiless requests).
    route: Route | None
    #: The pick first, then fallbacks; never empty.
    endpoints: tuple[Endpoint, ...]
    #: How the prompt was matched against caches, and what the pick already holds.
    prefix: PrefixMatch = NO_MATCH
    #: The policy's account of the pick (e.g. predicted TTFT), as response-header name -> value.
    notes: Mapping[str, str] = field(default_factory=dict)
    #: The pick's predicted prefill: (uncached prompt tokens, seconds until its first token); (0, 0)
    #: when the policy does not predict. Acquiring the lease with it keeps in-flight work exact.
    prefill: tuple[int, float] = (0, 0.0)

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: an ordered comma list."""
        return ",".join(e.address for e in self.endpoints)


class Scheduler:
    """Picks endpoints for requests against the catalog the source last published."""

    def __init__(
        self,
        catalog: Callable[[], Catalog],
        inflight: InFlight,
        *,
        max_fallbacks: int,
        rng: random.Random | None = None,
        prefix: PrefixScorer | None = None,
        policy: Policy | None = None,
        signals: Callable[[EndpointAddress], EngineSignals | None] | None = None,
        reachable: Callable[[EndpointAddress], bool] | None = None,
        on_unreachable: Callable[[EndpointAddress], None] | None = None,
        on_retried_away: Callable[[EndpointAddress], None] | None = None,
    ) -> None:
        self._catalog = catalog
        self._inflight = inflight
        self._count = 1 + max_fallbacks
        self._rng = rng or random.Random()
        self._prefix = prefix
        self.policy: Policy = policy or CacheThenLoad()
        self._signals = signals or (lambda _address: None)
        self._reachable = reachable or (lambda _address: True)
        self._on_unreachable = on_unreachable or (lambda _address: None)
        self._on_retried_away = on_retried_away or (lambda _address: None)
        #: The catalog last looked at by :meth:`lease_for` (weakly: a replaced catalog is freed
        #: off the event loop, see ``take_apart``), and its endpoint addresses.
        self._addresses_of: tuple[weakref.ref[Catalog] | None, frozenset[str]] = (None, frozenset())
        #: Routed requests' leases on their way to their accounting streams.
        self.handover = LeaseHandover()

    def tokenizes_first(self, request: InferenceRequest) -> bool:
        """True when ``request``'s prompt is to be tokenized (:meth:`tokenize`) before :meth:`schedule`."""
        if self._prefix is None or self._prefix.pool is None:
            return False
        route = self._catalog().resolve(request.model)
        return route is not None and self._prefix.tokenizes_first(route, request)

    async def tokenize(self, request: InferenceRequest) -> Tokenized | None:
        """The prompt's ids, computed off the event loop, bounded in queue and time (may fall back)."""
        catalog = self._catalog()
        route = catalog.resolve(request.model)
        if route is None or self._prefix is None:
            return None
        return await self._prefix.prompt_tokens(route, request, catalog)

    def schedule(
        self,
        request: InferenceRequest | None,
        subset: frozenset[str] | None = None,
        tokenized: Tokenized | None = None,
    ) -> Decision:
        """Decide for ``request`` (None: a request without a body, for any endpoint of any worker set).

        ``subset`` is the gateway's subset hint. With a prefix scorer, each candidate's cached
        prefix is looked up; the policy ranks the candidates from that, load and engine signals.
        """
        catalog = self._catalog()
        route: Route | None = None
        if request is None:
            endpoints: Sequence[Endpoint] = _all_endpoints(catalog)
        else:
            route = catalog.resolve(request.model)
            if route is None:
                # Clipped: the name is the client's, and may be a megabyte long.
                raise ModelNotFound(f"The model '{clip(request.model, 256)}' does not exist.", param="model")
            endpoints = route.endpoints
        if not endpoints:
            raise NoReadyEndpoint(f"no ready endpoint serves {wanted(route)}")
        max_tokens = None if request is None else request.max_tokens
        context = FilterContext(catalog, route, subset, max_tokens, reachable=self._reachable)
        for keep in BEFORE_MATCH:
            endpoints = keep(context, endpoints)
        if route is not None and request is not None and self._prefix is not None:
            match = self._prefix.match(catalog, route, request, endpoints, tokenized)
            context = FilterContext(catalog, route, subset, max_tokens, match, self._reachable)
        for keep in AFTER_MATCH:
            endpoints = keep(context, endpoints)
        if route is None:
            facts = RequestFacts("", None, None)
            ranking = _MODELLESS.rank(facts, self._candidates(endpoints, NO_MATCH), self._rng)
        else:
            facts = RequestFacts(route.upstream_model, context.prefix.prompt_tokens, context.max_tokens)
            ranking = self.policy.rank(facts, self._candidates(endpoints, context.prefix), self._rng)
            if ranking.shed:
                raise Overloaded(
                    f"every endpoint serving model '{route.client_name}' is saturated (running batch and "
                    "queue limit full); retry shortly"
                )
        picked = tuple(c.endpoint for c in ranking.candidates[: self._count])
        if self._prefix is not None and context.prefix is not NO_MATCH:
            self._prefix.record(context.prefix, picked[0].address)
        return Decision(route, picked, context.prefix, ranking.notes, ranking.prefill)

    def _candidates(self, endpoints: Sequence[Endpoint], match: PrefixMatch) -> list[Candidate]:
        inflight, cached = self._inflight, match.cached_tokens
        candidates = []
        for e in endpoints:
            tokens, requests = inflight.pending_prefill(e.address)
            candidates.append(
                Candidate(
                    e,
                    inflight.count(e.address),
                    cached.get(e.address, 0),
                    self._signals(e.address),
                    pending_prefill_tokens=tokens,
                    pending_prefills=requests,
                    lower_tier_tokens=match.lower_tier_tokens.get(e.address, 0),
                )
            )
        return candidates

    def acquire(
        self, address: EndpointAddress, *, prefill_tokens: int = 0, prefill_seconds: float = 0.0
    ) -> Lease:
        """Count a request against the endpoint it was sent to until the lease is released.

        ``prefill_tokens`` / ``prefill_seconds``: the decision's predicted prefill, so the next
        predictions charge this endpoint for it until it should be done.
        """
        return self._inflight.acquire(address, prefill_tokens=prefill_tokens, prefill_seconds=prefill_seconds)

    def offer(self, lease: Lease) -> str:
        """Offer a routed request's lease to its accounting stream (:mod:`.handover`); the token."""
        return self.handover.offer(lease)

    def routing_ended(self, token: str) -> None:
        """A routing stream that offered its lease ended (see :mod:`.handover`)."""
        self.handover.routing_ended(token)

    def unreachable(self, address: EndpointAddress) -> None:
        """The gateway could not connect to ``address``; whoever judges reachability hears of it."""
        self._on_unreachable(address)

    def retried_away(self, address: EndpointAddress) -> None:
        """The gateway retried a request we sent to ``address`` on another endpoint."""
        self._on_retried_away(address)

    def lease_for(
        self, destination: str, *, token: str = "", prefill_tokens: int = 0, prefill_seconds: float = 0.0
    ) -> Lease | None:
        """The in-flight lease an accounting stream holds for the request our answer placed: the
        routing stream's own when it was offered here under ``token`` (one count, not two), else a
        new one on the first address of ``destination`` (charged the predicted prefill only when
        another replica routed it); None when the catalog has no such endpoint."""
        offered = self.handover.claim(token)
        if offered is not None:
            return offered
        if self.handover.issued_here(token):
            # Our routing stream for it has ended, at the response headers: the prefill is done.
            prefill_tokens, prefill_seconds = 0, 0.0
        catalog = self._catalog()
        seen = self._addresses_of[0]
        if seen is None or seen() is not catalog:
            self._addresses_of = (weakref.ref(catalog), frozenset(e.address for e in _all_endpoints(catalog)))
        address = EndpointAddress(destination.split(",", 1)[0].strip())
        if address not in self._addresses_of[1]:
            return None
        return self.acquire(address, prefill_tokens=prefill_tokens, prefill_seconds=prefill_seconds)

    def models(self) -> list[tuple[str, str]]:
        """Every client-facing model name with the upstream name it resolves to, sorted."""
        return [(name, route.upstream_model) for name, route in sorted(self._catalog().routes.items())]


def _all_endpoints(catalog: Catalog) -> list[Endpoint]:
    seen: dict[str, Endpoint] = {}
    for worker_set in catalog.worker_sets.values():
        for endpoint in worker_set.endpoints:
            seen.setdefault(endpoint.address, endpoint)
    return [seen[a] for a in sorted(seen)]
