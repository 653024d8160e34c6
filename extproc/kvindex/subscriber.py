"""One engine DP rank's KV-event stream over ZMQ, handed to a sink in order, each batch once.

vLLM publishes ``[topic, seq8, payload]`` on a PUB socket, one message per engine step with
events, seq counting from 0 per engine incarnation (vllm-kv-events.md §1.2), and optionally keeps
the last ``buffer_steps`` batches for a ROUTER replay socket (§1.7). PUB drops whatever a
subscriber was not connected for (slow joiner, reconnects, high-water mark), so the index can only
be trusted if someone checks the seqs and repairs holes. That is this module; it never decodes a
payload (the sink does, through ``extproc.kvindex.decode``).

One asyncio task per subscriber is the single writer of its state and its sink calls. What a batch
means (first, next, gap, duplicate, restart) and how replays merge in are decided by
:class:`~extproc.kvindex.stream_position.StreamPosition`; this module does the I/O around it:

- **Bad messages**: not 3 frames or a seq that is not 8 bytes is counted malformed and skipped; a
  payload over ``max_payload_bytes`` is counted, skipped, and its seq reported lost. A frame over
  ``2 * max_payload_bytes`` is never allocated: libzmq drops the connection (ZMQ_MAXMSGSIZE) and,
  as after any protocol error, does not dial again by itself, so we redial when no reconnect
  attempt shows up on the socket monitor within ``reconnect_interval_max``; the hole is a gap.
- The source is complete (``on_completeness(True)``) once synchronised from seq 0 with nothing
  lost, and incomplete from the first loss until the next reset.
- After a reconnect with replay, the replay socket is asked at once whether the engine restarted
  (an idle restarted engine publishes nothing), and a restarted one is joined from its buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final, Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from extproc.kvindex.events import Source
from extproc.kvindex.stream_position import NO_REPLAY, Arrival, Batch, StreamPosition, lost_reason
from extproc.telemetry import LogLimiter

log = logging.getLogger(__name__)

#: vLLM's end-of-replay marker: -1 as a signed 8-byte big-endian integer.
END_SEQ: Final = b"\xff" * 8
#: libzmq refuses (and disconnects on) frames above this multiple of ``max_payload_bytes``.
_HARD_LIMIT_FACTOR: Final = 2
#: Signs that libzmq is (re)dialing by itself; after a disconnect, their absence means it gave up.
_DIALING_EVENTS: Final = (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECTED)
_MONITOR_EVENTS: Final = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | sum(_DIALING_EVENTS)
#: After joining from the replay buffer alone, the last this many replayed batches may still arrive
#: live (published while we asked): they are recognised as copies, not taken for a restart.
_LIVE_DUPLICATES: Final = 64


class KVEventSink(Protocol):
    """Where a subscriber hands its stream; called from the subscriber's task only, never concurrently
    for one source. Methods must not block: they run on the event loop."""

    def on_batch(self, source: Source, seq: int, payload: bytes) -> None:
        """One raw batch payload; seqs arrive increasing, each at most once per incarnation."""

    def on_reset(self, source: Source, reason: str) -> None:
        """Forget everything known for ``source`` (publisher restarted, endpoint removed)."""

    def on_completeness(self, source: Source, complete: bool, reason: str) -> None:
        """Whether what was delivered since the last reset is the publisher's whole history."""


@dataclass(frozen=True, slots=True)
class SubscriberOptions:
    """How a subscriber talks to a publisher; times in seconds."""

    #: Larger payloads are counted and skipped (their seq is reported lost). Default 4 MiB: real
    #: batches stay under 1 MiB, and a 16 MiB one would stall the event loop ~0.8 s (bench/kvindex.py).
    max_payload_bytes: int = 4 * 1024 * 1024
    #: ZMQ reconnect backoff: first retry after this long, doubling up to ``reconnect_interval_max``.
    reconnect_interval: float = 0.1
    reconnect_interval_max: float = 5.0
    #: Longest wait for the next replay reply before the replay counts as failed.
    replay_timeout: float = 2.0
    #: Longest a whole replay may take (a 10 000-batch buffer takes a while).
    replay_limit: float = 30.0
    #: Messages the SUB queues while a replay runs (vLLM's PUB high-water mark is 100 000).
    receive_hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.max_payload_bytes < 1:
            raise ValueError(f"max_payload_bytes must be at least 1, got {self.max_payload_bytes}")
        if not 0 < self.reconnect_interval <= self.reconnect_interval_max:
            raise ValueError("reconnect_interval must be > 0 and <= reconnect_interval_max")
        if not 0 < self.replay_timeout <= self.replay_limit:
            raise ValueError("replay_timeout must be > 0 and <= replay_limit")
        if self.receive_hwm < 0:
            raise ValueError(f"receive_hwm must be 0 (unlimited) or more, got {self.receive_hwm}")


@dataclass(slots=True)
class SubscriberCounters:
    """Totals since ``start``; ``stats()`` hands out a copy."""

    received: int = 0
    delivered: int = 0
    #: Live messages the replay had already delivered (replay can run ahead of the SUB queue).
    duplicates: int = 0
    malformed: int = 0
    oversized: int = 0
    gaps: int = 0
    #: Batches known to be missing (holes replay could not fill, skipped oversized payloads).
    lost: int = 0
    replays_ok: int = 0
    #: The end marker came, but history was missing.
    replays_partial: int = 0
    #: Timed out or failed before the end marker.
    replays_failed: int = 0
    restarts: int = 0
    sink_errors: int = 0
    internal_errors: int = 0
    #: ZMTP sessions established / lost (from the socket monitor).
    connections: int = 0
    disconnects: int = 0
    #: Sessions libzmq gave up on (protocol errors) and we dialed again.
    redials: int = 0
    #: Reconnects after which the replay socket was asked whether the engine restarted.
    reconnect_checks: int = 0


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    """A snapshot for metrics and the debug endpoint."""

    source: Source
    running: bool
    #: The SUB has a live ZMTP session with the publisher.
    connected: bool
    #: Last seq handed on (delivered or skipped), None before the first and after a reset.
    last_seq: int | None
    #: None until synchronised; False from the first loss until the next reset.
    complete: bool | None
    reason: str
    #: ``clock()`` of the last message from the PUB socket, for staleness.
    last_message_at: float | None
    counters: SubscriberCounters


class KVEventSubscriber:
    """Follows one publisher (one engine DP rank) and hands its batches to ``sink``."""

    def __init__(
        self,
        *,
        source: Source,
        pub_address: str,
        sink: KVEventSink,
        replay_address: str | None = None,
        topic: bytes = b"",
        options: SubscriberOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """``pub_address``/``replay_address`` are ``tcp://host:port`` (we connect, never bind)."""
        self.source, self.pub_address, self.topic = source, pub_address, topic
        self.replay_address = replay_address
        self._sink, self._clock = sink, clock
        self._opts = options or SubscriberOptions()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._counts = SubscriberCounters()
        self._position = StreamPosition()
        self._redial_at: float | None = None  # loop time to dial again unless libzmq does
        self._complete: bool | None = None
        self._reason = "not synchronised yet"
        self._connected = False
        self._last_message_at: float | None = None
        self._logged: set[str] = set()
        #: Set by :meth:`request_resync`; the task resets before its next message.
        self._resync: str | None = None
        #: Resets and losses repeat as fast as a broken publisher sends: one line per kind a minute.
        self._log_limiter: LogLimiter[str] = LogLimiter(time.monotonic)

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect the SUB socket and start the task that owns this stream (needs a running loop)."""
        if self._task is not None or self._closed:
            raise RuntimeError("subscriber already started or closed")
        sub = self._socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, self._opts.receive_hwm)
            sub.setsockopt(zmq.RECONNECT_IVL, _millis(self._opts.reconnect_interval))
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, _millis(self._opts.reconnect_interval_max))
            self._monitor = sub.get_monitor_socket(_MONITOR_EVENTS)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.pub_address)
        except zmq.ZMQError:
            self._sub = sub
            self._close_sockets()
            raise
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-subscriber {self.source}")
        self._task.add_done_callback(self._task_done)
        log.info("kv subscriber started source=%s pub=%s", self.source, self.pub_address)

    async def close(self) -> None:
        """Stop the task and close the sockets (linger 0); no sink call happens after this. Idempotent."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self._close_sockets()

    async def __aenter__(self) -> KVEventSubscriber:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def stats(self) -> SubscriberStats:
        """Counters and state as of now (cheap; safe to call from any coroutine on the loop)."""
        return SubscriberStats(
            source=self.source,
            running=self._task is not None and not self._task.done(),
            connected=self._connected,
            last_seq=None if self._position.expected is None else self._position.expected - 1,
            complete=self._complete,
            reason=self._reason,
            last_message_at=self._last_message_at,
            counters=replace(self._counts),
        )

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # pod addresses may be IPv6 ("tcp://[fd00::5]:5557")
        sock.setsockopt(zmq.MAXMSGSIZE, _HARD_LIMIT_FACTOR * self._opts.max_payload_bytes)
        return sock

    def _close_sockets(self) -> None:
        sub, monitor, self._sub, self._monitor = self._sub, self._monitor, None, None
        if sub is not None and monitor is not None:
            sub.disable_monitor()
        for sock in (monitor, sub):
            if sock is not None:
                sock.close(linger=0)
        self._connected = False

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("kv subscriber task failed source=%s", self.source, exc_info=task.exception())

    # -- the stream --------------------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._sub is not None and self._monitor is not None
        sub, monitor = self._sub, self._monitor
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        while True:
            due = self._redial_at
            ready = dict(await poller.poll(None if due is None else max(0, round((due - loop.time()) * 1e3))))
            if due is not None and due == self._redial_at and loop.time() >= due:
                self._redial(sub)
            # Monitor first: a disconnect must be known before the next message.
            if monitor in ready and self._on_monitor_event(await monitor.recv_multipart()):
                self._apply_resync()
                await self._check_incarnation()
            if sub in ready:
                frames = await sub.recv_multipart()
                try:
                    await self._on_message(frames)
                except Exception as exc:  # a bug here must not end the stream
                    self._counts.internal_errors += 1
                    self._log_once(f"internal:{type(exc).__name__}", "kv subscriber error", exc)

    def _on_monitor_event(self, frames: list[bytes]) -> bool:
        """Track the connection; True when it came back after a disconnect (worth a check)."""
        event = parse_monitor_message(frames)["event"]
        if event in _DIALING_EVENTS:
            self._redial_at = None
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
            self._counts.connections += 1
            log.info("kv subscriber connected source=%s pub=%s", self.source, self.pub_address)
            return self._position.verify_next
        elif event == zmq.EVENT_DISCONNECTED:
            self._connected = False
            self._counts.disconnects += 1
            self._position.disconnected()
            self._redial_at = asyncio.get_running_loop().time() + self._opts.reconnect_interval_max
            log.info("kv subscriber disconnected source=%s pub=%s", self.source, self.pub_address)
        return False

    async def _check_incarnation(self) -> None:
        """Right after a reconnect, ask the replay socket whether this is still the same engine.

        A restarted engine that stays idle publishes nothing, so without this its old blocks would
        keep steering traffic until its first batch. The publisher still buffers the last batch we
        delivered (the anchor) unless it restarted: an empty replay, or a different anchor, is a
        restart. A failed replay tells nothing; the next live message is verified as before. After a
        restart (or a resync asked while the engine was gone), what the new incarnation already
        published is read from its replay buffer at once.
        """
        if self.replay_address is None:
            return
        position = self._position
        if position.expected is None:  # told to start over (the engine was gone): join it now
            await self._join_from_replay(self.replay_address)
            return
        ask = position.expected - 1
        self._counts.reconnect_checks += 1
        replayed, cause = await self._fetch(self.replay_address, ask)
        if cause is not None:
            return
        first = replayed[0] if replayed else None
        if first is None:
            self._reset(f"publisher restarted (its replay buffer no longer holds seq {ask})")
        elif first.seq != ask:
            return  # inconclusive: the next live message is verified as before
        elif first.digest != position.anchor:
            self._reset(f"publisher restarted (replayed seq {ask} differs from the one delivered)")
        else:
            position.verify_next = False  # the same engine: its next message needs no second check
            return
        await self._join_from_replay(self.replay_address)

    async def _join_from_replay(self, replay_address: str) -> None:
        """Take what a restarted engine already published from its replay buffer, now.

        Batches it sent before our SUB was back reached nobody (PUB drops them), and an engine that
        then idles may publish nothing for long: waiting for its next batch would leave its cache
        unknown meanwhile. Live copies of the replayed batches are recognised as duplicates.
        """
        replayed, cause = await self._fetch(replay_address, 0)
        if cause is not None or not replayed:
            return  # nothing yet (or no answer): the next live message joins as usual
        *earlier, last = replayed
        lost = self._merge(0, last, earlier, cause, joining=True)
        self._count_replay(0, cause, lost)
        self._position.remember_ahead(replayed[-_LIVE_DUPLICATES:])
        if self._complete is None:
            self._set_complete(True, "in sync from seq 0")

    def _redial(self, sub: zmq.asyncio.Socket) -> None:
        """Dial again: after a protocol error (a frame over ZMQ_MAXMSGSIZE, a bad handshake) libzmq
        ends the session for good instead of reconnecting, which would silence the stream forever."""
        self._redial_at = None
        self._counts.redials += 1
        log.warning("kv subscriber redialing source=%s pub=%s", self.source, self.pub_address)
        with contextlib.suppress(zmq.ZMQError):
            sub.disconnect(self.pub_address)
        sub.connect(self.pub_address)

    def request_resync(self, reason: str) -> None:
        """Start over from seq 0 at the next message (the stream's own task does it, in order)."""
        self._resync = reason

    def _apply_resync(self) -> None:
        if self._resync is not None:
            # The sink was reset when the resync was asked for; only our position is left to drop.
            reason, self._resync = self._resync, None
            self._start_over(reason)

    async def _on_message(self, frames: list[bytes]) -> None:
        self._apply_resync()
        self._counts.received += 1
        self._last_message_at = self._clock()
        if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == END_SEQ:
            self._malformed("live", frames)
            return
        batch = self._batch(frames[1], frames[2])
        expected = self._position.expected
        arrival = self._position.arrive(batch, can_verify=self.replay_address is not None)
        if arrival is Arrival.NEXT:
            self._hand_over(batch)
            return
        if arrival is Arrival.DUPLICATE:
            self._counts.duplicates += 1
            return
        if arrival is Arrival.RESTARTED:
            assert expected is not None  # only a synchronised stream can go backwards
            self._reset(f"publisher restarted (seq {batch.seq} after {expected - 1})")
        elif arrival is Arrival.GAP:
            self._counts.gaps += 1
        await self._recover(batch)

    async def _recover(self, trigger: Batch) -> None:
        """Deliver everything up to ``trigger``: on joining (from seq 0), after a gap or a reconnect."""
        expected = self._position.expected
        joining = expected is None
        start = 0 if expected is None else expected
        if joining and trigger.seq == 0:
            self._merge(0, trigger, [], None, joining=True)
        elif self.replay_address is None:
            self._merge(start, trigger, [], NO_REPLAY, joining=joining)
        else:
            ask = start if joining else start - 1  # one batch early: the anchor
            replayed, cause = await self._fetch(self.replay_address, ask)
            if self._position.contradicted_by(replayed[0] if replayed else None):
                self._count_replay(ask, cause, 0)
                self._reset(f"publisher restarted (replayed seq {ask} differs from the one delivered)")
                await self._recover(trigger)  # now joining: replay again, from 0
                return
            lost = self._merge(start, trigger, replayed, cause, joining=joining)
            self._count_replay(ask, cause, lost)
        if joining and self._complete is None:
            self._set_complete(True, "in sync from seq 0")

    def _merge(
        self, start: int, trigger: Batch, replayed: list[Batch], cause: str | None, *, joining: bool
    ) -> int:
        """Hand on replayed batches and the trigger in seq order from ``start``; returns batches lost."""
        lost = 0
        for step in self._position.merge(start, trigger, replayed):
            if isinstance(step, Batch):
                self._hand_over(step)
            else:
                lost += step.count
                self._lose(step.count, lost_reason(step, cause, joining=joining))
        return lost

    def _hand_over(self, batch: Batch) -> None:
        self._position.handed_on(batch)
        if batch.payload is None:
            limit = self._opts.max_payload_bytes
            self._lose(1, f"batch {batch.seq} skipped: {batch.size} bytes > max_payload_bytes {limit}")
            return
        self._counts.delivered += 1
        self._notify("on_batch", self._sink.on_batch, self.source, batch.seq, batch.payload)

    def _reset(self, reason: str) -> None:
        self._counts.restarts += 1
        if self._log_limiter.allow("reset", ""):
            log.warning("kv source reset source=%s reason=%r", self.source, reason)
        self._start_over(reason)
        self._notify("on_reset", self._sink.on_reset, self.source, reason)

    def _start_over(self, reason: str) -> None:
        """Forget the stream's position: the next message is handled as a first one."""
        self._position.forget()
        self._complete, self._reason = None, reason

    def _lose(self, count: int, reason: str) -> None:
        self._counts.lost += count
        if self._log_limiter.allow("lost", ""):
            log.warning(
                "kv batches lost source=%s count=%d reason=%r (at most one such line a minute; "
                "totals in extproc_kv_* metrics)",
                self.source,
                count,
                reason,
            )
        self._set_complete(False, reason)

    def _set_complete(self, complete: bool, reason: str) -> None:
        self._complete, self._reason = complete, reason
        self._notify("on_completeness", self._sink.on_completeness, self.source, complete, reason)

    def _count_replay(self, start: int, cause: str | None, lost: int) -> None:
        if cause is not None:
            self._counts.replays_failed += 1
        elif lost:
            self._counts.replays_partial += 1
        else:
            self._counts.replays_ok += 1
        log.debug("kv replay done source=%s start=%d cause=%s lost=%d", self.source, start, cause, lost)

    # -- replay ------------------------------------------------------------------------------------

    async def _fetch(self, address: str, start: int) -> tuple[list[Batch], str | None]:
        """Every batch the publisher still buffers from ``start`` on, and why it stopped early (or None).

        A fresh DEALER per replay, so the replies of a replay that timed out cannot be mistaken
        for the next one's.
        """
        batches: list[Batch] = []
        dealer = self._socket(zmq.DEALER)
        try:
            dealer.connect(address)
            async with asyncio.timeout(self._opts.replay_limit):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await asyncio.wait_for(dealer.recv_multipart(), self._opts.replay_timeout)
                    # After the DEALER strips the identity: [b"", (topic,) seq8, payload].
                    if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                        self._malformed("replay", frames)
                    elif frames[-2] == END_SEQ:
                        return batches, None
                    else:
                        batches.append(self._batch(frames[-2], frames[-1]))
        except TimeoutError:
            return batches, "replay timed out"
        except zmq.ZMQError as exc:
            return batches, f"replay failed: {exc}"
        finally:
            dealer.close(linger=0)

    # -- helpers -----------------------------------------------------------------------------------

    def _batch(self, seq8: bytes, payload: bytes) -> Batch:
        seq = int.from_bytes(seq8, "big")
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        if len(payload) <= self._opts.max_payload_bytes:
            return Batch(seq, payload, len(payload), digest)
        self._counts.oversized += 1
        return Batch(seq, None, len(payload), digest)

    def _malformed(self, where: str, frames: list[bytes]) -> None:
        self._counts.malformed += 1
        sizes = [len(frame) for frame in frames[:5]]
        message = (
            f"kv message malformed source={self.source} where={where} frames={len(frames)} sizes={sizes}"
        )
        if where not in self._logged:
            self._logged.add(where)
            log.warning("%s (further ones are logged at debug)", message)
        else:
            log.debug("%s", message)

    def _notify(self, method: str, call: Callable[..., None], *args: object) -> None:
        """Call the sink; its failures are counted and logged once per kind, never fatal."""
        try:
            call(*args)
        except Exception as exc:
            self._counts.sink_errors += 1
            self._log_once(f"sink:{method}:{type(exc).__name__}", f"kv sink failed method={method}", exc)

    def _log_once(self, kind: str, message: str, exc: Exception) -> None:
        if kind in self._logged:
            log.debug("%s source=%s error=%r", message, self.source, exc)
            return
        self._logged.add(kind)
        log.error("%s source=%s (further ones are logged at debug)", message, self.source, exc_info=exc)


def _millis(seconds: float) -> int:
    return max(1, round(seconds * 1000))
