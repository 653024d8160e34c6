"""Filters keep the endpoints that may take a request, or say why none can."""

from __future__ import annotations

import pytest

from extproc.catalog.model import Catalog
from extproc.errors import NoReadyEndpoint
from extproc.scheduling.filters import FilterContext, apply, context_window, reachable, subset_hint
from tests.scheduling.candidates import endpoints


def _context(subset: frozenset[str] | None) -> FilterContext:
    return FilterContext(Catalog(), None, subset, None)


def test_subset_matches_address_or_ip() -> None:
    """Subset entries match an endpoint by ip:port or by bare ip."""
    eps = endpoints(3)
    kept = apply((subset_hint,), _context(frozenset({"127.0.0.1:8000", "127.0.0.3"})), eps)
    assert list(kept) == [eps[0], eps[2]]


def test_no_subset_keeps_everything() -> None:
    """Without a hint every candidate stays, and so does a request without a prompt."""
    eps = endpoints(3)
    assert list(apply((subset_hint,), _context(None), eps)) == eps
    assert list(apply((context_window,), _context(None), eps)) == eps


def test_subset_matching_nothing_is_503_naming_the_hint() -> None:
    """A hint that excludes every candidate is refused, naming the subset hint."""
    with pytest.raises(NoReadyEndpoint, match="subset hint"):
        apply((subset_hint,), _context(frozenset({"127.0.0.1:9999"})), endpoints(3))


def test_unreachable_endpoints_are_routed_around_unless_all_are() -> None:
    """A gone engine is skipped; with every candidate gone, all stay (our health view never 503s)."""
    eps = endpoints(3)
    down = {eps[1].address}
    context = FilterContext(Catalog(), None, None, None, reachable=lambda a: a not in down)
    assert list(apply((reachable,), context, eps)) == [eps[0], eps[2]]
    everyone_down = FilterContext(Catalog(), None, None, None, reachable=lambda _a: False)
    assert list(apply((reachable,), everyone_down, eps)) == eps


def test_chosen_candidates_that_all_fail_a_filter_fall_back_to_the_whole_pool() -> None:
    """When every endpoint chosen for scoring is down, the rest of the pool is looked at before
    the request is sent to a gone engine."""
    eps = endpoints(5)
    up = {eps[3].address}
    context = FilterContext(Catalog(), None, None, None, reachable=lambda a: a in up)
    assert list(apply((reachable,), context, eps[:2], pool=eps)) == [eps[3]]
    assert list(apply((reachable,), context, eps[:2])) == eps[:2]
