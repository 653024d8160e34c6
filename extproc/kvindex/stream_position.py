"""Where a subscriber stands in one publisher's KV-event stream, and what each batch means there.

Sans-IO: no sockets, no awaits, no sink. :class:`~extproc.kvindex.subscriber.KVEventSubscriber`
receives live batches and replays and carries out what this decides (hand a batch on, count a hole
lost, reset the source); the rules are tested here without a socket.

The rules:

- **First message** (or first after a reset): seq 0 is handed on. seq N > 0 means history was
  published before we joined: with replay it is fetched from 0; without, batches are handed on from
  N and the missing ones reported lost ("joined at seq N without replay").
- **Gap** (seq > expected): replay from ``expected - 1``. The extra batch is the *anchor*: if the
  publisher replays different bytes for the last seq handed on, it is a new incarnation (a restart
  whose first seqs we missed), so the source is reset rather than two engines spliced together.
- **Merge**: replayed batches and the live one that triggered the replay are handed on in seq
  order, each seq once; holes the replay cannot cover are reported lost. Live messages that arrive
  during the replay wait in the SUB queue; a replay can run ahead of them, so the digests of
  batches handed on ahead of the live stream are kept until live catches up.
- **Backwards** (seq < expected): a duplicate only if replay already handed on that exact batch
  (same seq, same bytes); PUB itself never redelivers, so anything else is a restart.
- **Reconnect**: after the SUB lost its connection, the next message is verified through the
  anchor replay even if its seq is the expected one (a restarted engine may have reached it).
  Without replay this case, and a restart whose first seen seq is above ``expected``, cannot be
  told from a network blip and is reported as a gap.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Batch:
    """One ``[topic, seq8, payload]`` message, live or replayed."""

    seq: int
    #: None when the payload was over ``max_payload_bytes`` (skipped, and its seq reported lost).
    payload: bytes | None
    size: int
    #: Identifies the exact bytes, so a replayed batch can be told from another incarnation's.
    digest: bytes


@dataclass(frozen=True, slots=True)
class Hole:
    """Seqs ``first`` to ``end - 1`` will never be handed on."""

    first: int
    end: int

    @property
    def count(self) -> int:
        return self.end - self.first


class Arrival(enum.Enum):
    """What a live batch means at the current position."""

    #: The seq expected, nothing to verify: hand it on.
    NEXT = "next"
    #: A copy of a batch a replay already handed on: drop it.
    DUPLICATE = "duplicate"
    #: Backwards, with other bytes: the publisher restarted. Reset, then join as a first message.
    RESTARTED = "restarted"
    #: Ahead of the expected seq: replay what is missing.
    GAP = "gap"
    #: Not synchronised (first message, or first after a reset), or the first after a reconnect:
    #: replay first (from 0, or from the anchor).
    UNSURE = "unsure"


@dataclass(slots=True)
class StreamPosition:
    """One stream's position: the next seq, the anchor behind it, and what a replay handed on ahead.

    Its one writer is the subscriber's task, which carries out each verdict before the next batch.
    """

    #: The next seq expected; None while not synchronised (before the first batch, after a reset).
    expected: int | None = None
    #: Digest of the batch at ``expected - 1``: a replay from there must show the same bytes for the
    #: publisher to be the same incarnation.
    anchor: bytes | None = None
    #: Batches a replay handed on before the live stream got there: seq -> digest.
    ahead: dict[int, bytes] = field(default_factory=dict)
    #: Set by a disconnect: the next live batch is verified against the anchor first.
    verify_next: bool = False

    def arrive(self, batch: Batch, *, can_verify: bool) -> Arrival:
        """Judge a live batch; ``can_verify`` is whether a replay socket is configured."""
        expected = self.expected
        if expected is None:
            return Arrival.UNSURE
        if batch.seq < expected:
            if self.ahead.get(batch.seq) != batch.digest:
                return Arrival.RESTARTED
            self._passed(batch.seq)
            return Arrival.DUPLICATE
        verify = self.verify_next and can_verify
        self.verify_next = False
        self._passed(batch.seq)
        if batch.seq > expected:
            return Arrival.GAP
        return Arrival.UNSURE if verify else Arrival.NEXT

    def disconnected(self) -> None:
        """The SUB lost its connection: verify the next batch, if there is a position to verify."""
        self.verify_next = self.expected is not None

    def contradicted_by(self, replayed_first: Batch | None) -> bool:
        """A replay asked from the anchor shows other bytes for it: another incarnation published."""
        return (
            self.expected is not None
            and replayed_first is not None
            and replayed_first.seq == self.expected - 1
            and replayed_first.digest != self.anchor
        )

    def handed_on(self, batch: Batch) -> None:
        self.expected, self.anchor = batch.seq + 1, batch.digest

    def merge(self, start: int, trigger: Batch, replayed: Iterable[Batch]) -> Iterator[Batch | Hole]:
        """Replayed batches and the live ``trigger`` in seq order from ``start``, each seq once, with
        the holes between them; the caller hands each batch on (:meth:`handed_on`) as it comes.

        Replayed batches past the trigger are remembered, so their live copies count as duplicates.
        """
        pending = {batch.seq: batch for batch in replayed if batch.seq >= start}
        pending[trigger.seq] = trigger  # the live copy wins a (theoretical) disagreement
        cursor = start
        for seq in sorted(pending):
            if seq > cursor:
                yield Hole(cursor, seq)
            if seq > trigger.seq:
                self.ahead[seq] = pending[seq].digest
            yield pending[seq]
            cursor = seq + 1

    def remember_ahead(self, batches: Iterable[Batch]) -> None:
        """Batches that may still arrive live although handed on (joining from replay alone)."""
        for batch in batches:
            self.ahead[batch.seq] = batch.digest

    def forget(self) -> None:
        """Not synchronised any more: the next batch is judged as a first one."""
        self.expected = self.anchor = None
        self.ahead.clear()
        self.verify_next = False

    def _passed(self, seq: int) -> None:
        """Forget replayed-ahead digests the live stream has reached (PUB never goes back)."""
        while self.ahead and (first := next(iter(self.ahead))) <= seq:
            del self.ahead[first]


def lost_reason(hole: Hole, cause: str | None, *, joining: bool) -> str:
    """Why a hole's batches are missing, in the words operators will search for."""
    first, end = hole.first, hole.end
    if joining and first == 0:
        if cause == NO_REPLAY:
            return f"joined at seq {end} without replay"
        return f"history before seq {end} lost" + (f" ({cause})" if cause else "")
    span = f"batch {first}" if end - first == 1 else f"batches {first}-{end - 1}"
    return f"{span} lost ({cause or 'no longer in the replay buffer'})"


#: The cause of holes a subscriber without a replay socket cannot fill.
NO_REPLAY = "no replay configured"
