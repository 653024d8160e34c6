"""Peers' leases in the load view: deltas, snapshots that heal, a restarted or silent peer, bad input."""

from __future__ import annotations

import pytest

from extproc.control.load import Lease, LoadView
from extproc.control.peer_messages import MAX_PEER_LEASES, Delta, PeerMessageError, Snapshot, encode
from extproc.control.peers import LeaseFeed, PeerLeases
from extproc.types import EndpointAddress

A, B = EndpointAddress("10.0.0.1:8000"), EndpointAddress("10.0.0.2:8000")
PEER = "10.1.0.2:7000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def world() -> tuple[LoadView, PeerLeases, Clock]:
    clock = Clock()
    load = LoadView(clock)
    return load, PeerLeases(load, (PEER,), clock=clock, wall_clock=clock, expiry_s=2.0), clock


def snapshot(owner: str, seq: int, *leases: tuple[int, str]) -> bytes:
    return encode(Snapshot(owner, seq, 100.0, [(n, e, "m", 0, 0.0) for n, e in leases]))


def test_deltas_and_snapshots_count_as_load_and_a_snapshot_heals_a_lost_delta() -> None:
    load, peers, _ = world()
    peers.receive(PEER, snapshot("p1", 1, (1, A), (2, A)))
    assert load.snapshot() == {A: 2} and load.snapshot("me") == {}
    peers.receive(PEER, encode(Delta("p1", 2, 100.0, [(3, B, "m", 512, 0.2)], [1])))
    assert load.snapshot() == {A: 1, B: 1}
    assert load.pending_prefill(B) == (512, 1), "the peer's predicted prefill is charged too"
    # A delta was lost (lease 4 added, 2 removed): the next snapshot says how things stand.
    peers.receive(PEER, snapshot("p1", 4, (3, B), (4, B)))
    assert load.snapshot() == {B: 2}
    assert peers.debug_state() == [{"address": PEER, "connected": True, "owner": "p1", "leases": {B: 2}}]


def test_a_silent_peer_expires_and_a_restarted_one_starts_over() -> None:
    load, peers, clock = world()
    peers.receive(PEER, snapshot("p1", 1, (1, A)))
    clock.now += 1.5
    assert peers.expire() == [] and load.snapshot() == {A: 1}
    # Same address, new process: what the old one held is gone at once.
    peers.receive(PEER, snapshot("p2", 1, (7, B)))
    assert load.snapshot() == {B: 1}
    clock.now += 2.5
    assert peers.expire() == [PEER]
    assert load.snapshot() == {} and not peers.connected(PEER)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"\x00garbage", "not a peer message"),
        (encode(Snapshot("", 1, 0.0, [])), "owner"),
        (encode(Snapshot("p", 1, 0.0, [(1, "x" * 600, "m", 0, 0.0)])), "over 512"),
        (
            encode(Snapshot("p", 1, 0.0, [(i, "e", "m", 0, 0.0) for i in range(MAX_PEER_LEASES + 1)])),
            "more than",
        ),
    ],
)
def test_bad_messages_are_refused_and_change_nothing(frame: bytes, reason: str) -> None:
    load, peers, _ = world()
    with pytest.raises(PeerMessageError, match=reason):
        peers.receive(PEER, frame)
    assert load.snapshot() == {} and peers.refused == 1


def test_only_configured_peers_are_heard() -> None:
    load, peers, _ = world()
    with pytest.raises(PeerMessageError, match="not a configured peer"):
        peers.receive("10.9.9.9:7000", snapshot("x", 1, (1, A)))
    assert load.snapshot() == {}


def test_the_feed_sends_own_leases_only_and_a_lease_that_came_and_went_not_at_all() -> None:
    clock = Clock()
    load = LoadView(clock)
    feed = LeaseFeed("me", lambda: load.leases("me"), clock=clock, wall_clock=clock)
    load.on_add.append(feed.added)
    load.on_release.append(feed.removed)
    mine = Lease("me", 1, A, "m", 100, clock.now + 0.5)
    load.add(mine)
    load.add(Lease("peer", 9, B))
    brief = Lease("me", 2, B)
    load.add(brief)
    load.remove(brief.key)
    delta = feed.delta()
    assert [lease[0] for lease in delta.added] == [1] and delta.removed == []
    assert delta.added[0][4] == pytest.approx(0.5)
    load.remove(mine.key)
    assert feed.delta().removed == [1]
    load.add(Lease("me", 3, A))
    assert [lease[0] for lease in feed.snapshot().leases] == [3]
    assert not feed.pending


class Replica:
    """Request control with peer sync, its messages carried by hand (no sockets)."""

    def __init__(self, address: str, peer: str, clock: Clock) -> None:
        from control.test_requests import World
        from extproc.control.peers import SharedAccounting

        self.address = address
        self.world = World()
        control = self.world.control
        control.handover.accounting_seen = True  # the gateway runs an accounting filter
        self.control = control
        self.feed = LeaseFeed(
            control.owner,
            lambda: control.load.leases(control.owner),
            prefilling=control.load.prefilling,
            clock=clock,
            wall_clock=clock,
        )
        self.peers = PeerLeases(control.load, (peer,), own=control.owner, clock=clock, wall_clock=clock)
        shared = SharedAccounting(
            control.owner, self.feed, control.handover.lent, control.release, self.peers.knows
        )
        self.feed.held = lambda: shared.held.keys()
        self.peers.shared = control.shared = shared
        control.load.on_add.append(self.feed.added)
        control.load.on_release.append(self.feed.removed)
        control.load.on_prefill_over.append(self.feed.prefill_over)

    def tell(self, other: Replica, *, snapshot: bool = False) -> None:
        message = self.feed.snapshot() if snapshot else self.feed.delta()
        other.peers.receive(self.address, encode(message))


def test_a_request_routed_by_one_replica_and_accounted_by_another_counts_once_everywhere() -> None:
    from control.test_requests import chat, routed_now

    clock = Clock()
    a, b = Replica("a:1", "b:1", clock), Replica("b:1", "a:1", clock)
    a.tell(b, snapshot=True)
    b.tell(a, snapshot=True)
    routed = routed_now(a.control.route(chat()))
    a.tell(b)
    assert a.control.load.total == b.control.load.total == 1
    # Its accounting stream reaches B: B holds A's lease rather than taking one of its own.
    held = b.control.accounting_lease(routed.decision.destination, token=routed.token)
    assert held is not None and held.key == routed.lease.key
    b.tell(a)
    routed.stream_ended()  # A's routing stream ends: the lease is B's to end now, not released
    clock.now += 5
    a.control.handover.claim("")  # any handover call expires what is due
    assert a.control.load.total == b.control.load.total == 1
    # The response ends on B: everyone stops counting it.
    b.control.release(held)
    assert b.control.load.total == 0
    b.tell(a)
    assert a.control.load.total == 0
    a.tell(b)
    assert b.control.load.total == 0


def test_a_lost_ended_message_is_healed_by_the_next_snapshot_and_a_gone_peer_ends_what_it_held() -> None:
    from control.test_requests import chat, routed_now

    clock = Clock()
    a, b = Replica("a:1", "b:1", clock), Replica("b:1", "a:1", clock)
    a.tell(b, snapshot=True)
    b.tell(a, snapshot=True)
    first, second = routed_now(a.control.route(chat())), routed_now(a.control.route(chat()))
    for routed in (first, second):
        assert b.control.accounting_lease(routed.decision.destination, token=routed.token) is not None
    b.tell(a)
    b.control.release(next(iter(b.control.shared.held.values())))  # type: ignore[union-attr]
    b.feed.delta()  # ... and that delta is lost
    assert a.control.load.snapshot(a.control.owner) != {}
    b.tell(a, snapshot=True)  # B's snapshot lists only what it still holds
    assert sum(a.control.load.snapshot(a.control.owner).values()) == 1
    clock.now += 10  # B goes silent: what it held ends with it
    a.peers.expire()
    assert a.control.load.total == 0


def test_a_response_that_began_ends_the_prefill_peers_charge() -> None:
    """The router's own view stops charging a lease's prefill when its response begins; peers too."""
    clock = Clock()
    a, b = Replica("a:1", "b:1", clock), Replica("b:1", "a:1", clock)
    a.tell(b, snapshot=True)
    lease = a.control.acquire(A, model="m", prefill_tokens=900, prefill_seconds=2.0)
    a.tell(b)
    assert b.control.load.pending_prefill(A) == (900, 1)
    a.control.load.prefill_over(lease.key)
    a.tell(b)
    assert b.control.load.pending_prefill(A) == (0, 0)
    assert a.feed.snapshot().leases[0][4] == 0.0, "a snapshot says no prefill is left either"


def test_affinity_learned_by_one_replica_reaches_the_others_bounded() -> None:
    from extproc.control.peer_messages import MAX_AFFINITY_KEYS

    _load, peers, clock = world()
    learned: list[tuple[list[int], str]] = []
    peers.on_affinity = lambda chunks, endpoint: learned.append((list(chunks), endpoint))
    feed = LeaseFeed("p1", lambda: iter(()), clock=clock, wall_clock=clock)
    feed.affinity([1, 2, 3], A)
    feed.affinity([9] * MAX_AFFINITY_KEYS, B)  # past the message's bound: not sent
    peers.receive(PEER, encode(feed.delta()))
    assert learned == [([1, 2, 3], A)]
    too_many = Delta("p1", 9, 100.0, [], [], affinity=[([0] * (MAX_AFFINITY_KEYS + 1), A)])
    with pytest.raises(PeerMessageError, match="affinity keys"):
        peers.receive(PEER, encode(too_many))
