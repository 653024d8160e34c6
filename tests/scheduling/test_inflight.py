"""In-flight accounting: counts per endpoint, and the prefill work routed there that should still run."""

from __future__ import annotations

from extproc.scheduling.inflight import InFlight
from extproc.types import EndpointAddress

A = EndpointAddress("10.0.0.1:8000")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pending_prefill_counts_until_its_predicted_end_then_decodes() -> None:
    """A request's prefill tokens count until its predicted first token, and never after release."""
    clock = Clock()
    inflight = InFlight(clock)
    long = inflight.acquire(A, prefill_tokens=8000, prefill_seconds=2.0)
    short = inflight.acquire(A, prefill_tokens=500, prefill_seconds=0.5)
    plain = inflight.acquire(A)
    assert inflight.count(A) == 3
    assert inflight.pending_prefill(A) == (8500, 2)
    clock.now += 1.0
    assert inflight.pending_prefill(A) == (8000, 1)
    long.release()
    assert inflight.pending_prefill(A) == (0, 0)
    short.release()
    plain.release()
    long.release()
    assert inflight.count(A) == 0 and inflight.pending_prefill(A) == (0, 0)


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


def test_first_token_ends_the_predicted_prefill_but_not_the_count() -> None:
    """The response began: the request stops counting as prefill work, still counts in flight."""
    clock = Clock()
    inflight = InFlight(clock)
    lease = inflight.acquire(A, prefill_tokens=800, prefill_seconds=10.0)
    assert inflight.pending_prefill(A) == (800, 1)
    lease.first_token()
    assert inflight.pending_prefill(A) == (0, 0) and inflight.count(A) == 1
    lease.release()
    lease.first_token()  # after release: harmless
    assert inflight.count(A) == 0
