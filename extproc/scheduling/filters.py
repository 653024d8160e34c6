"""Which endpoints may take a request: small pure filters, applied in order by the scheduler.

Each :class:`Filter` keeps the candidates it allows (:attr:`Filter.keep`) and says what happens
when it allows none (:attr:`Filter.none_kept`): raise the error that tells the client why (503
for the data plane's subset, 400 for a prompt no context window holds) or go on with all of them
(an endpoint that looks down). An empty list never reaches a policy.

- :data:`POOL_FILTERS` run on the route's whole pool before the prefix lookup: the data plane's
  subset hint is a hard bound on where the request may go, so nothing outside it is scored.
- :data:`CANDIDATE_FILTERS` run on the endpoints chosen for scoring (every endpoint of a small
  pool, a bounded set of a large one, :mod:`extproc.scheduling.candidates`). When they leave none
  of a bounded set, :func:`apply` runs them on the whole pool before giving up: a sample never
  refuses what the pool could take.

"Model served" and "ready" are the catalog's join (:meth:`Catalog.resolve` lists only ready
endpoints serving the model), so they are the starting candidates, not filters here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.catalog.model import Catalog, Endpoint, Route
from extproc.errors import BadRequest, NoReadyEndpoint
from extproc.scheduling.prefix import NO_MATCH, PrefixMatch
from extproc.types import EndpointAddress


@dataclass(frozen=True, slots=True)
class FilterContext:
    """What filters may read about one request."""

    catalog: Catalog
    #: None for requests without a model (bodiless reads).
    route: Route | None
    #: The gateway's subset hint (``ip[:port]`` entries), None when absent.
    subset: frozenset[str] | None
    max_tokens: int | None
    #: NO_MATCH before the prefix lookup.
    prefix: PrefixMatch = NO_MATCH
    #: False for an endpoint whose process is gone (nothing listens); from the engine scraper.
    reachable: Callable[[EndpointAddress], bool] = lambda _address: True


def wanted(route: Route | None) -> str:
    """What a request asks for, as error messages name it."""
    return "this request" if route is None else f"model '{route.client_name}'"


@dataclass(frozen=True, slots=True)
class Filter:
    #: The candidates it allows (possibly none).
    keep: Callable[[FilterContext, Sequence[Endpoint]], Sequence[Endpoint]]
    #: When it allows none: raise the client's error, or return the candidates to go on with.
    none_kept: Callable[[FilterContext, Sequence[Endpoint]], Sequence[Endpoint]]


def apply(
    filters: Sequence[Filter],
    context: FilterContext,
    candidates: Sequence[Endpoint],
    pool: Sequence[Endpoint] | None = None,
) -> Sequence[Endpoint]:
    """The candidates every filter allows. ``pool``: the endpoints ``candidates`` were chosen from,
    tried in full when a filter allows none of the chosen ones."""
    for f in filters:
        kept = f.keep(context, candidates)
        if not kept:
            if pool is not None and len(pool) > len(candidates):
                return apply(filters, context, pool)
            kept = f.none_kept(context, candidates)
        candidates = kept
    return candidates


def _reachable(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    return [e for e in candidates if context.reachable(e.address)]


def _all_of_them(_context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    # Our view of health must never turn a request away on its own: with every candidate down the
    # data plane's retries (and its own 503) decide, as they would without us.
    return candidates


#: Candidates whose process still listens (from the engine scraper); all of them if none does.
reachable = Filter(_reachable, _all_of_them)


def _in_subset(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    subset = context.subset
    if subset is None:
        return candidates
    return [e for e in candidates if e.address in subset or e.ip in subset]


def _outside_subset(context: FilterContext, _candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    raise NoReadyEndpoint(f"no endpoint in the gateway's subset hint serves {wanted(context.route)}")


#: The candidates the data plane allows (GIE subset hint): ``ip:port`` or bare ``ip`` entries.
subset_hint = Filter(_in_subset, _outside_subset)


def _need(context: FilterContext) -> int | None:
    """Tokens the request needs in a context window; None when only an estimate is known (an
    estimate must never refuse a request the engine would take)."""
    prefix = context.prefix
    if context.route is None or prefix.mode != "precise" or prefix.prompt_tokens is None:
        return None
    return prefix.prompt_tokens + (context.max_tokens or 1)


def _window_fits(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    need = _need(context)
    if need is None:
        return candidates
    assert context.route is not None
    model, window = context.route.upstream_model, context.catalog.context_window
    return [e for e in candidates if (w := window(e.address, model)) is None or need <= w]


def _no_window_fits(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    route, need = context.route, _need(context)
    assert route is not None and need is not None and context.prefix.prompt_tokens is not None
    windows = [context.catalog.context_window(e.address, route.upstream_model) for e in candidates]
    largest = max(w for w in windows if w is not None)
    max_tokens = context.max_tokens
    asked = f"{context.prefix.prompt_tokens} prompt tokens" + (
        f" + max_tokens {max_tokens}" if max_tokens else ""
    )
    raise BadRequest(
        f"This request needs {asked} = {need} tokens, more than the largest context window of the "
        f"endpoints serving '{route.client_name}' ({largest})",
        param="messages",
    )


#: Candidates whose context window (when discovered) holds the prompt and ``max_tokens``; only
#: exact token counts filter (precise mode). When no window fits, the engine would refuse it too.
context_window = Filter(_window_fits, _no_window_fits)


#: Run on the whole pool, before the prefix lookup.
POOL_FILTERS: tuple[Filter, ...] = (subset_hint,)
#: Run on the endpoints chosen for scoring, after the prefix lookup.
CANDIDATE_FILTERS: tuple[Filter, ...] = (reachable, context_window)
