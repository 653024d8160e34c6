"""Peer sync in ``serve``: this replica's leases to its peers, theirs into its load view.

Built only with ``--peer-listen``; a single replica runs none of it. See
:mod:`extproc.control.peers` (what is shared and how it expires) and :mod:`extproc.peers.sync`
(the ZMQ transport and what protects it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.addresses import join_host_port, parse_host_port
from extproc.control.peers import LeaseFeed, PeerLeases, SharedAccounting
from extproc.control.requests import RequestControl
from extproc.kube.client import ApiClient
from extproc.kvindex.approx import ApproxPrefixIndex
from extproc.peers.curve import CurveKey
from extproc.peers.discovery import PeerFinder, worker_ports
from extproc.peers.sync import PeerSync
from extproc.scheduling.scheduler import Decision
from extproc.tasks import cancel_and_wait
from extproc.types import EndpointAddress


class Peering:
    """Owns the peer sync of one serve: ``start()`` binds and follows, ``stop()`` ends it."""

    def __init__(
        self,
        listen: str,
        peers: tuple[str, ...],
        control: RequestControl,
        registry: CollectorRegistry,
        *,
        service: tuple[ApiClient, str] | None = None,
        approx: ApproxPrefixIndex | None = None,
        worker: int = 0,
        fanout: int = 1,
        curve: CurveKey | None = None,
    ) -> None:
        """``listen`` and ``peers`` are replicas' ``--peer-listen`` addresses; with ``fanout`` > 1
        (``--workers``) each stands for that many workers on consecutive ports, this process being
        worker ``worker`` of its own replica (it publishes on the port + ``worker``)."""
        load, owner = control.load, control.owner
        host, port = parse_host_port(listen, what="--peer-listen")
        self._replica, self._fanout = listen, fanout
        self._own = own = join_host_port(host, port + worker)
        self._configured = peers
        self._discovered: tuple[str, ...] = ()
        self.feed = LeaseFeed(owner, lambda: load.leases(owner), prefilling=load.prefilling)
        self.peers = PeerLeases(load, self._followed(), own=owner)
        # A request routed here and accounted on a peer (or the other way round) counts once.
        shared = SharedAccounting(owner, self.feed, control.handover.lent, control.release, self.peers.knows)
        self.feed.held = lambda: shared.held.keys()
        self.peers.shared = control.shared = shared
        if approx is not None:
            # Approximate affinity (models without KV events) is learned from decisions: share it.
            control.scheduler.add_hook(self._learned)
            self.peers.on_affinity = lambda chunks, endpoint: approx.record(chunks, EndpointAddress(endpoint))
        self.frame_bytes = Histogram(
            "extproc_peer_message_bytes",
            "Size of the peer-sync messages this replica sent, by kind (snapshot, delta).",
            ["kind"],
            buckets=(64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304),
            registry=registry,
        )
        self.sync = PeerSync(
            own,
            self.feed,
            self.peers,
            on_sent=lambda kind, size: self.frame_bytes.labels(kind).observe(size),
            curve=curve,
        )
        load.on_add += [self.feed.added, self.sync.changed]
        load.on_release += [self.feed.removed, self.sync.changed]
        load.on_prefill_over += [self.feed.prefill_over, self.sync.changed]
        registry.register(PeerCollector(self))
        #: Finds more peers in a Service (``--peer-service``), when given.
        self.finder = None if service is None else PeerFinder(service[0], service[1], listen, self._found)
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0

    def start(self) -> None:
        self.port = self.sync.bind()
        self._tasks.append(asyncio.create_task(self.sync.run(), name="peer-sync"))
        if self.finder is not None:
            self._tasks.append(asyncio.create_task(self.finder.run(), name="peer-finder"))

    async def stop(self) -> None:
        # The finder first: it must not start following a peer on the sync's closed sockets.
        for task in reversed(self._tasks):
            await cancel_and_wait(task)

    def _learned(self, decision: Decision) -> None:
        if decision.prefix.approx_keys:
            self.feed.affinity(decision.prefix.approx_keys, decision.pick.address)
            self.sync.changed(None)

    def add_peers(self, addresses: tuple[str, ...]) -> None:
        """Follow these beside the configured ones (peers whose ports are known only once bound)."""
        self._configured = tuple(dict.fromkeys([*self._configured, *addresses]))
        self._found(self._discovered)

    def _found(self, addresses: tuple[str, ...]) -> None:
        self._discovered = addresses
        self.sync.follow(self._followed())

    def _followed(self) -> tuple[str, ...]:
        replicas = [*self._configured, *self._discovered]
        if self._fanout > 1:
            replicas.append(self._replica)  # the other workers of this pod
        return worker_ports(replicas, self._fanout, self._own)

    def debug_state(self) -> list[dict[str, object]]:
        return self.peers.debug_state()


class PeerCollector(Collector):
    """Peers connected, messages in and out, refusals and the last sync lag, at scrape time."""

    def __init__(self, peering: Peering) -> None:
        self._peering = peering

    def collect(self) -> Iterable[Metric]:
        peers, sync = self._peering.peers, self._peering.sync
        yield GaugeMetricFamily(
            "extproc_peers_connected",
            "Configured peers heard from within the expiry (their leases count as load).",
            value=sum(peers.connected(a) for a in peers.peers),
        )
        messages = CounterMetricFamily(
            "extproc_peer_messages",
            "Peer-sync messages by direction (sent, received) and kind (snapshot, delta).",
            labels=["direction", "kind"],
        )
        for kind, count in sorted(sync.sent.items()):
            messages.add_metric(["sent", kind], count)
        for kind, count in sorted(peers.applied.items()):
            messages.add_metric(["received", kind], count)
        yield messages
        yield CounterMetricFamily(
            "extproc_peer_messages_refused",
            "Peer messages refused: undecodable, too large, or from an address that is no configured peer.",
            value=peers.refused,
        )
        yield CounterMetricFamily(
            "extproc_peer_subscribers_refused",
            "Subscribers to this replica's peer port refused for not holding the peer key (--peer-key-file).",
            value=sync.refused_subscribers,
        )
        if peers.lag_s is not None:
            yield GaugeMetricFamily(
                "extproc_peer_sync_lag_seconds",
                "How old the last peer message was when it arrived (its sender's wall clock against ours).",
                value=peers.lag_s,
            )
