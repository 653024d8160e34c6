"""A prompt's walk through the prefix index: which slots hold how many of its leading keys.

Internal to :mod:`extproc.kvindex.index`. The walk starts with a bitmask of the slots asked about
and narrows it key by key: a slot drops out at the first key it does not hold, and ``record(bits,
length)`` hears every slot that held at least one key when it drops. Prefixes are contiguous, so
the holders rarely change from one key to the next; every variant below is built on that.

- Recent layer only (a small index): one dict lookup and a compare per key, until nobody is left.
- Settled layer too: the settled holders of a whole chunk of keys come from one array search, then:
  - up to 64 slots: every holder set fits a uint64, so narrowing is one running AND in numpy and
    Python sees only the positions where someone drops out;
  - more slots: Python ints, visiting only the positions where the settled holder set changes (or
    the recent layer holds the key), or every position when the recent layer holds most of them.
  First, keys 16, 64, 256, ... are probed one by one (:func:`_reach`): the first that none of the
  slots still in holds bounds the walk, so a long prompt whose holders drop out early pays for its
  matched part. Chunks start at :data:`WALK_CHUNK` keys and double. A settled lookup is a binary
  search (a cache miss per halving when cold), which is why this layer costs more per key than the
  recent one (bench/results/kvindex.md).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import or_

import numpy as np

from extproc.kvindex.packed import U32, U64, PackedHolders

#: Hears the slots (bits) that dropped out and how many leading keys they held.
Record = Callable[[int, int], None]
#: Keys in the first chunk of a walk that reaches the settled layer (then 2x, 4x, ...).
WALK_CHUNK = 512
#: The first key probed for anyone holding it before a walk over the settled layer (then 4x, 16x, ...).
PROBE_FIRST = 16


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the walk reads: the GPU tier class's two layers, and the lower tier class's when a
    lookup counts blocks on any tier (None: GPU only)."""

    recent: dict[int, int]
    settled: PackedHolders
    lower: tuple[dict[int, int], PackedHolders] | None
    #: Every slot is below 64.
    words: bool


def walk(keys: Sequence[int], mask: int, holdings: Holdings, record: Record) -> tuple[int, int]:
    """Narrow ``mask`` over ``keys``; returns where the walk stopped and who was still in then."""
    lower = holdings.lower
    if len(holdings.settled) or (lower is not None and len(lower[1])):
        return _walk_layers(keys, mask, holdings, record)
    count = len(keys)
    held_at: Iterable[int] = map(holdings.recent.get, keys, repeat(0))
    if lower is not None and lower[0]:
        held_at = map(or_, held_at, map(lower[0].get, keys, repeat(0)))
    return _narrow(range(count), held_at, count, mask, record)


def _narrow(
    positions: Iterable[int], held_at: Iterable[int], end: int, mask: int, record: Record
) -> tuple[int, int]:
    """Narrow ``mask`` by the holders at each position (positions where they may change suffice);
    returns where nobody was left, or ``end`` and who still was."""
    for position, held in zip(positions, held_at, strict=True):
        if held != mask:  # usually equal: prefixes are contiguous, so holders narrow as we go
            held &= mask
            if held != mask:
                if position:
                    record(mask ^ held, position)
                mask = held
                if not mask:
                    return position, 0
    return end, mask


def _walk_layers(keys: Sequence[int], mask: int, holdings: Holdings, record: Record) -> tuple[int, int]:
    count, position, size = _reach(keys, mask, holdings), 0, WALK_CHUNK
    while position < count:
        chunk = keys[position : min(position + size, count)]
        stopped, mask = _walk_chunk(chunk, position, mask, holdings, record)
        if not mask:
            return stopped, 0
        position += len(chunk)
        size *= 2
    return position, mask


def _reach(keys: Sequence[int], mask: int, holdings: Holdings) -> int:
    """How far the walk can go at most. Keys 16, 64, 256, ... are probed one at a time for anyone
    still in ``mask`` (narrowed by each probe): the first that none of them holds ends every prefix.
    Most prompts match a short prefix and a long tail nobody holds: they pay for a few probes and a
    short chunk, not for the whole prompt."""
    probe = PROBE_FIRST
    while probe < len(keys) and mask:
        mask &= _holders_of(keys[probe], holdings)
        if not mask:
            return probe + 1
        probe *= 4
    return len(keys)


def _holders_of(key: int, holdings: Holdings) -> int:
    held = holdings.recent.get(key, 0) | holdings.settled.mask_of(key)
    if holdings.lower is not None:
        held |= holdings.lower[0].get(key, 0) | holdings.lower[1].mask_of(key)
    return held


def _walk_chunk(
    keys: Sequence[int], offset: int, mask: int, holdings: Holdings, record: Record
) -> tuple[int, int]:
    """One chunk of the walk, at ``offset`` in the prompt."""
    count = len(keys)
    recent = [holdings.recent] if holdings.lower is None else [holdings.recent, holdings.lower[0]]
    # The recent layer before the settled one: a settling round in a worker thread publishes the
    # merged settled keys before it empties the recent ones, so read in this order a lookup running
    # beside it sees every key in one layer or the other.
    found = [list(map(holders.get, keys, repeat(0))) for holders in recent if holders]
    settled_ids, masks = holdings.settled.ids_for(keys)
    if holdings.lower is not None:
        settled_ids, masks = _combine(settled_ids, masks, *holdings.lower[1].ids_for(keys))
    if holdings.words:
        lower = holdings.lower is not None
        words = np.array(masks, np.uint64) if lower else holdings.settled.mask_words(masks)
        held_words = words[settled_ids]
        for held in found:
            held_words |= np.frombuffer(array("Q", held), np.uint64)
        return _narrow_words(held_words, offset, mask, record)
    hits = sum(count - held.count(0) for held in found)
    changes: Iterable[int]
    if hits > count // 4:  # mostly in the recent layer too: block by block is cheaper
        held_at = list(map(masks.__getitem__, settled_ids.tolist()))
        for recent_held in found:  # C-level passes: the loop then only compares
            held_at = list(map(or_, held_at, recent_held))
        changes = range(count)
    else:
        recent_at: dict[int, int] = {}
        for recent_held in found:
            for position in compress(range(count), recent_held):
                recent_at[position] = recent_at.get(position, 0) | recent_held[position]
        changes = [0, *(np.flatnonzero(settled_ids[1:] != settled_ids[:-1]) + 1).tolist()]
        if recent_at:
            changes = sorted({*changes, *recent_at, *(p + 1 for p in recent_at if p + 1 < count)})
        get_recent = recent_at.get
        held_at = [
            masks[settled] | get_recent(position, 0)
            for position, settled in zip(changes, settled_ids[changes].tolist(), strict=True)
        ]
    return _narrow((position + offset for position in changes), held_at, count + offset, mask, record)


def _narrow_words(held: U64, offset: int, mask: int, record: Record) -> tuple[int, int]:
    """Narrowing with ``held[i]`` the holders of the chunk's key i as one uint64: a running AND."""
    held &= np.uint64(mask)
    still = np.bitwise_and.accumulate(held)
    first = int(still[0])
    if first != mask:  # who holds not even the chunk's first key (no record before the prompt's first)
        if offset:
            record(mask ^ first, offset)
        if not first:
            return offset, 0
    changes = np.flatnonzero(still[1:] != still[:-1])  # position - 1 of each drop
    for position, was, now in zip(
        changes.tolist(), still[changes].tolist(), still[changes + 1].tolist(), strict=True
    ):
        record(was ^ now, position + 1 + offset)
        if not now:
            return position + 1 + offset, 0
    return len(held) + offset, int(still[-1])


def _combine(
    gpu_ids: U32, gpu_masks: list[int], lower_ids: U32, lower_masks: list[int]
) -> tuple[U32, list[int]]:
    """One id per position for the union of both tier classes' settled holders."""
    pairs = gpu_ids.astype(np.uint64) << np.uint64(32) | lower_ids
    unique, ids = np.unique(pairs, return_inverse=True)
    masks = [gpu_masks[pair >> 32] | lower_masks[pair & 0xFFFFFFFF] for pair in unique.tolist()]
    return ids.astype(np.uint32), masks
