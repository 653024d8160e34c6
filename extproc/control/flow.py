"""Flow control: requests that find their pool saturated wait here, by priority and fairly.

When every candidate endpoint of a request's pool is saturated (the scheduler raises
:class:`~extproc.errors.Saturated`; the profile's ``queue_limit`` and ``kv_cache_limit`` say when),
request control hands the request to :class:`FlowControl` instead of answering 429 at once. It is
held, its body unanswered, until an endpoint has room, and then decided afresh against the catalog
of that moment.

* **Pools**: one queue per set of worker sets a route leads to; ``max_queue`` requests wait in each
  at most.
* **Order**: strictly by priority (an InferenceObjective's ``spec.priority``; 0 without one).
  Within a priority, fair across fairness IDs by tokens: start-time fair queuing, where each
  request's tag is ``max(V, F)`` with ``V`` the tag of the last request dispatched and ``F`` the
  sum of its flow's earlier costs; the lowest tag goes first. A request costs its prompt tokens
  (estimated from the body's size when not tokenized) plus its ``max_tokens`` (else
  :data:`TYPICAL_OUTPUT_TOKENS`). A tenant sending ten times its share queues behind its own
  requests; a light tenant's next request starts at ``V`` and goes ahead of them.
* **Dispatch**: when a lease ends (a seat may have freed), a scrape arrives, or the catalog
  changes: the next request is decided; a pool stops at its first request that is still saturated
  (its order is the order, not whatever happens to fit).
* **Shedding**, always a 429 with ``Retry-After``: a negative priority at once (sheddable, never
  queued); a request that waited ``queue_timeout`` seconds; the lowest-priority newest request when
  a full queue takes a higher-priority one; a new request a full queue cannot take.
* **Nothing is lost**: every held request ends in exactly one of dispatched, shed or cancelled (its
  client left: the stream's task is cancelled and the request leaves the queue at once).

Memory is bounded by ``max_queue`` per pool: a flow's state lives only while it has requests
waiting or a tag ahead of ``V``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.errors import Overloaded, RequestError, Saturated
from extproc.settings import FlowSettings

#: The fairness ID of requests that carry none: they share one flow.
DEFAULT_FAIRNESS_ID = "default"
#: Output tokens a request without ``max_tokens`` is charged for fairness.
TYPICAL_OUTPUT_TOKENS = 256
#: Body bytes per prompt token, to estimate a prompt that was not tokenized.
BYTES_PER_TOKEN = 4
#: Fairness IDs with a label of their own in the served-tokens metric; the rest count as ``other``.
MAX_FAIRNESS_LABELS = 64
#: Fairness IDs are clipped to this many characters (a client may send a megabyte).
MAX_FAIRNESS_ID = 128

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RequestClass:
    """How a request is treated when its pool is saturated (from its headers)."""

    #: The InferenceObjective the request names (None: none; priority 0).
    objective: str | None = None
    fairness_id: str = DEFAULT_FAIRNESS_ID


class FlowMetrics:
    """Queue lengths, waits, outcomes and served tokens (fairness IDs bounded)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queued = Gauge(
            "extproc_flow_queue_length",
            "Requests waiting for room in a saturated pool, by priority.",
            ["priority"],
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "extproc_flow_wait_seconds",
            "How long held requests waited, by outcome: dispatched, timeout, displaced, cancelled, failed.",
            ["outcome"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )
        self.outcomes = Counter(
            "extproc_flow_requests",
            "Requests flow control saw, by outcome: queued; dispatched (routed after waiting); shed as "
            "sheddable (negative priority), queue_full, timeout or displaced (429); cancelled (the client "
            "left while waiting); failed (an error other than saturation when its turn came).",
            ["outcome"],
            registry=registry,
        )
        self.served_tokens = Counter(
            "extproc_flow_served_tokens",
            "Tokens (prompt + max_tokens, estimated) of requests dispatched after waiting, by fairness ID "
            f"(the first {MAX_FAIRNESS_LABELS} IDs seen; the rest as 'other').",
            ["fairness_id"],
            registry=registry,
        )
        self._labelled: set[str] = set()

    def served(self, fairness_id: str, tokens: int) -> None:
        if fairness_id not in self._labelled:
            if len(self._labelled) >= MAX_FAIRNESS_LABELS:
                fairness_id = "other"
            else:
                self._labelled.add(fairness_id)
        self.served_tokens.labels(fairness_id).inc(tokens)


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One held request: its place in the order and the future its stream awaits."""

    #: Decide and lease now; raises Saturated while there is no room.
    attempt: Callable[[], T]
    priority: int
    flow: str
    cost: int
    seq: int
    queued_at: float
    future: asyncio.Future[T]
    #: Its start tag in its band (set when queued).
    tag: float = 0.0
    timer: asyncio.TimerHandle | None = None


class _Band(Generic[T]):
    """One priority's requests: per flow first come first served, across flows by start tag."""

    __slots__ = ("finish", "flows", "virtual")

    def __init__(self) -> None:
        self.flows: dict[str, deque[Waiter[T]]] = {}
        #: Per flow: the tag after its last request (its next request starts no earlier).
        self.finish: dict[str, float] = {}
        #: The tag of the last request dispatched.
        self.virtual = 0.0

    def push(self, waiter: Waiter[T]) -> None:
        waiter.tag = max(self.virtual, self.finish.get(waiter.flow, 0.0))
        self.finish[waiter.flow] = waiter.tag + waiter.cost
        self.flows.setdefault(waiter.flow, deque()).append(waiter)

    def head(self) -> Waiter[T] | None:
        best: Waiter[T] | None = None
        for queue in self.flows.values():
            first = queue[0]
            if best is None or (first.tag, first.seq) < (best.tag, best.seq):
                best = first
        return best

    def newest(self) -> Waiter[T] | None:
        return max((q[-1] for q in self.flows.values()), key=lambda w: w.seq, default=None)

    def remove(self, waiter: Waiter[T], *, dispatched: bool) -> None:
        queue = self.flows.get(waiter.flow)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return
        if not queue:
            del self.flows[waiter.flow]
        if dispatched:
            self.virtual = max(self.virtual, waiter.tag)
            # Flows that are idle and no longer ahead of V start at V anyway: forget them.
            for flow in [f for f, end in self.finish.items() if end <= self.virtual and f not in self.flows]:
                del self.finish[flow]
        elif waiter.flow not in self.flows:
            self.finish.pop(waiter.flow, None)

    def __len__(self) -> int:
        return sum(len(q) for q in self.flows.values())


class PoolQueue(Generic[T]):
    """The held requests of one pool, by priority band."""

    def __init__(self) -> None:
        self.bands: dict[int, _Band[T]] = {}
        self.size = 0

    def push(self, waiter: Waiter[T]) -> None:
        self.bands.setdefault(waiter.priority, _Band()).push(waiter)
        self.size += 1

    def head(self) -> Waiter[T] | None:
        """The next request to dispatch: the highest priority's lowest tag."""
        for priority in sorted(self.bands, reverse=True):
            waiter = self.bands[priority].head()
            if waiter is not None:
                return waiter
        return None

    def lowest_newest(self) -> Waiter[T] | None:
        """Who a full queue pushes out first: the lowest priority's newest request."""
        for priority in sorted(self.bands):
            waiter = self.bands[priority].newest()
            if waiter is not None:
                return waiter
        return None

    def remove(self, waiter: Waiter[T], *, dispatched: bool = False) -> bool:
        band = self.bands.get(waiter.priority)
        if band is None or waiter not in band.flows.get(waiter.flow, ()):
            return False
        band.remove(waiter, dispatched=dispatched)
        self.size -= 1
        if not band.flows:
            # No backlog at this priority: fair queuing starts over (an idle flow earns no credit).
            del self.bands[waiter.priority]
        return True


class FlowControl(Generic[T]):
    """Every pool's queue in this replica; see the module docstring.

    ``T`` is what a dispatched request gets (request control's routed request). ``on_lost`` is
    told of one that was dispatched but whose client had already gone, so its lease is given back.
    """

    def __init__(
        self,
        settings: FlowSettings,
        metrics: FlowMetrics | None = None,
        *,
        on_lost: Callable[[T], None] = lambda _routed: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._on_lost = on_lost
        self._clock = clock
        self._pools: dict[Hashable, PoolQueue[T]] = {}
        self._seq = itertools.count()
        self._wake_scheduled = False

    @property
    def enabled(self) -> bool:
        return self.settings.max_queue > 0

    def busy(self, pool: Hashable) -> bool:
        """Requests are waiting in ``pool``: a newcomer queues behind them rather than take a seat
        that freed a moment before their dispatch runs."""
        queue = self._pools.get(pool)
        return queue is not None and queue.size > 0

    def waiting(self) -> int:
        """Requests held now, all pools."""
        return sum(q.size for q in self._pools.values())

    def debug_state(self) -> dict[str, Any]:
        """For ``/debug/state``: the settings, and per pool the requests waiting by priority."""
        return {
            "maxQueue": self.settings.max_queue,
            "queueTimeout": self.settings.queue_timeout,
            "waiting": {
                ",".join(map(str, pool)) if isinstance(pool, tuple) else str(pool): {
                    str(priority): len(band) for priority, band in sorted(queue.bands.items(), reverse=True)
                }
                for pool, queue in self._pools.items()
                if queue.size
            },
        }

    def refuse(self, saturated: Saturated, priority: int) -> Overloaded:
        """The 429 for a request that is not queued: sheddable, or queueing is off."""
        if priority < 0 and self.enabled:
            self._count("sheddable")
            return Overloaded(
                f"{saturated.message} (priority {priority} is sheddable: never queued)",
                retry_after=self.settings.retry_after,
                code="sheddable",
            )
        # Without a queue, room comes back when some request ends: soon, on the scale of a second.
        return Overloaded(saturated.message, retry_after=1, code="saturated")

    async def hold(
        self, pool: Hashable, attempt: Callable[[], T], *, priority: int, flow: str, cost: int, why: str
    ) -> T:
        """Wait in ``pool``'s queue until ``attempt`` succeeds; raises Overloaded (429) when shed.

        ``why`` is the saturation message, repeated in the 429s.
        """
        loop = asyncio.get_running_loop()
        queue = self._pools.get(pool)
        if queue is None:
            queue = self._pools[pool] = PoolQueue()
        future: asyncio.Future[T] = loop.create_future()
        waiter = Waiter(attempt, priority, flow, cost, next(self._seq), self._clock(), future)
        if queue.size >= self.settings.max_queue:
            victim = queue.lowest_newest()
            if victim is None or victim.priority >= priority:
                self._count("queue_full")
                raise Overloaded(
                    f"{why}; the queue of {self.settings.max_queue} waiting requests is full",
                    retry_after=self.settings.retry_after,
                    code="queue_full",
                )
            self._shed(queue, victim, "displaced", f"{why}; pushed out of the full queue by higher priority")
        queue.push(waiter)
        self._count("queued")
        self._gauge(priority, 1)
        self.wake()  # there may be room already (a newcomer behind waiters is queued unasked)
        waiter.timer = loop.call_later(
            self.settings.queue_timeout,
            self._shed,
            queue,
            waiter,
            "timeout",
            f"{why}; no room within the {self.settings.queue_timeout:g} s queue timeout",
        )
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                # Dispatched as its client left: nobody will answer it, so its lease goes back.
                self._on_lost(waiter.future.result())
            elif self._leave(queue, waiter):
                self._finish(waiter, "cancelled")
            raise
        finally:
            self._forget(pool, queue)

    def wake(self) -> None:
        """Room may have appeared (a lease ended, a scrape, a new catalog): dispatch soon, once."""
        if self._wake_scheduled or not self._pools:
            return
        self._wake_scheduled = True
        asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._wake_scheduled = False
        for queue in list(self._pools.values()):
            while (waiter := queue.head()) is not None:
                if waiter.future.done():  # cancelled: its task removes it; do not wait on it
                    self._leave(queue, waiter)
                    continue
                try:
                    routed = waiter.attempt()
                except Saturated:
                    break
                except RequestError as error:
                    # The model went away, its endpoints too, ...: answered as without waiting.
                    self._leave(queue, waiter)
                    self._finish(waiter, "failed")
                    waiter.future.set_exception(error)
                    continue
                self._leave(queue, waiter, dispatched=True)
                self._finish(waiter, "dispatched")
                if self._metrics is not None:
                    self._metrics.served(waiter.flow, waiter.cost)
                waiter.future.set_result(routed)

    def _shed(self, queue: PoolQueue[T], waiter: Waiter[T], outcome: str, message: str) -> None:
        if not self._leave(queue, waiter) or waiter.future.done():
            return
        self._finish(waiter, outcome)
        waiter.future.set_exception(Overloaded(message, retry_after=self.settings.retry_after, code=outcome))

    def _leave(self, queue: PoolQueue[T], waiter: Waiter[T], *, dispatched: bool = False) -> bool:
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None
        if not queue.remove(waiter, dispatched=dispatched):
            return False
        self._gauge(waiter.priority, -1)
        return True

    def _forget(self, pool: Hashable, queue: PoolQueue[T]) -> None:
        if queue.size == 0 and self._pools.get(pool) is queue:
            del self._pools[pool]

    def _finish(self, waiter: Waiter[T], outcome: str) -> None:
        self._count(outcome)
        if self._metrics is not None:
            self._metrics.wait_seconds.labels(outcome).observe(self._clock() - waiter.queued_at)

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.outcomes.labels(outcome).inc()

    def _gauge(self, priority: int, change: int) -> None:
        if self._metrics is not None:
            self._metrics.queued.labels(str(priority)).inc(change)
