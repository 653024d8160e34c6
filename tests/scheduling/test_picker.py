"""Fewest in-flight first, random among ties, ordered fallbacks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.catalog.model import Endpoint
from extproc.scheduling.inflight import InFlight
from extproc.scheduling.picker import filter_subset, pick_endpoints
from extproc.types import EndpointAddress, WorkerSetKey


def _eps(n: int) -> list[Endpoint]:
    return [
        Endpoint(EndpointAddress(f"127.0.0.{i}:8000"), f"127.0.0.{i}", 8000, WorkerSetKey("ns/ws"))
        for i in range(1, n + 1)
    ]


@pytest.mark.parametrize("count", [1, 3], ids=["single", "with-fallbacks"])
def test_least_loaded_first(count: int) -> None:
    """The endpoint with the fewest in-flight requests comes first."""
    eps = _eps(3)
    load = {eps[0].address: 4, eps[1].address: 1, eps[2].address: 2}
    picked = pick_endpoints(eps, lambda a: load[a], random.Random(1), count=count)
    assert picked[0] == eps[1]
    if count == 3:
        assert picked == [eps[1], eps[2], eps[0]]


@pytest.mark.parametrize("count", [1, 2], ids=["single", "with-fallbacks"])
def test_ties_are_broken_evenly(count: int) -> None:
    """Equal load spreads picks across all tied endpoints instead of always the first."""
    eps = _eps(4)
    rng = random.Random(3)
    firsts = Counter(pick_endpoints(eps, lambda a: 0, rng, count=count)[0].address for _ in range(4000))
    assert set(firsts) == {e.address for e in eps}
    assert min(firsts.values()) > 800, firsts


def test_no_candidates_or_zero_count() -> None:
    """Nothing to pick from gives an empty list (the scheduler turns it into 503)."""
    assert pick_endpoints([], lambda a: 0, random.Random(), count=2) == []
    assert pick_endpoints(_eps(2), lambda a: 0, random.Random(), count=0) == []


def test_subset_matches_address_or_ip() -> None:
    """Subset entries match an endpoint by ip:port or by bare ip."""
    eps = _eps(3)
    assert filter_subset(eps, frozenset({"127.0.0.1:8000", "127.0.0.3"})) == [eps[0], eps[2]]
    assert filter_subset(eps, frozenset({"127.0.0.1:9999"})) == []


def test_leases_release_once() -> None:
    """Releasing a lease twice does not double-count; zero counts disappear."""
    inflight = InFlight()
    a = EndpointAddress("127.0.0.1:8000")
    first, second = inflight.acquire(a), inflight.acquire(a)
    assert inflight.count(a) == 2
    first.release()
    first.release()
    assert inflight.count(a) == 1
    second.release()
    assert inflight.snapshot() == {}


# --- with cached prompt tokens (the prefix-cache scoring input) ------------------------------------


@pytest.mark.parametrize(
    ("cached", "load", "expected"),
    [
        ({2: 64}, {1: 0, 2: 9, 3: 1, 4: 2}, [2, 1, 3, 4]),
        ({1: 16, 2: 64, 3: 32}, {1: 0, 2: 9, 3: 5, 4: 0}, [2, 3, 1, 4]),
        ({1: 32, 2: 32}, {1: 3, 2: 1, 3: 0, 4: 2}, [2, 1, 3, 4]),
        ({1: 0, 2: 0}, {1: 3, 2: 1, 3: 2, 4: 4}, [2, 3, 1, 4]),
        ({}, {1: 3, 2: 1, 3: 2, 4: 4}, [2, 3, 1, 4]),
        ({3: 16, 4: 48}, {1: 1, 2: 0, 3: 0, 4: 7}, [4, 3, 2, 1]),
    ],
    ids=[
        "cached-beats-load",
        "by-cached-tokens",
        "equal-cached-least-loaded",
        "all-zero-is-by-load",
        "empty-is-by-load",
        "absent-counts-as-zero",
    ],
)
@pytest.mark.parametrize("count", [1, 4], ids=["single", "with-fallbacks"])
def test_most_cached_tokens_first_then_least_load(
    cached: dict[int, int], load: dict[int, int], expected: list[int], count: int
) -> None:
    """Endpoints holding more of the prompt come first; load orders equal holders; absent holds 0."""
    eps = _eps(4)
    address = {i: eps[i - 1].address for i in range(1, 5)}
    loads = {address[i]: n for i, n in load.items()}
    held = {address[i]: n for i, n in cached.items()}
    picked = pick_endpoints(eps, lambda a: loads[a], random.Random(1), count=count, cached=held)
    assert [eps.index(e) + 1 for e in picked] == expected[:count]


@pytest.mark.parametrize("count", [1, 3], ids=["single", "with-fallbacks"])
def test_cached_ties_are_broken_at_random(count: int) -> None:
    """Equal cached tokens and equal load: every tied endpoint is picked first sometimes, others never."""
    eps = _eps(4)
    held = {eps[0].address: 32, eps[2].address: 32, eps[3].address: 16}
    rng = random.Random(9)
    firsts: Counter[str] = Counter()
    for _ in range(2000):
        picked = pick_endpoints(eps, lambda a: 0, rng, count=count, cached=held)
        firsts[picked[0].address] += 1
        if count == 3:
            assert {picked[0], picked[1]} == {eps[0], eps[2]} and picked[2] == eps[3]
    assert set(firsts) == {eps[0].address, eps[2].address}
    assert min(firsts.values()) > 800, firsts
