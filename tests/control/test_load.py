"""The load view: leases per endpoint, in-flight counts and the prefill work that should still run."""

from __future__ import annotations

import itertools

from extproc.control.load import Lease, LoadView
from extproc.types import EndpointAddress

A = EndpointAddress("10.0.0.1:8000")
_numbers = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lease(endpoint: EndpointAddress = A, *, owner: str = "me", tokens: int = 0, until: float = 0.0) -> Lease:
    return Lease(owner, next(_numbers), endpoint, "m", tokens, until)


def test_pending_prefill_counts_until_its_predicted_end_then_decodes() -> None:
    """A lease's prefill tokens count until its predicted first token, and never after removal."""
    clock = Clock()
    load = LoadView(clock)
    long, short, plain = lease(tokens=8000, until=102.0), lease(tokens=500, until=100.5), lease()
    for each in (long, short, plain):
        load.add(each)
    assert load.count(A) == 3
    assert load.pending_prefill(A) == (8500, 2)
    clock.now += 1.0
    assert load.pending_prefill(A) == (8000, 1)
    load.remove(long.key)
    assert load.pending_prefill(A) == (0, 0)
    load.remove(short.key)
    load.remove(plain.key)
    assert load.remove(long.key) is None
    assert load.count(A) == 0 and load.pending_prefill(A) == (0, 0)


def test_a_lease_counts_once_however_often_it_is_added_or_removed() -> None:
    """Adding or removing the same lease twice does not double-count; zero counts disappear."""
    load = LoadView()
    first, second = lease(), lease()
    for each in (first, first, second):
        load.add(each)
    assert load.count(A) == 2
    load.remove(first.key)
    load.remove(first.key)
    assert load.count(A) == 1
    load.remove(second.key)
    assert load.snapshot() == {} and load.total == 0


def test_the_response_starting_ends_the_predicted_prefill_but_not_the_count() -> None:
    """The response began: the request stops counting as prefill work, still counts in flight."""
    load = LoadView(Clock())
    held = lease(tokens=800, until=110.0)
    load.add(held)
    assert load.pending_prefill(A) == (800, 1)
    load.prefill_over(held.key)
    assert load.pending_prefill(A) == (0, 0) and load.count(A) == 1
    load.remove(held.key)
    load.prefill_over(held.key)  # after removal: harmless
    assert load.count(A) == 0


def test_leases_of_different_owners_with_the_same_number_are_different_leases() -> None:
    """A peer's lease numbered like ours counts beside ours (what peer sync will add)."""
    load = LoadView()
    ours, theirs = Lease("me", 1, A), Lease("peer", 1, A)
    load.add(ours)
    load.add(theirs)
    assert load.count(A) == 2
    load.remove(theirs.key)
    assert load.count(A) == 1 and ours.key in load
