"""From a model name to an ordered list of endpoints: resolve, filter, pick.

The scheduler reads the current catalog snapshot and the in-flight counts synchronously; nothing
awaits in the middle of a decision, so a decision always sees one consistent catalog.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from extproc.catalog.model import Catalog, Endpoint, Route
from extproc.engines.signals import EngineSignals
from extproc.errors import BadRequest, ModelNotFound, NoReadyEndpoint, Overloaded
from extproc.scheduling.inflight import InFlight, Lease
from extproc.scheduling.picker import filter_subset, pick_endpoints
from extproc.scheduling.policy import CacheThenLoad, Candidate, Policy, RequestFacts
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.prefix import NO_MATCH, PrefixMatch, PrefixScorer, PromptInput
from extproc.types import EndpointAddress


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
    ) -> None:
        self._catalog = catalog
        self._inflight = inflight
        self._count = 1 + max_fallbacks
        self._rng = rng or random.Random()
        self._prefix = prefix
        self.policy: Policy = policy or CacheThenLoad()
        self._signals = signals or (lambda _address: None)

    def schedule(
        self,
        model: str | None,
        subset: frozenset[str] | None = None,
        *,
        prompt: PromptInput | None = None,
        max_tokens: int | None = None,
    ) -> Decision:
        """Decide for a request for ``model`` (None: any endpoint of any worker set).

        With ``prompt`` (the request's path and body) and a prefix scorer, each candidate's cached
        prefix is looked up; the policy ranks the candidates from that, load and engine signals.
        """
        catalog = self._catalog()
        route: Route | None = None
        if model is None:
            candidates: Sequence[Endpoint] = _all_endpoints(catalog)
            wanted = "this request"
        else:
            route = catalog.resolve(model)
            if route is None:
                raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
            candidates = route.endpoints
            wanted = f"model '{model}'"
        if not candidates:
            raise NoReadyEndpoint(f"no ready endpoint serves {wanted}")
        if subset is not None:
            candidates = filter_subset(candidates, subset)
            if not candidates:
                raise NoReadyEndpoint(f"no endpoint in the gateway's subset hint serves {wanted}")
        if route is None:
            picked = pick_endpoints(candidates, self._inflight.count, self._rng, count=self._count)
            return Decision(route=None, endpoints=tuple(picked))
        match = NO_MATCH
        if prompt is not None and self._prefix is not None:
            match = self._prefix.match(catalog, route, prompt, candidates)
        if match.mode == "precise" and match.prompt_tokens is not None:
            candidates = _fitting(catalog, route, candidates, match.prompt_tokens, max_tokens)
        facts = RequestFacts(route.upstream_model, match.prompt_tokens, max_tokens)
        notes: dict[str, str] = {}
        prefill = (0, 0.0)
        if isinstance(self.policy, PredictedTTFT):
            ranking = self.policy.evaluate(facts, self._candidates(candidates, match), self._rng)
            if ranking.shed:
                raise Overloaded(
                    f"every endpoint serving model '{model}' is saturated (running batch and queue limit "
                    "full); retry shortly"
                )
            ranked = ranking.candidates
            best = ranking.predictions[0]
            notes["x-extproc-predicted-ttft-ms"] = f"{best.ttft_s * 1000:.1f}"
            prefill = (best.uncached_tokens, best.ttft_s)
        else:
            ranked = self.policy.rank(facts, self._candidates(candidates, match), self._rng)
        picked = [c.endpoint for c in ranked[: self._count]]
        if self._prefix is not None and match is not NO_MATCH:
            self._prefix.record(match, picked[0].address)
        return Decision(route=route, endpoints=tuple(picked), prefix=match, notes=notes, prefill=prefill)

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

    def models(self) -> list[tuple[str, str]]:
        """Every client-facing model name with the upstream name it resolves to, sorted."""
        return [(name, route.upstream_model) for name, route in sorted(self._catalog().routes.items())]


def _fitting(
    catalog: Catalog, route: Route, candidates: Sequence[Endpoint], prompt: int, max_tokens: int | None
) -> Sequence[Endpoint]:
    """Candidates whose context window (when discovered) holds the prompt and ``max_tokens``.

    Only exact token counts filter (precise mode): an estimate must never refuse a request the
    engine would take. When no window fits, the engine would refuse it too: a 400 that says why.
    """
    need = prompt + (max_tokens or 1)
    windows = [catalog.context_window(e.address, route.upstream_model) for e in candidates]
    fitting = [e for e, window in zip(candidates, windows, strict=True) if window is None or need <= window]
    if fitting:
        return fitting
    largest = max(w for w in windows if w is not None)
    asked = f"{prompt} prompt tokens" + (f" + max_tokens {max_tokens}" if max_tokens else "")
    raise BadRequest(
        f"This request needs {asked} = {need} tokens, more than the largest context window of the "
        f"endpoints serving '{route.client_name}' ({largest})",
        param="messages",
    )


def _all_endpoints(catalog: Catalog) -> list[Endpoint]:
    seen: dict[str, Endpoint] = {}
    for worker_set in catalog.worker_sets.values():
        for endpoint in worker_set.endpoints:
            seen.setdefault(endpoint.address, endpoint)
    return [seen[a] for a in sorted(seen)]
