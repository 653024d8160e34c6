"""The load order: a large pool's least-loaded endpoints, kept as leases and scrapes change."""

from __future__ import annotations

import itertools

from extproc.control.load import Lease, LoadView
from extproc.control.load_order import LEVELS, LoadOrder
from extproc.types import EndpointAddress

POOL = frozenset(EndpointAddress(f"10.0.0.{i}:8000") for i in range(1, 11))
A, B, C = (EndpointAddress(f"10.0.0.{i}:8000") for i in (1, 2, 3))
_numbers = itertools.count()


def lease(endpoint: EndpointAddress) -> Lease:
    return Lease("me", next(_numbers), endpoint)


def test_the_least_loaded_are_the_endpoints_with_fewest_requests_in_flight() -> None:
    """Endpoints with our requests in flight come after idle ones, fewest first."""
    load = LoadView()
    leases = [lease(a) for a in POOL for _ in range(3)]
    for held in leases:
        load.add(held)
    for held in leases:
        if held.endpoint == A:
            load.remove(held.key)
    load.remove(next(held for held in leases if held.endpoint == B).key)
    assert load.least_loaded(2, POOL) == [A, B]


def test_an_engines_own_queue_counts_when_it_exceeds_ours() -> None:
    """A scrape showing a long queue (another router's traffic) ranks the endpoint as busy."""
    load = LoadView()
    for address in POOL - {A}:
        load.engine_queue(address, 1)
    load.engine_queue(A, 40)
    assert A not in load.least_loaded(len(POOL) - 1, POOL)
    assert load.least_loaded(len(POOL), POOL)[-1] == A
    load.engine_queue(A, 0)
    assert A in load.least_loaded(len(POOL) - 1, POOL)


def test_equally_loaded_endpoints_take_turns() -> None:
    """An endpoint that was picked and finished goes behind the others of its level: idle
    endpoints are offered in turn, not the same few every time."""
    load = LoadView()
    offered: list[EndpointAddress] = []
    for _ in range(len(POOL)):
        first = load.least_loaded(1, POOL)[0]
        offered.append(first)
        held = lease(first)
        load.add(held)
        load.remove(held.key)
    assert sorted(offered) == sorted(POOL)


def test_only_members_of_the_pool_asked_for_are_offered() -> None:
    """Another model's endpoints, however idle, are never offered for this pool."""
    load = LoadView()
    other = frozenset({EndpointAddress("10.9.0.1:8000")})
    load.least_loaded(1, other)
    for address in POOL:
        load.add(lease(address))
    assert load.least_loaded(3, POOL) != [] and set(load.least_loaded(3, POOL)) <= POOL
    assert load.least_loaded(3, other) == list(other)


def test_endpoints_that_left_the_catalog_are_forgotten() -> None:
    """After the catalog drops endpoints the order holds none of them, even when a request still
    in flight there ends later: it stays as small as the catalog."""
    order = LoadOrder()
    order.add(POOL)
    order.in_flight(C, 1)
    order.keep({A, B})
    order.in_flight(C, 0)
    order.queued(B, 3)
    assert len(order) == 2
    assert order.least(10, POOL) == [A, B]


def test_loads_beyond_the_last_level_are_ordered_together_and_never_lost() -> None:
    order = LoadOrder()
    order.add([A, B])
    order.queued(A, LEVELS * 10)
    order.queued(B, LEVELS + 1)
    assert sorted(order.least(2, {A, B})) == sorted([A, B])
    order.queued(A, 0)
    assert order.least(1, {A, B}) == [A]
