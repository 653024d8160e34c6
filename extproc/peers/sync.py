"""The transport of peer sync: one ZMQ PUB this replica binds, one SUB per configured peer.

What travels is :mod:`extproc.control.peer_messages`: this replica's lease deltas (batched per
:data:`~extproc.control.peers.DELTA_BATCH_S`) and snapshots every
:data:`~extproc.control.peers.SNAPSHOT_S`. A SUB connects out to its peer's PUB and nothing
connects in to it, so only configured peers are heard. What protects the PUB (anyone who reaches
the port may subscribe and read which endpoints hold how many requests) is the bind address and
the network: bind a pod IP, and allow the port from the router's own pods only (a NetworkPolicy);
and optionally a shared CURVE key (:mod:`extproc.peers.curve`), without which nobody can subscribe
or pass for a peer. Nothing here runs for a single replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from extproc.control.load import Lease
from extproc.control.peer_messages import PeerMessageError, encode
from extproc.control.peers import DELTA_BATCH_S, SNAPSHOT_S, LeaseFeed, PeerLeases
from extproc.peers.curve import CurveGuard, CurveKey
from extproc.peers.discovery import bracketed
from extproc.telemetry import LogLimiter

log = logging.getLogger(__name__)
#: A frame larger than this is dropped by libzmq before we see it (65,536 leases fit in ~3 MB).
MAX_FRAME_BYTES = 8 * 1024 * 1024
_BAD: LogLimiter[str] = LogLimiter(time.monotonic)


class PeerSync:
    """Publishes ``feed`` and applies what the peers publish to ``peers``; ``run()`` as a task."""

    def __init__(
        self,
        listen: str,
        feed: LeaseFeed,
        peers: PeerLeases,
        *,
        on_sent: Callable[[str, int], None] = lambda _kind, _size: None,
        curve: CurveKey | None = None,
    ) -> None:
        self.listen = listen
        self._feed = feed
        self._peers = peers
        self._on_sent = on_sent
        self._ctx = zmq.asyncio.Context()
        #: With a peer key (``--peer-key-file``): CURVE on every socket, and who may subscribe.
        self._guard = None if curve is None else CurveGuard(self._ctx, curve)
        self._pub: zmq.asyncio.Socket | None = None
        self._flush: asyncio.TimerHandle | None = None
        #: Messages sent, by kind.
        self.sent: dict[str, int] = {"snapshot": 0, "delta": 0}
        #: The SUB task of each peer followed now.
        self._following: dict[str, asyncio.Task[None]] = {}

    def bind(self) -> int:
        """Bind the PUB (before ``run``, so a bad address fails serve at start); returns the port."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.IPV6, 1)
        pub.setsockopt(zmq.SNDHWM, 10_000)
        if self._guard is not None:
            self._guard.start()
            self._guard.server(pub)
        pub.bind(f"tcp://{bracketed(self.listen)}")
        port = self.listen.rpartition(":")[2]
        self._pub = pub
        endpoint = pub.getsockopt(zmq.LAST_ENDPOINT)
        return int(endpoint.decode().rsplit(":", 1)[1]) if isinstance(endpoint, bytes) else int(port)

    @property
    def refused_subscribers(self) -> int:
        """Subscribers refused for not holding the peer key (0 without one)."""
        return 0 if self._guard is None else self._guard.refused

    def changed(self, _lease: Lease | None) -> None:
        """A lease of ours came or went: send the batch soon (once per burst)."""
        if self._flush is None and self._pub is not None:
            self._flush = asyncio.get_running_loop().call_later(DELTA_BATCH_S, self._send_delta)

    def follow(self, addresses: tuple[str, ...]) -> None:
        """Follow exactly ``addresses`` from now on (peers found in a Service come and go)."""
        self._peers.set_peers(addresses)
        for address in set(self._following) - set(addresses):
            self._following.pop(address).cancel()
        for address in addresses:
            if address not in self._following:
                self._following[address] = asyncio.create_task(self._follow(address), name=f"peer-{address}")

    async def run(self) -> None:
        if self._pub is None:
            self.bind()
        try:
            self.follow(tuple(self._peers.peers))
            await self._heartbeat()
        finally:
            for task in self._following.values():
                task.cancel()
            await asyncio.gather(*self._following.values(), return_exceptions=True)
            self._following.clear()
            if self._flush is not None:
                self._flush.cancel()
            if self._guard is not None:
                self._guard.stop()
            self._ctx.destroy(linger=0)

    async def _heartbeat(self) -> None:
        while True:
            self._send(self._feed.snapshot())
            for gone in self._peers.expire():
                log.warning("peer gone address=%s (silent; its leases no longer count)", gone)
            await asyncio.sleep(SNAPSHOT_S)

    async def _follow(self, address: str) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self._guard is not None:
            self._guard.client(sub)
        sub.connect(f"tcp://{bracketed(address)}")
        try:
            while True:
                frame = await sub.recv()
                try:
                    self._peers.receive(address, frame)
                except PeerMessageError as exc:
                    if _BAD.allow(address, "bad"):
                        log.warning("peer message refused address=%s reason=%s", address, exc)
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sub.close(linger=0)

    def _send_delta(self) -> None:
        self._flush = None
        if self._feed.pending:
            self._send(self._feed.delta())

    def _send(self, message: object) -> None:
        assert self._pub is not None
        frame = encode(message)  # type: ignore[arg-type]
        kind = type(message).__name__.lower()
        with contextlib.suppress(zmq.Again):
            self._pub.send(frame, zmq.NOBLOCK)
            self.sent[kind] += 1
            self._on_sent(kind, len(frame))
