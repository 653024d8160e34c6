"""Handing a routed request's lease from its routing stream to its accounting stream."""

from __future__ import annotations

from extproc.scheduling.handover import LeaseHandover
from extproc.scheduling.inflight import InFlight
from scheduling.test_inflight import A, Clock


def setup() -> tuple[InFlight, LeaseHandover, Clock]:
    clock = Clock()
    return InFlight(), LeaseHandover(clock=clock, grace=2.0), clock


def test_a_claimed_lease_is_counted_once_and_released_by_its_claimer() -> None:
    """Claimed while the routing stream is open: the routing end leaves it alone."""
    inflight, handover, _ = setup()
    token = handover.offer(inflight.acquire(A))
    lease = handover.claim(token)
    assert lease is not None and inflight.count(A) == 1
    handover.routing_ended(token)
    assert inflight.count(A) == 1
    lease.release()
    assert inflight.count(A) == 0 and len(handover) == 0


def test_without_accounting_streams_the_routing_end_releases_at_once() -> None:
    """A gateway with no accounting filter: nothing waits, the count ends with the routing stream."""
    inflight, handover, _ = setup()
    handover.routing_ended(handover.offer(inflight.acquire(A)))
    assert inflight.count(A) == 0 and len(handover) == 0


def test_a_late_accounting_stream_still_finds_the_lease_within_the_grace() -> None:
    """Once accounting streams are seen, an unclaimed lease waits; a late claim gets it, no dip."""
    inflight, handover, clock = setup()
    assert handover.claim("") is None  # an accounting stream was seen
    token = handover.offer(inflight.acquire(A))
    handover.routing_ended(token)
    clock.now += 1.5
    assert inflight.count(A) == 1
    lease = handover.claim(token)
    assert lease is not None and inflight.count(A) == 1
    lease.release()
    assert inflight.count(A) == 0


def test_an_unclaimed_lease_is_released_after_the_grace_and_memory_stays_bounded() -> None:
    """No accounting stream came (it reached another replica): released once the grace is over."""
    inflight, handover, clock = setup()
    handover.claim("")
    tokens = [handover.offer(inflight.acquire(A)) for _ in range(100)]
    for token in tokens:
        handover.routing_ended(token)
    assert inflight.count(A) == 100
    clock.now += 2.5
    handover.offer(inflight.acquire(A))  # any call sweeps what expired
    assert inflight.count(A) == 1 and len(handover) == 1
    assert handover.claim(tokens[0]) is None  # too late: that accounting stream takes its own


def test_tokens_never_match_another_process() -> None:
    """Two pickers' tokens differ, so an accounting stream on the other replica finds nothing."""
    inflight = InFlight()
    first, second = LeaseHandover(), LeaseHandover()
    token = first.offer(inflight.acquire(A))
    assert second.claim(token) is None
    assert first.claim(token) is not None
