"""One KV-event subscriber per (pod, DP rank), following the endpoints as they come and go.

Whoever watches the pool (the catalog) says which sources exist and where they publish; ``sync``
makes the running subscribers match. A source that leaves, or whose publisher moved, is reset in
the sink *after* its old subscriber has stopped, so the sink never sees a batch for a source it
was told to forget (one writer per source, even across a change).

vLLM offsets both the PUB and the replay port by the DP rank (vllm-kv-events.md §1.2):
``rank_targets`` applies that, so a pod serving ``--data-parallel-size 4`` with
``tcp://*:5557`` is followed on 5557-5560.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zmq
import zmq.asyncio

from extproc.kvindex.events import Source
from extproc.kvindex.subscriber import (
    KVEventSink,
    KVEventSubscriber,
    SubscriberOptions,
    SubscriberStats,
)
from extproc.types import EndpointAddress

log = logging.getLogger(__name__)

_MAX_PORT = 65_535


@dataclass(frozen=True, slots=True)
class SubscriptionTarget:
    """Where one source publishes: ``tcp://host:port`` addresses the router connects to."""

    pub_address: str
    #: vLLM's ``replay_endpoint`` (offset like the PUB port); None when the engine has none.
    replay_address: str | None = None
    #: SUB prefix filter; b"" takes everything on that socket.
    topic: bytes = b""


def rank_targets(
    endpoint: EndpointAddress,
    *,
    pub_port: int,
    replay_port: int | None,
    dp_size: int,
    topic: bytes = b"",
) -> dict[Source, SubscriptionTarget]:
    """Targets for every DP rank of the pod serving HTTP on ``endpoint`` (``ip:port`` or ``[v6]:port``).

    Rank r publishes on ``pub_port + r`` and replays on ``replay_port + r``, as vLLM offsets them.
    The host is taken from ``endpoint``, so events and requests name the same pod.
    """
    host, sep, _ = endpoint.rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint must be host:port, got {endpoint!r}")
    if dp_size < 1:
        raise ValueError(f"dp_size must be at least 1, got {dp_size}")
    for name, port in (("pub_port", pub_port), ("replay_port", replay_port)):
        if port is not None and not 1 <= port <= _MAX_PORT - (dp_size - 1):
            raise ValueError(f"{name} {port} with dp_size {dp_size} leaves the port range")
    return {
        Source(endpoint, rank): SubscriptionTarget(
            pub_address=f"tcp://{host}:{pub_port + rank}",
            replay_address=None if replay_port is None else f"tcp://{host}:{replay_port + rank}",
            topic=topic,
        )
        for rank in range(dp_size)
    }


class KVSubscriptions:
    """The running subscribers, one per source; ``sync`` to the wanted set, ``close`` when done."""

    def __init__(
        self,
        sink: KVEventSink,
        *,
        options: SubscriberOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._sink = sink
        self._options = options
        self._clock = clock
        #: Our own context (made with the first subscriber) unless one is given: libzmq's default
        #: cap of 1,023 sockets a context (each subscriber holds 2-3: SUB, its monitor, a replay
        #: DEALER) stopped a pool of ~400 endpoints from subscribing at all ("Too many open files").
        self._ctx = context
        self._own_ctx: zmq.asyncio.Context | None = None
        self._running: dict[Source, tuple[SubscriptionTarget, KVEventSubscriber]] = {}
        self._lock = asyncio.Lock()  # syncs run one at a time, so a source never has two writers
        self._closed = False

    async def sync(self, targets: Mapping[Source, SubscriptionTarget]) -> None:
        """Start subscribers for new sources, stop (and reset) gone ones, restart changed ones."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("subscriptions closed")
            gone = {s: "endpoint removed" for s in self._running if s not in targets}
            moved = {
                s: f"subscription target changed to {t.pub_address}"
                for s, t in targets.items()
                if s in self._running and self._running[s][0] != t
            }
            await self._stop({**gone, **moved})
            started = 0
            for source, target in targets.items():
                if source not in self._running:
                    started += self._start(source, target)
            if gone or moved or started:
                log.info(
                    "kv subscriptions synced sources=%d started=%d removed=%d changed=%d",
                    len(self._running), started, len(gone), len(moved),
                )  # fmt: skip

    async def close(self) -> None:
        """Stop every subscriber (no reset: the sink is going away too). Idempotent."""
        async with self._lock:
            self._closed = True
            running, self._running = self._running, {}
            await asyncio.gather(*(sub.close() for _, sub in running.values()))
            if self._own_ctx is not None:
                self._own_ctx.destroy(linger=0)
                self._ctx = self._own_ctx = None

    def resync(self, endpoint: str, reason: str) -> list[Source]:
        """Forget what ``endpoint``'s sources published: the sink is reset now, and each subscriber
        starts over (replay from seq 0) at its next message. For an engine that is gone: its blocks
        must stop steering traffic at once, and a new incarnation must not be spliced onto it."""
        sources = [source for source in self._running if source.endpoint == endpoint]
        for source in sources:
            self._running[source][1].request_resync(reason)
            try:
                self._sink.on_reset(source, reason)
            except Exception:
                log.exception("kv sink failed method=on_reset source=%s", source)
        return sources

    def stats(self) -> dict[Source, SubscriberStats]:
        """Each running subscriber's snapshot."""
        return {source: sub.stats() for source, (_, sub) in self._running.items()}

    def targets(self) -> dict[Source, SubscriptionTarget]:
        """What is being followed now."""
        return {source: target for source, (target, _) in self._running.items()}

    def _start(self, source: Source, target: SubscriptionTarget) -> bool:
        """Start one subscriber; a bad address is logged and retried on the next ``sync``."""
        if self._ctx is None:
            self._ctx = self._own_ctx = _large_context()
        sub = KVEventSubscriber(
            source=source,
            pub_address=target.pub_address,
            replay_address=target.replay_address,
            topic=target.topic,
            sink=self._sink,
            options=self._options,
            clock=self._clock,
            context=self._ctx,
        )
        try:
            sub.start()
        except zmq.ZMQError as exc:
            log.error(
                "kv subscription not started source=%s pub=%s error=%s", source, target.pub_address, exc
            )
            return False
        self._running[source] = (target, sub)
        return True

    async def _stop(self, reasons: Mapping[Source, str]) -> None:
        """Close these sources' subscribers, then reset each in the sink (failures logged, not raised)."""
        subs = [self._running.pop(source)[1] for source in reasons]
        await asyncio.gather(*(sub.close() for sub in subs))
        for source, reason in reasons.items():
            log.info("kv subscription stopped source=%s reason=%r", source, reason)
            try:
                self._sink.on_reset(source, reason)
            except Exception:
                log.exception("kv sink failed method=on_reset source=%s", source)


#: Sockets one context may hold: subscribers for a fleet of thousands of endpoints (each socket
#: also needs a file descriptor or two, within the process's limit).
MAX_SOCKETS = 65_536


def _large_context() -> zmq.asyncio.Context:
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return context
