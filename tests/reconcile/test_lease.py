"""Leader election: the pure decision, and the elector against an in-memory Lease store."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extproc.reconcile.lease import (
    Action,
    LeaderElector,
    LeaseConflict,
    LeaseRecord,
    decide,
    lease_spec,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def record(holder: str | None, renewed: datetime | None = T0, duration: int = 15) -> LeaseRecord:
    return LeaseRecord(holder=holder, duration_seconds=duration, renew_time=renewed, transitions=3)


@pytest.mark.parametrize(
    ("lease", "unchanged_for", "expected"),
    [
        (None, 0, Action.CREATE),
        (record("me"), 5, Action.RENEW),
        (record("me"), 60, Action.RENEW),
        (record("other"), 10, Action.WAIT),
        (record("other"), 15, Action.WAIT),
        (record("other"), 16, Action.TAKE_OVER),
        (record(None), 0, Action.TAKE_OVER),
        (record("other", renewed=None), 0, Action.TAKE_OVER),
    ],
    ids=[
        "absent",
        "mine",
        "mine-even-late",
        "held",
        "held-to-the-end",
        "expired",
        "released",
        "never-renewed",
    ],
)
def test_decide(lease: LeaseRecord | None, unchanged_for: float, expected: Action) -> None:
    """Create when absent, renew our own, take over when free or unchanged too long, else wait."""
    assert decide(lease, me="me", unchanged_for=unchanged_for, duration=15) is expected


def test_take_over_counts_a_transition_and_renew_keeps_the_acquire_time() -> None:
    """leaseTransitions grows when the holder changes; a renewal keeps when we acquired it."""
    taken = lease_spec(Action.TAKE_OVER, record("other"), me="me", now=T0, duration=15)
    assert taken["holderIdentity"] == "me" and taken["leaseTransitions"] == 4
    assert taken["acquireTime"] == taken["renewTime"] == "2026-03-01T12:00:00.000000Z"
    acquired = T0 - timedelta(hours=1)
    mine = LeaseRecord(holder="me", duration_seconds=15, acquire_time=acquired, renew_time=T0, transitions=4)
    renewed = lease_spec(Action.RENEW, mine, me="me", now=T0 + timedelta(seconds=5), duration=15)
    assert renewed["acquireTime"] == "2026-03-01T11:00:00.000000Z"
    assert renewed["renewTime"] == "2026-03-01T12:00:05.000000Z"
    assert renewed["leaseTransitions"] == 4
    assert renewed["leaseDurationSeconds"] == 15


def test_lease_objects_are_read_tolerantly() -> None:
    """Fields of the wrong type read as unset rather than failing the election."""
    parsed = LeaseRecord.from_object(
        {
            "metadata": {"resourceVersion": "42"},
            "spec": {
                "holderIdentity": "",
                "leaseDurationSeconds": "15",
                "renewTime": "2026-03-01T12:00:00.123456Z",
                "leaseTransitions": -1,
            },
        }
    )
    assert parsed == LeaseRecord(
        renew_time=datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC), resource_version="42"
    )


class MemoryLeaseStore:
    """A Lease kept in memory with resourceVersion checks, like the API server's."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.version = 0
        self.fail: Exception | None = None
        self.before_write: Callable[[], object] | None = None

    def get(self) -> dict[str, Any] | None:
        if self.fail is not None:
            raise self.fail
        return copy.deepcopy(self.obj)

    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        if self.obj is not None:
            raise LeaseConflict("exists")
        return self._store(spec)

    def replace(self, spec: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
        if self.fail is not None:
            raise self.fail
        if self.before_write is not None:
            self.before_write()
        if self.obj is None or resource_version != self.obj["metadata"]["resourceVersion"]:
            raise LeaseConflict("changed")
        return self._store(spec)

    def _store(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.obj = {"metadata": {"resourceVersion": str(self.version)}, "spec": spec}
        return copy.deepcopy(self.obj)


class Clocks:
    def __init__(self) -> None:
        self.seconds = 0.0

    def now(self) -> datetime:
        return T0 + timedelta(seconds=self.seconds)

    def monotonic(self) -> float:
        return self.seconds


def elector(store: MemoryLeaseStore, clocks: Clocks, identity: str, changes: list[bool]) -> LeaderElector:
    return LeaderElector(
        store,
        identity=identity,
        on_change=changes.append,
        duration=15,
        now=clocks.now,
        monotonic=clocks.monotonic,
    )


async def test_one_leader_then_takeover_after_expiry() -> None:
    """The first replica leads; the second waits until the lease expires unrenewed, then leads."""
    store, clocks = MemoryLeaseStore(), Clocks()
    a_changes: list[bool] = []
    b_changes: list[bool] = []
    a, b = elector(store, clocks, "a", a_changes), elector(store, clocks, "b", b_changes)
    assert await a.step() is Action.CREATE
    assert await b.step() is Action.WAIT
    assert a.is_leader and not b.is_leader and a_changes == [True]
    clocks.seconds = 5
    assert await a.step() is Action.RENEW
    assert await b.step() is Action.WAIT  # b sees the renewal at once
    clocks.seconds = 12  # a stops renewing (it is gone); its lease runs until 5 + 15
    assert await b.step() is Action.WAIT
    assert a.is_leader  # within its renew deadline
    clocks.seconds = 16
    assert not a.is_leader  # 11 s without a renewal: past 2/3 of the duration, a stops writing
    clocks.seconds = 21
    assert await b.step() is Action.TAKE_OVER
    assert b.is_leader and b_changes == [True]
    assert store.obj is not None and store.obj["spec"]["leaseTransitions"] == 1
    assert await a.step() is Action.WAIT
    assert a_changes == [True, False]


async def test_failed_renewals_end_leadership_before_anyone_may_take_over() -> None:
    """A leader that cannot reach the API server stops writing within the renew deadline."""
    store, clocks = MemoryLeaseStore(), Clocks()
    changes: list[bool] = []
    a = elector(store, clocks, "a", changes)
    await a.step()
    store.fail = OSError("connection refused")
    clocks.seconds = 5
    assert await a.step() is Action.WAIT
    assert a.is_leader and a.last_error == "OSError: connection refused"
    clocks.seconds = 10.5
    await a.step()
    assert not a.is_leader and changes == [True, False]


async def test_release_lets_the_other_replica_take_over_at_once() -> None:
    """A clean stop clears the holder: no waiting for the lease to expire."""
    store, clocks = MemoryLeaseStore(), Clocks()
    a, b = elector(store, clocks, "a", []), elector(store, clocks, "b", [])
    await a.step()
    await a.release()
    assert not a.is_leader
    clocks.seconds = 1
    assert await b.step() is Action.TAKE_OVER
    assert b.is_leader


async def test_a_lost_race_is_a_wait() -> None:
    """Two replicas read the same free lease: the one whose write comes second does not lead."""
    store, clocks = MemoryLeaseStore(), Clocks()
    a = elector(store, clocks, "a", [])
    await a.step()
    await a.release()
    b_spec = lease_spec(Action.TAKE_OVER, record(None), me="b", now=T0, duration=15)
    store.before_write = lambda: store._store(b_spec)  # b writes between a's read and a's write
    assert await a.step() is Action.WAIT
    assert not a.is_leader
    store.before_write = None
    assert await a.step() is Action.WAIT
    assert not a.is_leader


class SkewedClocks(Clocks):
    """A replica whose wall clock is off by ``skew`` seconds (its monotonic clock runs true)."""

    def __init__(self, base: Clocks, skew: float) -> None:
        super().__init__()
        self.base, self.skew = base, skew

    def now(self) -> datetime:
        return self.base.now() + timedelta(seconds=self.skew)

    def monotonic(self) -> float:
        return self.base.seconds


async def test_expiry_is_judged_on_the_local_clock_not_the_holders_renew_time() -> None:
    """A replica whose wall clock runs a minute ahead does not take over a lease being renewed,
    and takes over a stale one only a lease duration after it first saw it unchanged."""
    store, clocks = MemoryLeaseStore(), Clocks()
    a = elector(store, clocks, "a", [])
    ahead = SkewedClocks(clocks, 60.0)
    b = LeaderElector(store, identity="b", duration=15, now=ahead.now, monotonic=ahead.monotonic)
    await a.step()
    for second in (1, 5, 10, 15):
        clocks.seconds = second
        if second % 5 == 0:
            assert await a.step() is Action.RENEW
        assert await b.step() is Action.WAIT
    # a stops renewing at 15; b first saw that record at 15.
    clocks.seconds = 30
    assert await b.step() is Action.WAIT
    clocks.seconds = 30.5
    assert await b.step() is Action.TAKE_OVER and b.is_leader


async def test_leadership_counts_from_before_a_slow_renewal() -> None:
    """A renewal that takes long does not extend leadership past the deadline counted from its start."""
    store, clocks = MemoryLeaseStore(), Clocks()
    a = elector(store, clocks, "a", [])
    await a.step()
    clocks.seconds = 5

    def slow() -> None:
        clocks.seconds = 12  # the write is answered 7 s after the step began

    store.before_write = slow
    assert await a.step() is Action.RENEW
    clocks.seconds = 14.9
    assert a.is_leader
    clocks.seconds = 15.1  # 5 + 2/3 of 15: not 12 + 10
    assert not a.is_leader


async def test_a_leader_retries_a_failed_renewal_soon() -> None:
    """After a failed renewal the leader tries again at the retry interval, not the renew interval."""
    store, clocks = MemoryLeaseStore(), Clocks()
    a = elector(store, clocks, "a", [])
    action = await a.step()
    assert a.next_interval(action) == a.renew_interval
    store.fail = OSError("connection refused")
    clocks.seconds = 5
    action = await a.step()
    assert a.is_leader and a.next_interval(action) == a.retry_interval
    store.fail = None
    clocks.seconds = 7
    assert await a.step() is Action.RENEW and a.is_leader


def test_writes_fit_between_the_renew_deadline_and_the_lease_duration() -> None:
    """A write sent just before the renew deadline still lands before anyone may take over."""
    a = LeaderElector(MemoryLeaseStore(), identity="a", duration=15)
    assert a.renew_deadline + a.write_timeout == a.duration
