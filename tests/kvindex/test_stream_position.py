"""The stream-position rules without a socket: what each live batch means, and how replays merge in.

tests/kvindex/test_subscriber.py drives the same rules through real ZMQ sockets and a publisher.
"""

from __future__ import annotations

from extproc.kvindex.stream_position import (
    NO_REPLAY,
    Arrival,
    Batch,
    Hole,
    StreamPosition,
    lost_reason,
)


def batch(seq: int, incarnation: str = "a") -> Batch:
    payload = f"{incarnation}{seq}".encode()
    return Batch(seq, payload, len(payload), digest=payload)


def synced_at(seq: int) -> StreamPosition:
    """A position that has handed on batches 0..seq of incarnation "a"."""
    position = StreamPosition()
    for s in range(seq + 1):
        position.handed_on(batch(s))
    return position


def test_before_the_first_batch_every_batch_needs_a_replay_first() -> None:
    position = StreamPosition()
    assert position.expected is None
    assert position.arrive(batch(0), can_verify=True) is Arrival.UNSURE
    assert position.arrive(batch(7), can_verify=False) is Arrival.UNSURE


def test_the_expected_seq_is_next_and_a_later_one_is_a_gap() -> None:
    position = synced_at(4)
    assert position.arrive(batch(5), can_verify=True) is Arrival.NEXT
    position.handed_on(batch(5))
    assert position.arrive(batch(9), can_verify=True) is Arrival.GAP


def test_backwards_with_other_bytes_is_a_restart() -> None:
    position = synced_at(4)
    assert position.arrive(batch(2, incarnation="b"), can_verify=True) is Arrival.RESTARTED
    # Not even the same bytes count without a replay having handed them on ahead.
    assert position.arrive(batch(2), can_verify=True) is Arrival.RESTARTED


def test_a_replay_that_ran_ahead_makes_the_live_copies_duplicates_once() -> None:
    position = synced_at(2)
    steps = list(position.merge(3, trigger=batch(3), replayed=[batch(3), batch(4), batch(5)]))
    for step in steps:
        assert isinstance(step, Batch)
        position.handed_on(step)
    assert [s.seq for s in steps if isinstance(s, Batch)] == [3, 4, 5]
    assert position.expected == 6
    assert position.arrive(batch(4), can_verify=True) is Arrival.DUPLICATE
    assert position.arrive(batch(5), can_verify=True) is Arrival.DUPLICATE
    # Seen live once, the copy is forgotten: the same seq again is a restart.
    assert position.arrive(batch(5), can_verify=True) is Arrival.RESTARTED
    assert position.ahead == {}


def test_merge_orders_batches_and_names_the_holes() -> None:
    position = StreamPosition()
    steps = list(position.merge(0, trigger=batch(6), replayed=[batch(4), batch(2), batch(1)]))
    assert steps == [Hole(0, 1), batch(1), batch(2), Hole(3, 4), batch(4), Hole(5, 6), batch(6)]
    assert [h.count for h in steps if isinstance(h, Hole)] == [1, 1, 1]


def test_merge_keeps_the_live_copy_and_drops_what_was_already_handed_on() -> None:
    position = synced_at(2)
    live = batch(4, incarnation="live")
    steps = list(position.merge(3, trigger=live, replayed=[batch(1), batch(2), batch(3), batch(4)]))
    assert steps == [batch(3), live]


def test_after_a_disconnect_the_expected_seq_is_verified_when_a_replay_can_tell() -> None:
    position = synced_at(4)
    position.disconnected()
    assert position.verify_next
    assert position.arrive(batch(5), can_verify=True) is Arrival.UNSURE
    assert not position.verify_next
    position.disconnected()
    assert position.arrive(batch(5), can_verify=False) is Arrival.NEXT


def test_a_disconnect_before_any_batch_has_nothing_to_verify() -> None:
    position = StreamPosition()
    position.disconnected()
    assert not position.verify_next


def test_a_replay_from_the_anchor_with_other_bytes_contradicts_the_position() -> None:
    position = synced_at(4)
    assert position.contradicted_by(batch(4, incarnation="b"))
    assert not position.contradicted_by(batch(4))
    assert not position.contradicted_by(batch(3, incarnation="b"))  # not the anchor: inconclusive
    assert not position.contradicted_by(None)
    assert not StreamPosition().contradicted_by(batch(0, incarnation="b"))


def test_forget_starts_over() -> None:
    position = synced_at(3)
    position.remember_ahead([batch(5)])
    position.disconnected()
    position.forget()
    assert (position.expected, position.anchor, position.ahead, position.verify_next) == (
        None,
        None,
        {},
        False,
    )


def test_lost_reasons_say_what_operators_search_for() -> None:
    assert lost_reason(Hole(0, 5), NO_REPLAY, joining=True) == "joined at seq 5 without replay"
    assert (
        lost_reason(Hole(0, 5), "replay timed out", joining=True)
        == "history before seq 5 lost (replay timed out)"
    )
    assert lost_reason(Hole(0, 5), None, joining=True) == "history before seq 5 lost"
    assert lost_reason(Hole(7, 8), None, joining=False) == "batch 7 lost (no longer in the replay buffer)"
    assert (
        lost_reason(Hole(7, 10), "replay timed out", joining=False) == "batches 7-9 lost (replay timed out)"
    )
