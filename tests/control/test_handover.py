"""Handing a routed request's lease from its routing stream to its accounting stream."""

from __future__ import annotations

from control.test_load import A, Clock, lease
from extproc.control.handover import LeaseHandover
from extproc.control.load import Lease, LoadView


def setup() -> tuple[LoadView, LeaseHandover, Clock]:
    clock = Clock()
    load = LoadView(clock)

    def release(ended: Lease) -> None:
        load.remove(ended.key)

    return load, LeaseHandover(release, clock=clock, grace=2.0), clock


def held(load: LoadView) -> Lease:
    new = lease()
    load.add(new)
    return new


def test_a_claimed_lease_is_counted_once_and_released_by_its_claimer() -> None:
    """Claimed while the routing stream is open: the routing end leaves it alone."""
    load, handover, _ = setup()
    token = handover.offer(held(load))
    claimed = handover.claim(token)
    assert claimed is not None and load.count(A) == 1
    handover.routing_ended(token)
    assert load.count(A) == 1
    load.remove(claimed.key)
    assert load.count(A) == 0 and len(handover) == 0


def test_without_accounting_streams_the_routing_end_releases_at_once() -> None:
    """A gateway with no accounting filter: nothing waits, the count ends with the routing stream."""
    load, handover, _ = setup()
    handover.routing_ended(handover.offer(held(load)))
    assert load.count(A) == 0 and len(handover) == 0


def test_a_late_accounting_stream_still_finds_the_lease_within_the_grace() -> None:
    """Once accounting streams are seen, an unclaimed lease waits; a late claim gets it, no dip."""
    load, handover, clock = setup()
    assert handover.claim("") is None  # an accounting stream was seen
    token = handover.offer(held(load))
    handover.routing_ended(token)
    clock.now += 1.5
    assert load.count(A) == 1
    claimed = handover.claim(token)
    assert claimed is not None and load.count(A) == 1
    load.remove(claimed.key)
    assert load.count(A) == 0


def test_an_unclaimed_lease_is_released_after_the_grace_and_memory_stays_bounded() -> None:
    """No accounting stream came (it reached another replica): released once the grace is over."""
    load, handover, clock = setup()
    handover.claim("")
    tokens = [handover.offer(held(load)) for _ in range(100)]
    for token in tokens:
        handover.routing_ended(token)
    assert load.count(A) == 100
    clock.now += 2.5
    handover.offer(held(load))  # any call sweeps what expired
    assert load.count(A) == 1 and len(handover) == 1
    assert handover.claim(tokens[0]) is None  # too late: that accounting stream takes its own


def test_tokens_never_match_another_process() -> None:
    """Two pickers' tokens differ, so an accounting stream on the other replica finds nothing."""
    load = LoadView()
    first, second = LeaseHandover(lambda _: None), LeaseHandover(lambda _: None)
    token = first.offer(held(load))
    assert second.claim(token) is None
    assert first.claim(token) is not None
