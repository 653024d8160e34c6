"""One DP rank's KV-event publisher: vLLM's ``ZmqEventPublisher`` on asyncio, plus injectable faults.

What a subscriber sees is what vLLM sends (reference §1.2, §1.7): a PUB socket where every step
with events is one 3-frame message ``[topic, seq8, payload]`` (seq from 0 per incarnation), and an
optional ROUTER replay socket that resends buffered batches with ``seq >= start`` and an end marker.

Faults exist so a router's repair paths can be exercised on demand:

- a *dropped* batch consumes its seq and is kept in the replay buffer but never goes out on PUB,
  which is what a PUB high-water-mark drop looks like in vLLM (so replay can repair it);
- a *delay* holds batches in an in-order queue drained by a background task (vLLM's publisher
  thread lags the same way), never blocking the engine's step;
- :meth:`KVEventPublisher.restart` looks like an engine restart: same port, seq back to 0, empty
  replay buffer.

``publish`` is synchronous and non-blocking: PUB sends use ``NOBLOCK`` and a PUB socket drops
rather than blocks at its high-water mark, exactly like vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace

import zmq
import zmq.asyncio

from extproc.sim.kv_events import KVEvent
from extproc.sim.kv_wire import EventEncoding, HashFormat, encode_batch
from extproc.sim.settings import DEFAULT_HWM, KVEventSettings, PublisherFaults

log = logging.getLogger(__name__)

#: vLLM's ``END_SEQ``: -1 as a signed 8-byte big-endian integer.
END_SEQ = b"\xff" * 8
#: How long :meth:`KVEventPublisher.restart` keeps retrying to re-bind the old port.
_REBIND_TIMEOUT = 5.0
_REBIND_INTERVAL = 0.005


@dataclass(frozen=True, slots=True)
class _Held:
    """A batch waiting out its delay."""

    due: float
    seq: int
    payload: bytes
    drop: bool


def _rank_port(rank0_port: int, dp_rank: int) -> int:
    """Rank r binds rank 0's port + r, as vLLM does; 0 stays 0 (a free port for every rank)."""
    return rank0_port + dp_rank if rank0_port else 0


class KVEventPublisher:
    """The ZMQ side of one engine DP rank: PUB stream, ROUTER replay, faults."""

    def __init__(
        self,
        settings: KVEventSettings | None = None,
        *,
        host: str = "127.0.0.1",
        dp_rank: int = 0,
        hwm: int = DEFAULT_HWM,
        seed: int | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """Publish as rank ``dp_rank`` of ``settings`` (default: a free PUB port, no replay)."""
        settings = settings if settings is not None else KVEventSettings(port=0)
        self._host, self._dp_rank = host, dp_rank
        self._port = _rank_port(settings.port, dp_rank)
        replay_port = settings.replay_port
        self._replay_port = None if replay_port is None else _rank_port(replay_port, dp_rank)
        self._topic = settings.topic.encode()
        self._encoding = EventEncoding(settings.encoding)
        self._hash_format = HashFormat(settings.hash_format)
        self._replay_topic_frame = settings.replay_topic_frame
        self._hwm, self._buffer_steps = hwm, settings.buffer_steps
        self._faults = settings.faults
        self._rng = random.Random(seed)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._endpoint = ""
        self._replay_endpoint: str | None = None
        self._bound = False
        self._closed = False
        self._seq = itertools.count()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self._buffer_steps)
        self._held: asyncio.Queue[_Held] = asyncio.Queue()
        self._holding: _Held | None = None  # the held batch the drainer is waiting on
        self._drainer: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.published = 0
        self.dropped = 0
        self.replays_served = 0
        self.malformed_replay_requests = 0

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind PUB (and ROUTER) and start the background tasks."""
        if self._pub is not None or self._closed:
            raise RuntimeError("publisher already started or closed")
        self._pub = self._new_pub()
        self._pub.bind(f"tcp://{self._host}:{self._port}")
        self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(self._endpoint.rsplit(":", 1)[1])
        self._bound = True
        if self._replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))
            self._router.bind(f"tcp://{self._host}:{self._replay_port}")
            self._replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._spawn(self._serve_replay(self._router))
        self._drainer = self._spawn(self._drain_held())
        log.info("kv publisher started endpoint=%s replay=%s", self._endpoint, self._replay_endpoint)

    async def close(self) -> None:
        """Cancel the background tasks and close both sockets at once (linger 0). Idempotent."""
        self._closed = True
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._bound = False

    async def __aenter__(self) -> KVEventPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def restart(self) -> None:
        """Look like an engine restart: new PUB on the same port, seq 0, empty replay buffer.

        Held (delayed) batches die with the old engine. Re-binding the port can race with
        ZMQ releasing it asynchronously, so a failed bind is retried in the background; until
        then batches are sent to nobody, as a restarting engine would.
        """
        self._replace_pub()
        self._seq = itertools.count()
        self._next_seq = 0
        self._buffer.clear()
        while not self._held.empty():
            self._held.get_nowait()
        if self._drainer is not None:
            self._drainer.cancel()  # it may be sleeping on a stale batch that would hold up new ones
        self._holding = None
        self._drainer = self._spawn(self._drain_held())
        log.info("kv publisher restarted endpoint=%s", self._endpoint)

    def drop_connections(self) -> None:
        """Look like a network blip: subscribers lose their connection and dial again, while the
        engine (its seq, its replay buffer) carries on as it was."""
        self._replace_pub()
        log.info("kv publisher dropped its connections endpoint=%s", self._endpoint)

    def _replace_pub(self) -> None:
        """Close the PUB socket (every subscriber is disconnected) and bind a new one on its port."""
        if self._pub is None:
            raise RuntimeError("publisher is not running")
        with contextlib.suppress(zmq.ZMQError):
            self._pub.unbind(self._endpoint)
        self._pub.close(linger=0)
        self._pub = self._new_pub()
        self._bound = False
        if not self._try_bind(self._pub):
            self._spawn(self._rebind(self._pub))

    # -- publishing --------------------------------------------------------------------------------

    def publish(self, events: Sequence[KVEvent], ts: float) -> int | None:
        """Publish one engine step's events as one batch; returns its seq (None if no events).

        ``ts`` is the step's wall-clock ``time.time()``. Never blocks; must run on the event loop.
        """
        if not events:
            return None
        if self._pub is None:
            raise RuntimeError("publisher is not running")
        seq = next(self._seq)  # taken before encoding, as vLLM does
        self._next_seq = seq + 1
        payload = encode_batch(
            events, ts=ts, dp_rank=self._dp_rank, encoding=self._encoding, hash_format=self._hash_format
        )
        drop = self._decide_drop()
        delay = self._faults.delay_seconds
        if delay > 0 or self.pending:
            # Anything already held goes first, even when the delay was just turned off.
            self._held.put_nowait(_Held(asyncio.get_running_loop().time() + delay, seq, payload, drop))
        else:
            self._emit(seq, payload, drop)
        return seq

    def _decide_drop(self) -> bool:
        faults = self._faults
        if faults.drop_next > 0:
            self._faults = replace(faults, drop_next=faults.drop_next - 1)
            return True
        # Only draw when asked to, so probes sent before faults are set do not shift the sequence.
        return faults.drop_probability > 0 and self._rng.random() < faults.drop_probability

    def _emit(self, seq: int, payload: bytes, drop: bool) -> None:
        self._buffer.append((seq, payload))
        if drop:
            self.dropped += 1
            log.debug("kv batch dropped seq=%d endpoint=%s", seq, self._endpoint)
            return
        assert self._pub is not None
        sent = self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        # A NOBLOCK send resolves at once; PUB drops at its HWM silently rather than refusing.
        error = sent.exception() if isinstance(sent, asyncio.Future) and sent.done() else None
        if error is not None:
            self.dropped += 1
            log.debug("kv batch not sent seq=%d error=%s", seq, error)
        else:
            self.published += 1

    async def _drain_held(self) -> None:
        """Send delayed batches in order once each is due."""
        loop = asyncio.get_running_loop()
        while True:
            held = self._holding = await self._held.get()
            try:
                wait = held.due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if self._pub is not None:
                    self._emit(held.seq, held.payload, held.drop)
            finally:
                if self._holding is held:  # a restart may already have moved on
                    self._holding = None

    # -- replay ------------------------------------------------------------------------------------

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        """Answer ``[identity, b"", start_seq8]`` with every buffered batch from ``start_seq`` on."""
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.malformed_replay_requests += 1
                sizes = [len(f) for f in frames]
                log.debug("kv replay request ignored frames=%d sizes=%s", len(frames), sizes)
                continue
            identity, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # Snapshot first: live publishes may append (and evict) while we await the sends.
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            try:
                await self._send_replay(router, identity, batches)
            except zmq.ZMQError as exc:
                log.warning("kv replay failed start_seq=%d error=%s", start_seq, exc)
                continue
            self.replays_served += 1
            log.debug("kv replay served start_seq=%d batches=%d", start_seq, len(batches))

    async def _send_replay(
        self, router: zmq.asyncio.Socket, identity: bytes, batches: list[tuple[int, bytes]]
    ) -> None:
        head = [identity, b"", self._topic] if self._replay_topic_frame else [identity, b""]
        for seq, payload in batches:
            await router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        end_head = [identity, b"", b""] if self._replay_topic_frame else [identity, b""]
        await router.send_multipart([*end_head, END_SEQ, b""])

    # -- sockets -----------------------------------------------------------------------------------

    def _new_pub(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._hwm)
        return sock

    def _try_bind(self, sock: zmq.asyncio.Socket) -> bool:
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            return False
        self._bound = True
        return True

    async def _rebind(self, sock: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _REBIND_TIMEOUT
        while sock is self._pub and not self._try_bind(sock):
            if loop.time() > deadline:
                log.error("kv publisher could not re-bind endpoint=%s", self._endpoint)
                return
            await asyncio.sleep(_REBIND_INTERVAL)

    def _spawn(self, coro: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("kv publisher task failed endpoint=%s", self._endpoint, exc_info=task.exception())

    # -- state -------------------------------------------------------------------------------------

    @property
    def faults(self) -> PublisherFaults:
        """The current faults (``drop_next`` counts down as batches are dropped)."""
        return self._faults

    def set_faults(self, faults: PublisherFaults) -> None:
        """Replace the faults; applies from the next ``publish``."""
        self._faults = faults
        log.info("kv publisher faults endpoint=%s faults=%s", self._endpoint, faults)

    @property
    def endpoint(self) -> str:
        """The bound PUB endpoint, e.g. ``tcp://127.0.0.1:5557`` (empty before ``start``)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound ROUTER endpoint, or None when replay is off."""
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        """The seq the next batch will get (0 after start or restart)."""
        return self._next_seq

    @property
    def bound(self) -> bool:
        """Whether PUB is listening (False briefly after ``restart`` if the port was still held)."""
        return self._bound

    @property
    def pending(self) -> int:
        """Batches held back by ``delay_seconds`` and not yet sent."""
        return self._held.qsize() + (self._holding is not None)
