"""Which prompts are worth tokenizing after their request has gone on without them.

A prompt past its tokenization budget is routed approximately; tokenizing it afterwards (*late*)
only teaches the segment tree its pieces, so that a later prompt starting the same way is not cold.
That pays for a conversation, whose next turn repeats its whole history, and is wasted on a prompt
nobody sends again: a one-off RAG question over its own documents. Measured on 2 cores beside a
client streaming unique ~32k-token chats, that wasted work (run idle-class, on cores nobody else
wanted) still slowed every other decision: small requests' p99 1.26x alone with it, 0.94x without.

So a late prompt runs only when its *opening* recurs: when a prompt seen before began the same way,
for a long enough stretch that the shared part is not merely a common system prompt. A prompt of
``n`` bytes is judged by its first ``c`` bytes, ``c`` the longest checkpoint (:data:`FIRST_CHECKPOINT`
bytes, doubled) up to ``n / 2``: the next turn of a conversation repeats its history, which is most
of it (the new message is rarely longer than everything before it), while unique prompts sharing a
system prompt shorter than a quarter of their length still differ there. Every prompt remembers its
own openings at every checkpoint it reaches, whether or not it ran late: a conversation's first turn
is then learned when its second turn comes, one approximate turn later than if every late prompt ran.

Openings are CRC-32s of byte prefixes, chained checkpoint to checkpoint, so each byte is read once
(~50 us for 128 kB, on the event loop); a collision only runs one late prompt for nothing. The
memory is bounded: the :data:`REMEMBERED` most recently seen openings.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

#: The shortest opening compared (bytes); each next checkpoint doubles it.
FIRST_CHECKPOINT = 4096
#: Openings remembered (~120 bytes each, ~3.9 MB in all, measured; a 128 kB prompt has 6).
REMEMBERED = 32_768


def openings(body: bytes) -> list[tuple[int, int]]:
    """(checkpoint, CRC-32 of ``body[:checkpoint]``) for every checkpoint ``body`` reaches."""
    view = memoryview(body)
    found: list[tuple[int, int]] = []
    start, crc, checkpoint = 0, 0, FIRST_CHECKPOINT
    while checkpoint <= len(body):
        crc = zlib.crc32(view[start:checkpoint], crc)
        found.append((checkpoint, crc))
        start, checkpoint = checkpoint, checkpoint * 2
    return found


class Openings:
    """The openings of recent prompts, to tell whether a new prompt's opening recurs."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        if remembered < 1:
            raise ValueError(f"remembered must be at least 1, got {remembered}")
        self.remembered = remembered
        #: Checkpoint and CRC in one int (``checkpoint << 32 | crc``: one object, not three), oldest
        #: first. An ordered dict, not a plain one: evicting a plain dict's first key again and
        #: again walks every slot emptied before it, ~115 us a 128 kB prompt once full.
        self._seen: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def recurs(self, body: bytes) -> bool:
        """True when an earlier prompt began as ``body`` does (see the module); then remember
        ``body``'s own openings. A body too short to judge (no checkpoint up to half of it) recurs:
        it is cheap to learn."""
        found = [checkpoint << 32 | crc for checkpoint, crc in openings(body)]
        judged = sum(1 for key in found if 2 * (key >> 32) <= len(body))
        recurs = not judged or found[judged - 1] in self._seen
        seen = self._seen
        for key in found:
            seen[key] = None
            seen.move_to_end(key)  # most recent last: evicted last
        while len(seen) > self.remembered:
            seen.popitem(last=False)
        return recurs
