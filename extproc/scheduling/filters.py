"""Which endpoints may take a request: small pure filters, applied in order by the scheduler.

Each filter takes the request's :class:`FilterContext` and the candidates left so far and returns
the ones it keeps. Filters that need only the request run before the prefix lookup
(:data:`BEFORE_MATCH`: an endpoint the data plane excludes is neither scored nor picked, and the
lookup costs less); filters that need the prompt's exact length run after it (:data:`AFTER_MATCH`,
with the match in the context). A filter that would leave nothing raises the error that tells the client why
(503 for the data plane's subset, 400 for a prompt no context window holds): an empty list never
reaches a policy. "Model served" and "ready" are the catalog's join (:meth:`Catalog.resolve` lists
only ready endpoints serving the model), so they are the starting candidates, not filters here.
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


Filter = Callable[[FilterContext, Sequence[Endpoint]], Sequence[Endpoint]]


def reachable(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    """Candidates whose process still listens; all of them if none does.

    Our view of health must never turn a request away on its own: with every candidate down the
    data plane's retries (and its own 503) decide, as they would without us.
    """
    alive = [e for e in candidates if context.reachable(e.address)]
    return alive if alive else candidates


def subset_hint(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    """The candidates the data plane allows (GIE subset hint): ``ip:port`` or bare ``ip`` entries."""
    subset = context.subset
    if subset is None:
        return candidates
    kept = [e for e in candidates if e.address in subset or e.ip in subset]
    if not kept:
        raise NoReadyEndpoint(f"no endpoint in the gateway's subset hint serves {wanted(context.route)}")
    return kept


def context_window(context: FilterContext, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    """Candidates whose context window (when discovered) holds the prompt and ``max_tokens``.

    Only exact token counts filter (precise mode): an estimate must never refuse a request the
    engine would take. When no window fits, the engine would refuse it too: a 400 that says why.
    """
    route, prefix = context.route, context.prefix
    if route is None or prefix.mode != "precise" or prefix.prompt_tokens is None:
        return candidates
    prompt, max_tokens = prefix.prompt_tokens, context.max_tokens
    need = prompt + (max_tokens or 1)
    windows = [context.catalog.context_window(e.address, route.upstream_model) for e in candidates]
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


#: The filters every request passes, in order, before and after the prefix lookup.
BEFORE_MATCH: tuple[Filter, ...] = (subset_hint, reachable)
AFTER_MATCH: tuple[Filter, ...] = (context_window,)
