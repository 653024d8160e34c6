"""Peers' leases in the load view: deltas, snapshots that heal, a restarted or silent peer, bad input."""

from __future__ import annotations

import pytest

from extproc.control.load import Lease, LoadView
from extproc.control.peers import (
    MAX_PEER_LEASES,
    Delta,
    LeaseFeed,
    PeerLeases,
    PeerMessageError,
    Snapshot,
    encode,
)
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
