"""Peers' leases in this replica's load view: what other ``serve`` replicas have routed and not finished.

Each replica tells its peers about its own leases (:class:`LeaseFeed`): deltas as leases come and
go, batched per few milliseconds, and a snapshot of all of them every :data:`SNAPSHOT_S` seconds,
which heals anything a delta lost and doubles as a heartbeat. Each replica applies what its peers
say (:class:`PeerLeases`) to the same :class:`~extproc.control.load.LoadView` as its own leases,
under the peer's owner id, so decisions count them as load. A peer unheard for :data:`EXPIRY_S`
seconds is dropped with its leases; a peer that restarts (a new owner id from the same address)
replaces its old state at once. Memory is bounded whatever a peer sends: at most
:data:`MAX_PEER_LEASES` leases per peer, strings and lists of bounded size, or the message is
refused and counted.

The messages and their limits are :mod:`extproc.control.peer_messages`; the transport is
:mod:`extproc.peers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from extproc.control.load import Lease, LeaseKey, LoadView
from extproc.control.peer_messages import (
    MAX_AFFINITY_KEYS,
    MAX_PEER_LEASES,
    Delta,
    Message,
    PeerMessageError,
    Snapshot,
    WireKey,
    WireLease,
    decode,
    split_token,
)
from extproc.types import EndpointAddress

#: Seconds between snapshots (and so heartbeats).
SNAPSHOT_S = 0.5
#: A peer silent this long is gone: its leases stop counting.
EXPIRY_S = 2.0
#: Seconds a delta waits to be sent with the next changes (one message per burst, not per lease).
DELTA_BATCH_S = 0.005


@dataclass(slots=True)
class Peer:
    """What one configured peer told us last."""

    address: str
    owner: str | None = None
    last_heard: float | None = None
    seq: int = -1
    #: Its leases as we count them: number -> our Lease (owner = the peer's id).
    leases: dict[int, Lease] = field(default_factory=dict)
    #: When its last message was sent (its clock), for the sync lag.
    sent_at: float | None = None


class PeerLeases:
    """Every configured peer's leases, kept in ``load`` as leases of the peer's owner id.

    ``shared``, when set, hears what peers say of this replica's (``own``) leases: adopted by
    their accounting streams, ended there, still held (snapshots), or gone with the peer.
    """

    def __init__(
        self,
        load: LoadView,
        addresses: tuple[str, ...],
        *,
        own: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        expiry_s: float = EXPIRY_S,
    ) -> None:
        self._load = load
        self._own = own
        self.shared: SharedAccounting | None = None
        #: Told of each affinity record a peer learned (approximate routing), when set.
        self.on_affinity: Callable[[Sequence[int], str], None] | None = None
        self._clock = clock
        self._wall = wall_clock
        self._expiry = expiry_s
        self.peers = {address: Peer(address) for address in addresses}
        #: Messages applied and refused, by kind; the last sync lag (seconds) seen.
        self.applied: dict[str, int] = {"snapshot": 0, "delta": 0}
        self.refused = 0
        self.lag_s: float | None = None

    def set_peers(self, addresses: tuple[str, ...]) -> None:
        """The configured peers are now ``addresses``: new ones are heard, gone ones forgotten."""
        for address in set(self.peers) - set(addresses):
            self._forget(self.peers.pop(address))
        for address in addresses:
            self.peers.setdefault(address, Peer(address))

    def receive(self, address: str, frame: bytes) -> None:
        """Apply one frame from the peer at ``address``; a bad one is counted and dropped (raises
        :class:`PeerMessageError` for the caller to log)."""
        peer = self.peers.get(address)
        if peer is None:
            self.refused += 1
            raise PeerMessageError(f"{address} is not a configured peer")
        try:
            message = decode(frame)
        except PeerMessageError:
            self.refused += 1
            raise
        if peer.owner is not None and message.owner != peer.owner:
            self._forget(peer)  # it restarted: what the old process held is gone
        peer.owner = message.owner
        peer.last_heard = self._clock()
        peer.sent_at = message.sent_at
        self.lag_s = max(0.0, self._wall() - message.sent_at)
        if isinstance(message, Snapshot):
            self._snapshot(peer, message)
        else:
            self._delta(peer, message)
        self._tell_shared(message)
        self.applied[type(message).__name__.lower()] += 1

    def knows(self, owner: str) -> bool:
        """``owner`` is a connected peer's process (its leases are ours to hold by token)."""
        return any(p.owner == owner and self.connected(p.address) for p in self.peers.values())

    def _tell_shared(self, message: Message) -> None:
        shared, own = self.shared, self._own
        if shared is None:
            return
        if isinstance(message, Snapshot):
            shared.holdings(message.owner, {n for owner, n in message.held if owner == own})
            return
        for owner, number in message.adopted:
            if owner == own:
                shared.adopted(message.owner, number)
        for owner, number in message.ended:
            if owner == own:
                shared.ended(message.owner, number)

    def expire(self) -> list[str]:
        """Drop the peers silent for longer than the expiry; returns their addresses."""
        now = self._clock()
        gone = []
        for peer in self.peers.values():
            if peer.last_heard is not None and now - peer.last_heard > self._expiry:
                self._forget(peer)
                peer.owner = peer.last_heard = None
                gone.append(peer.address)
        return gone

    def connected(self, address: str) -> bool:
        peer = self.peers[address]
        return peer.last_heard is not None and self._clock() - peer.last_heard <= self._expiry

    def debug_state(self) -> list[dict[str, object]]:
        """``/debug/state`` -> ``peers``: per configured peer, connected, and its leases per endpoint."""
        out: list[dict[str, object]] = []
        for address, peer in sorted(self.peers.items()):
            counts: dict[str, int] = {}
            for lease in peer.leases.values():
                counts[lease.endpoint] = counts.get(lease.endpoint, 0) + 1
            out.append(
                {
                    "address": address,
                    "connected": self.connected(address),
                    "owner": peer.owner,
                    "leases": dict(sorted(counts.items())),
                }
            )
        return out

    def _snapshot(self, peer: Peer, message: Snapshot) -> None:
        wanted = {lease[0]: lease for lease in message.leases}
        for number in [n for n in peer.leases if n not in wanted]:
            self._load.remove(peer.leases.pop(number).key)
        for number, wire in wanted.items():
            if number not in peer.leases:
                self._add(peer, wire)
        peer.seq = message.seq

    def _delta(self, peer: Peer, message: Delta) -> None:
        # A delta older than the state we have (reordered after a snapshot) changes nothing a
        # snapshot will not correct; apply what it says anyway: adds are idempotent, removes too.
        for number in message.removed:
            lease = peer.leases.pop(number, None)
            if lease is not None:
                self._load.remove(lease.key)
        for wire in message.added:
            if len(peer.leases) >= MAX_PEER_LEASES:
                self.refused += 1
                break
            if wire[0] not in peer.leases:
                self._add(peer, wire)
        for number in message.started:
            started = peer.leases.get(number)
            if started is not None:
                self._load.prefill_over(started.key)
        if self.on_affinity is not None:
            for chunks, endpoint in message.affinity:
                self.on_affinity(chunks, endpoint)
        peer.seq = max(peer.seq, message.seq)

    def _add(self, peer: Peer, wire: WireLease) -> None:
        number, endpoint, model, tokens, seconds = wire
        assert peer.owner is not None
        until = self._clock() + seconds if tokens > 0 and seconds > 0 else 0.0
        lease = Lease(peer.owner, number, EndpointAddress(endpoint), model, max(0, tokens), until)
        peer.leases[number] = lease
        self._load.add(lease)

    def _forget(self, peer: Peer) -> None:
        for lease in peer.leases.values():
            self._load.remove(lease.key)
        peer.leases.clear()
        peer.seq = -1
        if peer.owner is not None and self.shared is not None:
            self.shared.gone(peer.owner)


class LeaseFeed:
    """This replica's own leases as peers should hear of them: pending deltas and snapshots."""

    def __init__(
        self,
        owner: str,
        leases: Callable[[], Iterator[Lease]],
        *,
        held: Callable[[], Iterable[LeaseKey]] = tuple,
        prefilling: Callable[[LeaseKey], bool] = lambda _key: True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.owner = owner
        self._leases = leases
        #: Peers' leases our accounting streams hold now (for snapshots).
        self.held = held
        self._clock = clock
        self._wall = wall_clock
        self._seq = 0
        self._added: dict[int, Lease] = {}
        self._removed: list[int] = []
        self._adopted: list[WireKey] = []
        self._ended: list[WireKey] = []
        self._prefilling = prefilling
        self._started: list[int] = []
        self._affinity: list[tuple[list[int], str]] = []
        self._affinity_keys = 0

    @property
    def pending(self) -> bool:
        return bool(
            self._added or self._removed or self._adopted or self._ended or self._started or self._affinity
        )

    def affinity(self, chunks: Sequence[int], endpoint: str) -> None:
        """A prompt's chunks went to ``endpoint`` (approximate affinity), for peers to learn too;
        past the message's bound until the next delta, the rest waits for the next decision."""
        if chunks and self._affinity_keys + len(chunks) <= MAX_AFFINITY_KEYS:
            self._affinity.append((list(chunks), endpoint))
            self._affinity_keys += len(chunks)

    def prefill_over(self, lease: Lease) -> None:
        """One of our leases' responses began (peers stop charging its prefill)."""
        if lease.owner == self.owner and lease.number not in self._added:
            self._started.append(lease.number)

    def adopt(self, key: LeaseKey) -> None:
        """Our accounting stream holds a peer's lease (its routing stream was the peer's)."""
        self._adopted.append(key)

    def end(self, key: LeaseKey) -> None:
        """That request ended here: its owner ends the lease."""
        self._ended.append(key)

    def added(self, lease: Lease) -> None:
        if lease.owner == self.owner:
            self._added[lease.number] = lease

    def removed(self, lease: Lease) -> None:
        if lease.owner != self.owner:
            return
        if self._added.pop(lease.number, None) is None:
            self._removed.append(lease.number)

    def delta(self) -> Delta:
        """What changed since the last message (and forget it)."""
        message = Delta(
            self.owner,
            self._next(),
            self._wall(),
            [self._wire(lease) for lease in self._added.values()],
            self._removed,
            self._adopted,
            self._ended,
            self._started,
            self._affinity,
        )
        self._added, self._removed, self._adopted, self._ended, self._started = {}, [], [], [], []
        self._affinity, self._affinity_keys = [], 0
        return message

    def snapshot(self) -> Snapshot:
        """Every lease held now (pending lease deltas are in it, so they are dropped; adoptions and
        ends still go out with the next delta, as a snapshot says only what is held)."""
        self._added, self._removed = {}, []
        leases = [self._wire(lease) for lease in self._leases()]
        return Snapshot(self.owner, self._next(), self._wall(), leases, [(o, n) for o, n in self.held()])

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _wire(self, lease: Lease) -> WireLease:
        prefilling = lease.prefill_until and self._prefilling(lease.key)
        left = max(0.0, lease.prefill_until - self._clock()) if prefilling else 0.0
        return (lease.number, lease.endpoint, lease.model, lease.prefill_tokens, round(left, 4))


class SharedAccounting:
    """A request routed by one replica and accounted by another counts once, as the router's lease.

    The routing replica's lease stays its own in every view. The accounting replica takes it over
    by the token in the request's headers (``hold``) and says so (``adopted``); the router then keeps
    it past its routing stream instead of releasing it after the grace. When the request ends on
    the accounting replica (``let_go``), it says so (``ended``) and the router ends the lease. The
    accounting replica's snapshots list what it holds, so a lost message is healed, and a router
    whose accounting peer goes away ends what that peer held (its streams went with it).
    """

    def __init__(
        self,
        owner: str,
        feed: LeaseFeed,
        lent: Callable[[int], Lease | None],
        release: Callable[[Lease], None],
        knows: Callable[[str], bool],
    ) -> None:
        self.owner = owner
        self._feed = feed
        self._lent = lent
        self._release = release
        self._knows = knows
        #: Peers' leases our accounting streams hold.
        self.held: dict[LeaseKey, Lease] = {}
        #: Our leases peers' accounting streams hold: peer owner -> number -> lease.
        self.lent: dict[str, dict[int, Lease]] = {}

    # -- this replica's accounting streams --------------------------------------------------

    def hold(self, token: str, destination: str) -> Lease | None:
        """The lease a connected peer routed this request under (None: not a peer's token)."""
        key = split_token(token)
        if key is None or key[0] == self.owner or not self._knows(key[0]):
            return None
        address = EndpointAddress(destination.split(",", 1)[0].strip())
        lease = Lease(key[0], key[1], address)
        self.held[lease.key] = lease
        self._feed.adopt(lease.key)
        return lease

    def let_go(self, lease: Lease) -> None:
        """Our accounting stream for a peer's lease ended."""
        if self.held.pop(lease.key, None) is not None:
            self._feed.end(lease.key)

    # -- what peers say of our leases -------------------------------------------------------

    def adopted(self, peer: str, number: int) -> None:
        lease = self._lent(number)
        if lease is not None:
            self.lent.setdefault(peer, {})[number] = lease

    def ended(self, peer: str, number: int) -> None:
        lease = self.lent.get(peer, {}).pop(number, None) or self._lent(number)
        if lease is not None:
            self._release(lease)

    def holdings(self, peer: str, numbers: set[int]) -> None:
        for number in [n for n in self.lent.get(peer, {}) if n not in numbers]:
            self.ended(peer, number)
        for number in numbers - self.lent.get(peer, {}).keys():
            self.adopted(peer, number)

    def gone(self, peer: str) -> None:
        for lease in self.lent.pop(peer, {}).values():
            self._release(lease)
