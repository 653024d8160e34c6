"""From a resolved request to an ordered list of endpoints: filter, match prefixes, rank.

The pipeline, once per request, against the catalog snapshot request control resolved the route in:

1. **bound** the pool by the data plane's subset hint (:data:`~extproc.scheduling.filters.POOL_FILTERS`);
2. **produce** the prefix match (:mod:`extproc.scheduling.prefix`): the endpoints holding some of
   the prompt, at a cost that follows the match, not the pool;
3. **choose** what to score: every endpoint of a small pool; of a large one, the best prefix
   holders, the least loaded and a few at random (:mod:`extproc.scheduling.candidates`);
4. **filter** the chosen (:data:`~extproc.scheduling.filters.CANDIDATE_FILTERS`: endpoints whose
   process is gone, context windows), the whole pool when none of the chosen passes; then one
   :class:`~extproc.scheduling.policy.Candidate` per endpoint with load and engine signals;
5. **rank** with the policy (:mod:`extproc.scheduling.registry`), cut to the pick + fallbacks;
6. tell the **decision hooks** (approximate affinity, calibration): policies stay pure, what a
   pick teaches is recorded here, once, after the decision is made.

Nothing awaits in the middle of a decision: the catalog snapshot, the index and the load view are
read synchronously, so a decision sees one consistent state and needs no locks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from extproc.catalog.model import Catalog, Endpoint, Route
from extproc.errors import NoReadyEndpoint, Saturated
from extproc.openai import InferenceRequest
from extproc.scheduling.candidates import choose
from extproc.scheduling.engine_signals import EngineSignals
from extproc.scheduling.filters import CANDIDATE_FILTERS, POOL_FILTERS, FilterContext, apply, wanted
from extproc.scheduling.least_in_flight import LeastInFlight
from extproc.scheduling.policy import Candidate, Policy, Prediction, RequestFacts
from extproc.scheduling.pool import PoolCache
from extproc.scheduling.prefix import NO_MATCH, PrefixMatch, PrefixMatcher, Tokenized
from extproc.settings import CandidateSettings
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
    #: The policy's prediction for the pick, when it predicts.
    prediction: Prediction | None = None

    @property
    def pick(self) -> Endpoint:
        return self.endpoints[0]

    @property
    def prefill(self) -> tuple[int, float]:
        """The pick's predicted prefill: (uncached prompt tokens, seconds until its first token);
        (0, 0) when the policy does not predict."""
        p = self.prediction
        return (0, 0.0) if p is None else (p.uncached_tokens, p.ttft_s)

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: an ordered comma list."""
        return ",".join(e.address for e in self.endpoints)


class Load(Protocol):
    """The load a decision reads per endpoint (defined here, by its consumer: request control's
    load view holds the leases behind it)."""

    def count(self, address: EndpointAddress) -> int:
        """Requests in flight at ``address``."""
        ...

    def pending_prefill(self, address: EndpointAddress) -> tuple[int, int]:
        """(uncached prompt tokens, requests) routed to ``address`` whose prefill should still run."""
        ...

    def ended_since_scrape(self, address: EndpointAddress) -> int:
        """Requests at ``address`` that ended since the engine was last scraped."""
        ...

    def least_loaded(self, k: int, among: AbstractSet[EndpointAddress]) -> list[EndpointAddress]:
        """Up to ``k`` endpoints of ``among`` with the least load, least first, in O(k)."""
        ...


#: Told every decision (never a shed one): what the pick teaches (affinity, calibration).
DecisionHook = Callable[[Decision], None]


class Scheduler:
    """Decides for requests whose route is resolved; reads load, prefixes and engine signals."""

    def __init__(
        self,
        load: Load,
        policy: Policy,
        *,
        max_fallbacks: int,
        rng: random.Random | None = None,
        prefix: PrefixMatcher | None = None,
        signals: Callable[[EndpointAddress], EngineSignals | None] | None = None,
        reachable: Callable[[EndpointAddress], bool] | None = None,
        hooks: Sequence[DecisionHook] = (),
        candidates: CandidateSettings | None = None,
    ) -> None:
        self._load = load
        self.policy = policy
        self._count = 1 + max_fallbacks
        self._rng = rng or random.Random()
        self.prefix = prefix
        self._signals = signals or (lambda _address: None)
        self._reachable = reachable or (lambda _address: True)
        self._hooks = tuple(hooks)
        self.candidates = candidates or CandidateSettings()
        self._pools = PoolCache()

    def add_hook(self, hook: DecisionHook) -> None:
        """Tell ``hook`` of every decision from now on (after the hooks given at construction)."""
        self._hooks = (*self._hooks, hook)

    def decide(
        self,
        catalog: Catalog,
        route: Route | None,
        request: InferenceRequest | None,
        subset: frozenset[str] | None = None,
        tokenized: Tokenized | None = None,
    ) -> Decision:
        """Decide for ``request`` on ``route`` (both None: a request without a body, for any
        endpoint of any worker set). ``subset`` is the gateway's subset hint; ``tokenized`` the
        prompt's ids when they were computed before."""
        endpoints: Sequence[Endpoint] = all_endpoints(catalog) if route is None else route.endpoints
        if not endpoints:
            raise NoReadyEndpoint(f"no ready endpoint serves {wanted(route)}")
        max_tokens = None if request is None else request.max_tokens
        context = FilterContext(catalog, route, subset, max_tokens, reachable=self._reachable)
        endpoints = apply(POOL_FILTERS, context, endpoints)
        pool = self._pools.get(catalog, endpoints)
        if route is not None and request is not None and self.prefix is not None:
            match = self.prefix.match(catalog, route, request, pool, tokenized)
            context = FilterContext(catalog, route, subset, max_tokens, match, self._reachable)
        limits = self.candidates
        if limits.scores_all(len(pool)):
            endpoints = apply(CANDIDATE_FILTERS, context, endpoints)
        else:
            least = self._load.least_loaded(limits.least_loaded, pool.addresses)
            chosen = choose(pool, context.prefix.cached_tokens, least, limits, self._rng)
            endpoints = apply(CANDIDATE_FILTERS, context, chosen, pool=endpoints)
        if route is None:
            facts = RequestFacts("", None, None)
            ranking = _MODELLESS.rank(facts, self._candidates(endpoints, NO_MATCH), self._rng)
        else:
            facts = RequestFacts(route.upstream_model, context.prefix.prompt_tokens, context.max_tokens)
            ranking = self.policy.rank(facts, self._candidates(endpoints, context.prefix), self._rng)
            if ranking.shed:
                raise Saturated(
                    f"every endpoint serving model '{route.client_name}' is saturated (running batch and "
                    "queue limit full, or KV cache at its limit)",
                    prompt_tokens=context.prefix.prompt_tokens,
                )
        picked = tuple(c.endpoint for c in ranking.candidates[: self._count])
        decision = Decision(route, picked, context.prefix, ranking.prediction)
        for hook in self._hooks:
            hook(decision)
        return decision

    def _candidates(self, endpoints: Sequence[Endpoint], match: PrefixMatch) -> list[Candidate]:
        load, cached = self._load, match.cached_tokens
        candidates = []
        for e in endpoints:
            tokens, requests = load.pending_prefill(e.address)
            candidates.append(
                Candidate(
                    e,
                    load.count(e.address),
                    cached.get(e.address, 0),
                    self._signals(e.address),
                    pending_prefill_tokens=tokens,
                    pending_prefills=requests,
                    lower_tier_tokens=match.lower_tier_tokens.get(e.address, 0),
                    ended_since_scrape=load.ended_since_scrape(e.address),
                )
            )
        return candidates


def all_endpoints(catalog: Catalog) -> list[Endpoint]:
    """Every endpoint of every worker set, once each, by address."""
    seen: dict[str, Endpoint] = {}
    for worker_set in catalog.worker_sets.values():
        for endpoint in worker_set.endpoints:
            seen.setdefault(endpoint.address, endpoint)
    return [seen[a] for a in sorted(seen)]
