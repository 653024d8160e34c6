"""Leader election on a ``coordination.k8s.io/v1`` Lease: one reconciler replica writes status.

:func:`decide` is the whole policy, pure: given the Lease as read (or None), who we are and how
long it has stood unchanged, create it, take it over (absent holder, or unchanged for
``leaseDurationSeconds``), renew it (we hold it) or wait. :class:`LeaderElector` runs it: read,
decide, write with the read ``resourceVersion`` (a 409 means another replica won the race), every
``renew_interval`` while leading and every ``retry_interval`` otherwise (and after a failed
renewal).

Safety: another holder's lease expires when its record has not changed for the lease duration
since we first saw it, on our monotonic clock (as client-go judges it): wall clocks of different
nodes are never compared. A leader counts its renewal from before it sent it and stops calling
itself leader ``renew_deadline`` (shorter than the lease duration) later, before anyone else may
take over. Its writes are bounded by ``duration - renew_deadline`` seconds and never retried by
urllib3, so none is sent late enough to land after a takeover. On a clean stop the holder is
cleared, and the other replica takes over at its next retry instead of a lease duration later.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

log = logging.getLogger(__name__)


class LeaseConflict(Exception):
    """The Lease changed (or was created) since we read it: another replica got there first."""


class Action(enum.Enum):
    CREATE = "create"
    TAKE_OVER = "take-over"
    RENEW = "renew"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The fields of a Lease that election reads."""

    holder: str | None = None
    duration_seconds: int | None = None
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0
    resource_version: str | None = None

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> LeaseRecord:
        """Read a Lease as the API server returns it (tolerantly: a field of a wrong type is unset)."""
        spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
        assert isinstance(spec, Mapping)
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
        assert isinstance(meta, Mapping)
        holder, duration, transitions = (
            spec.get("holderIdentity"),
            spec.get("leaseDurationSeconds"),
            spec.get("leaseTransitions"),
        )
        version = meta.get("resourceVersion")
        return cls(
            holder=holder if isinstance(holder, str) and holder else None,
            duration_seconds=duration if isinstance(duration, int) and duration > 0 else None,
            acquire_time=_parse_time(spec.get("acquireTime")),
            renew_time=_parse_time(spec.get("renewTime")),
            transitions=transitions if isinstance(transitions, int) and transitions >= 0 else 0,
            resource_version=version if isinstance(version, str) else None,
        )

    def expired(self, unchanged_for: float, default_duration: float) -> bool:
        """No holder, or the record has stood unchanged (as we observed it) longer than its duration."""
        if self.holder is None or self.renew_time is None:
            return True
        duration = self.duration_seconds if self.duration_seconds is not None else default_duration
        return unchanged_for > duration


def decide(record: LeaseRecord | None, *, me: str, unchanged_for: float, duration: float) -> Action:
    """What to do with the Lease (pure); ``unchanged_for``: seconds since we first observed this
    exact record (our monotonic clock). See the module docstring."""
    if record is None:
        return Action.CREATE
    if record.holder == me:
        return Action.RENEW
    if record.expired(unchanged_for, duration):
        return Action.TAKE_OVER
    return Action.WAIT


def lease_spec(
    action: Action, record: LeaseRecord | None, *, me: str, now: datetime, duration: float
) -> dict[str, Any]:
    """The Lease ``spec`` to write for ``action`` (not WAIT)."""
    stamp = format_micro_time(now)
    seconds = max(round(duration), 1)
    if action is Action.CREATE or record is None:
        transitions, acquired = 0, stamp
    elif action is Action.TAKE_OVER:
        # Taking back a lease we held before a restart is no transition of leadership.
        changed = record.holder is not None and record.holder != me
        transitions, acquired = record.transitions + (1 if changed else 0), stamp
    else:
        prior = record.acquire_time
        transitions, acquired = record.transitions, stamp if prior is None else format_micro_time(prior)
    return {
        "holderIdentity": me,
        "leaseDurationSeconds": seconds,
        "acquireTime": acquired,
        "renewTime": stamp,
        "leaseTransitions": transitions,
    }


def released_spec(record: LeaseRecord, *, now: datetime) -> dict[str, Any]:
    """The spec that gives the lease up: no holder, so the next reader takes it over at once."""
    return {
        "leaseDurationSeconds": 1,
        "renewTime": format_micro_time(now),
        "leaseTransitions": record.transitions,
    }


def format_micro_time(moment: datetime) -> str:
    """``metav1.MicroTime``: RFC 3339 in UTC with microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


class LeaseStore(Protocol):
    """Reads and writes one Lease (blocking calls; the elector runs them in a thread)."""

    def get(self) -> dict[str, Any] | None: ...

    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Raises :class:`LeaseConflict` if it exists."""
        ...

    def replace(self, spec: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
        """Raises :class:`LeaseConflict` if ``resource_version`` is not the current one."""
        ...


class LeaderElector:
    """Keeps trying to hold the Lease; :attr:`is_leader` says whether we may write now."""

    def __init__(
        self,
        store: LeaseStore,
        *,
        identity: str,
        on_change: Callable[[bool], None] = lambda _leading: None,
        duration: float = 15.0,
        renew_interval: float = 5.0,
        retry_interval: float = 2.0,
        renew_deadline: float | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.identity = identity
        self._on_change = on_change
        self.duration = duration
        self.renew_interval = renew_interval
        self.retry_interval = retry_interval
        #: Leadership ends this long after the last successful renewal; the default (two thirds of
        #: the duration) leaves time for the old leader to stop before a new one may start.
        self.renew_deadline = renew_deadline if renew_deadline is not None else duration * 2 / 3
        self._now = now
        self._monotonic = monotonic
        self._renewed_at: float | None = None
        self._record: LeaseRecord | None = None
        #: The last record read, and when (monotonic) we first saw it as it is.
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._leading = False
        self._releasing = False
        self.last_error: str | None = None

    @property
    def write_timeout(self) -> float:
        """Seconds any write made while leading may take: one sent just before the renew deadline
        then still lands before another replica may take over."""
        return self.duration - self.renew_deadline

    @property
    def is_leader(self) -> bool:
        renewed = self._renewed_at
        return renewed is not None and self._monotonic() - renewed < self.renew_deadline

    async def step(self) -> Action:
        """One round: read, decide, write. Returns what was decided (WAIT if a write lost)."""
        # Before the read: the renewal we may write lands after this, so leadership counted from
        # here ends no later than others (who count from when they see it) may take over.
        started = self._monotonic()
        try:
            obj = await asyncio.to_thread(self._store.get)
            record = None if obj is None else LeaseRecord.from_object(obj)
            # After the read, the other way round: the holder renewed before we saw it.
            seen = self._monotonic()
            if record != self._observed:
                self._observed, self._observed_at = record, seen
            now = self._now()
            action = decide(
                record, me=self.identity, unchanged_for=seen - self._observed_at, duration=self.duration
            )
            if action is not Action.WAIT:
                spec = lease_spec(action, record, me=self.identity, now=now, duration=self.duration)
                if action is Action.CREATE:
                    written = await asyncio.to_thread(self._store.create, spec)
                else:
                    assert record is not None
                    written = await asyncio.to_thread(self._store.replace, spec, record.resource_version)
                self._record = self._observed = LeaseRecord.from_object(written)
                self._observed_at = seen
                self._renewed_at = started
                self.last_error = None
                if action is not Action.RENEW:
                    log.info("lease acquired identity=%s action=%s", self.identity, action.value)
            elif record is not None and self._leading:
                log.warning("lease taken by holder=%s identity=%s", record.holder, self.identity)
                self._renewed_at = None
        except LeaseConflict:
            if self._leading:
                # Our renewal lost to another writer: stop writing now, the next read tells why.
                self._renewed_at = None
            action = Action.WAIT
        except Exception as exc:
            action = Action.WAIT
            self._failed(exc)
        self._notify()
        return action

    async def run(self) -> None:
        """Forever: renew while leading, retry otherwise."""
        while True:
            action = await self.step()
            await asyncio.sleep(self.next_interval(action))
            self._notify()  # the renew deadline may have passed while we slept

    def next_interval(self, action: Action) -> float:
        """Seconds until the next step: a leader whose renewal failed retries soon, so one failure
        does not run out its renew deadline."""
        return self.renew_interval if self.is_leader and action is not Action.WAIT else self.retry_interval

    async def release(self) -> None:
        """Give the lease up if we hold it (one try: on a clean stop only)."""
        record, self._renewed_at = self._record, None
        self._releasing = True
        self._notify()
        if record is None or record.holder != self.identity:
            return
        try:
            spec = released_spec(record, now=self._now())
            await asyncio.to_thread(self._store.replace, spec, record.resource_version)
            log.info("lease released identity=%s", self.identity)
        except Exception as exc:
            log.warning("lease release failed identity=%s error=%s", self.identity, exc)
        self._record = None

    def _failed(self, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}"
        if error != self.last_error:
            log.warning("lease update failed identity=%s error=%s", self.identity, error)
        self.last_error = error

    def _notify(self) -> None:
        leading = self.is_leader
        if leading == self._leading:
            return
        self._leading = leading
        if not leading and not self._releasing:
            log.warning("leadership lost identity=%s", self.identity)
        self._on_change(leading)
