"""Settled blocks in flat numpy arrays: the bulk of a large prefix index at ~30 bytes per entry.

Internal to :mod:`extproc.kvindex.index`, which documents the two layers (recent blocks in dicts,
settled ones here) and when blocks move from one to the other.

- :class:`PackedRows`: one (source, tier)'s settled engine hashes. Three parallel arrays sorted by
  engine hash: the hash, our key, and the epoch (settling round) that stored it, 20 bytes a block.
  An engine block re-chunked into k index blocks is k consecutive rows with the same hash, in
  order. A removed row keeps its place with the key :data:`DEAD` until the next settling drops it.
- :class:`PackedHolders`: every settled key of a tier class and who holds it. Two parallel arrays
  sorted by key: the key and the id of its holder set, 12 bytes a distinct key. Holder sets are slot
  bitmasks interned once (a fleet has few distinct ones: one per endpoint for private blocks, a
  handful for shared prefixes), so a key shared by 8 endpoints costs 1.5 bytes per endpoint.

Why numpy: a dict entry with its two int objects costs 90-150 bytes, which no layout of dicts
reaches 40 from (bench/results/kvindex.md). Arrays cost their element size; lookups search them
with ``searchsorted`` over all of a prompt's keys at once, removals are batched per event batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]
Rows = npt.NDArray[np.intp]

#: A removed row's key (our keys are below 2**60).
DEAD: Final = 1 << 63
_EMPTY_U64: Final = np.empty(0, np.uint64)
_EMPTY_U32: Final = np.empty(0, np.uint32)
#: The last of PackedHolders.keys, held by nobody: a search never runs past the end.
_SENTINEL: Final = np.uint64(2**64 - 1)

#: Our key, or the k keys of an engine block re-chunked into k index blocks.
Entry = int | tuple[int, ...]


class PackedRows:
    """One (source, tier)'s settled engine hashes -> our keys, oldest epoch first to evict."""

    __slots__ = ("dead", "epochs", "hashes", "keys", "rechunked")

    def __init__(self) -> None:
        self.hashes: U64 = _EMPTY_U64
        self.keys: U64 = _EMPTY_U64
        self.epochs: U32 = _EMPTY_U32
        #: Rows removed since the last settling (still in the arrays, key DEAD).
        self.dead = 0
        #: Some engine hash has more than one row (re-chunked blocks): removals look past the first.
        self.rechunked = False

    def __len__(self) -> int:
        """Blocks held (live rows)."""
        return len(self.hashes) - self.dead

    def nbytes(self) -> int:
        return self.hashes.nbytes + self.keys.nbytes + self.epochs.nbytes

    def entries(self) -> int:
        """Live engine hashes (a re-chunked block's k rows are one)."""
        if not self.rechunked:
            return len(self)
        hashes = self.hashes
        heads = np.ones(len(hashes), np.bool_)
        heads[1:] = hashes[1:] != hashes[:-1]
        return int(np.count_nonzero(heads & (self.keys != DEAD)))

    def find(self, engine_hash: int) -> Entry | None:
        """The live entry of a (folded) engine hash, or None."""
        hashes = self.hashes
        wanted = np.uint64(engine_hash)  # a Python int costs ~30 µs a search, a numpy scalar 0.6
        first = int(hashes.searchsorted(wanted))
        if first == len(hashes) or int(hashes[first]) != engine_hash or int(self.keys[first]) == DEAD:
            return None
        end = first + 1
        if self.rechunked:
            end = int(hashes.searchsorted(wanted, "right"))
        if end == first + 1:
            return int(self.keys[first])
        return tuple(int(key) for key in self.keys[first:end])

    def live(self, engine_hashes: U64) -> npt.NDArray[np.bool_]:
        """For each engine hash, whether it has a live entry here."""
        return self._first_rows(engine_hashes)[1]

    def take(self, engine_hashes: U64) -> tuple[U64, int]:
        """Remove the entries of ``engine_hashes`` (each named once); returns their keys and how many
        hashes had no live entry."""
        first, live = self._first_rows(engine_hashes)
        rows = first[live]
        if len(rows) > 1 and len(set(rows.tolist())) < len(rows):  # a hash named twice: one is unknown
            rows = np.unique(rows)
        unknown = len(engine_hashes) - len(rows)
        rows = self._whole_entries(rows)
        keys = self.keys[rows]
        self._kill(rows)
        return keys, unknown

    def refresh(self, engine_hashes: U64, epoch: int) -> None:
        """Make the live entries of ``engine_hashes`` as recent as ``epoch`` (stored again)."""
        rows = self._whole_entries(self.hashes.searchsorted(engine_hashes))
        self.epochs[rows] = epoch

    def evict(self, need: int) -> tuple[U64, U64]:
        """Remove whole entries, oldest epoch first, until ``need`` blocks are gone (or none is left).
        Returns the removed rows' keys and engine hashes (one per row)."""
        live_rows = np.flatnonzero(self.keys != DEAD)
        if len(live_rows) > need:
            epochs = self.epochs[live_rows]
            cut = np.partition(epochs, need - 1)[need - 1]
            older = live_rows[epochs < cut]
            at_cut = live_rows[epochs == cut][: need - len(older)]
            live_rows = self._whole_entries(np.concatenate([older, at_cut]))
        keys, hashes = self.keys[live_rows], self.hashes[live_rows]
        self._kill(live_rows)
        return keys, hashes

    def clear(self) -> U64:
        """Remove everything; returns the live rows' keys."""
        keys: U64 = self.keys[self.keys != DEAD]
        self.__init__()  # type: ignore[misc]
        return keys

    def merge(self, engine_hashes: U64, keys: U64, epoch: int, *, rechunked: bool) -> None:
        """Add rows (hashes with no live entry here; a re-chunked block's rows in order, ``rechunked``
        when some hash has several)."""
        if self.dead:
            keep = self.keys != DEAD
            self.hashes, self.keys, self.epochs = self.hashes[keep], self.keys[keep], self.epochs[keep]
            self.dead = 0
        # Stable only where it matters: a re-chunked block's rows must stay in order.
        order = np.argsort(engine_hashes, kind="stable" if rechunked else None)
        engine_hashes = engine_hashes[order]
        self.rechunked = self.rechunked or rechunked
        at = self.hashes.searchsorted(engine_hashes)
        epochs = np.full(len(at), epoch, np.uint32)
        self.hashes, self.keys, self.epochs = _insert(
            at, (self.hashes, engine_hashes), (self.keys, keys[order]), (self.epochs, epochs)
        )

    def _first_rows(self, engine_hashes: U64) -> tuple[Rows, npt.NDArray[np.bool_]]:
        """Each engine hash's first row (clamped to the last), and whether that row is its live entry."""
        first = np.minimum(self.hashes.searchsorted(engine_hashes), len(self.hashes) - 1)
        return first, (self.hashes[first] == engine_hashes) & (self.keys[first] != DEAD)

    def _whole_entries(self, rows: Rows) -> Rows:
        """``rows`` (each an entry's first or any row) plus the other rows of their entries."""
        if not self.rechunked or not len(rows):
            return rows
        hashes = self.hashes
        first = hashes.searchsorted(hashes[rows], "left")
        end = hashes.searchsorted(hashes[rows], "right")
        first, end = np.unique(first), np.unique(end)
        counts = end - first
        starts = np.repeat(first - np.cumsum(counts) + counts, counts)
        return starts + np.arange(counts.sum())

    def _kill(self, rows: Rows) -> None:
        self.keys[rows] = DEAD
        self.dead += len(rows)


class PackedHolders:
    """Settled keys of one tier class -> the slot bitmask of the sources holding each."""

    __slots__ = ("_id_of", "_masks_at_collect", "_table", "_words", "empty")

    def __init__(self) -> None:
        #: (keys, holder-set ids, interned holder sets), replaced as one so that a lookup running
        #: beside a settling round in a worker thread always reads a matching three
        #: (:meth:`~extproc.kvindex.index.PrefixIndex.apply`). Holder sets: id -> slot bitmask; id 0
        #: is nobody (a key whose last holder left). A new set is appended before an id refers to it.
        self._table: tuple[U64, U32, list[int]] = (
            np.array([_SENTINEL], np.uint64),
            np.zeros(1, np.uint32),
            [0],
        )
        self._id_of: dict[int, int] = {0: 0}
        self._masks_at_collect = 1
        #: (the holder sets' list, its length, those sets as uint64s), while no slot is past 63.
        self._words: tuple[list[int], int, U64] | None = None
        #: Rows held by nobody, dropped at the next merge.
        self.empty = 0

    @property
    def keys(self) -> U64:
        return self._table[0]

    @property
    def ids(self) -> U32:
        return self._table[1]

    @property
    def masks(self) -> list[int]:
        return self._table[2]

    def __len__(self) -> int:
        """Keys with at least one holder."""
        return len(self.keys) - 1 - self.empty

    def nbytes(self) -> int:
        keys, ids, _ = self._table
        return keys.nbytes + ids.nbytes

    def mask_of(self, key: int) -> int:
        """The holder bitmask of one key (one search)."""
        keys, ids, masks = self._table
        row = int(keys.searchsorted(np.uint64(key)))  # never past the end: the sentinel
        return masks[int(ids[row])] if int(keys[row]) == key else 0

    def ids_for(self, keys: Sequence[int]) -> tuple[U32, list[int]]:
        """The holder-set id of each of ``keys`` (0 where nobody holds it), and the holder sets those
        ids index."""
        stored, held, masks = self._table
        wanted = np.frombuffer(array("Q", keys), np.uint64)
        rows = stored.searchsorted(wanted)  # never past the end: the last key is _SENTINEL
        ids: U32 = held[rows]
        ids[stored[rows] != wanted] = 0
        return ids, masks

    def release(self, keys: U64, bit: int) -> None:
        """``bit``'s source no longer holds ``keys`` (all present, as the caller's rows say)."""
        if not len(keys):
            return
        rows = self.keys.searchsorted(keys)
        masks, intern = self.masks, self._intern
        without: dict[int, int] = {}  # old id -> new id: a batch has few distinct holder sets
        new_ids = [
            without[i] if i in without else without.setdefault(i, intern(masks[i] & ~bit))
            for i in self.ids[rows].tolist()
        ]
        self.ids[rows] = new_ids
        self.empty += new_ids.count(0)

    def merge(self, recent: dict[int, int], *, wide: bool) -> list[tuple[int, int]]:
        """Add ``recent`` (key -> holder bits); returns ``(key, bits)`` for bits a key already had.
        ``wide``: some slot is past 63, so masks are long ints (slow to hash)."""
        if self.empty:
            keep = self.ids != 0
            keep[-1] = True  # the sentinel
            self._table = (self.keys[keep], self.ids[keep], self.masks)
            self.empty = 0
        added = np.fromiter(recent, np.uint64, len(recent))
        bits = list(recent.values())
        if wide:
            # By object identity: most values are a source's own bit object, and hashing a
            # 1,000-bit int once per key would cost more than the rest of the round.
            objects = list(map(id, bits))
            by_object = dict(zip(objects, bits, strict=True))
            interned = {obj: self._intern(mask) for obj, mask in by_object.items()}
            found = list(map(interned.__getitem__, objects))
        else:
            for mask in set(bits) - self._id_of.keys():  # C-level passes: holder sets are few
                self._intern(mask)
            found = list(map(self._id_of.__getitem__, bits))
        order = np.argsort(added)
        in_dict_order, added, ids = added, added[order], np.array(found, np.uint32)[order]
        at = self.keys.searchsorted(added)
        exists = self.keys[at] == added
        overlaps: list[tuple[int, int]] = []
        if exists.any():  # keys settled before: union the holder sets
            masks, intern = self.masks, self._intern
            rows = at[exists]
            new_ids = []
            for i, old_id in zip(order[exists].tolist(), self.ids[rows].tolist(), strict=True):
                old, new = masks[old_id], bits[i]
                if old & new:
                    overlaps.append((int(in_dict_order[i]), old & new))
                new_ids.append(intern(old | new))
            self.ids[rows] = new_ids
            fresh = ~exists
            added, ids, at = added[fresh], ids[fresh], at[fresh]
        keys, held = _insert(at, (self.keys, added), (self.ids, ids))
        self._table = (keys, held, self.masks)
        if len(self.masks) > 2 * self._masks_at_collect + 4096:
            self._collect()
        return overlaps

    def mask_words(self, masks: list[int]) -> U64:
        """``masks`` (this table's holder sets, as :meth:`ids_for` returned them) as uint64s (only
        while no slot is past 63)."""
        cached = self._words
        if cached is not None and cached[0] is masks and cached[1] == len(masks):
            return cached[2]
        words = np.array(masks, np.uint64)
        self._words = (masks, len(words), words)
        return words

    def _intern(self, mask: int) -> int:
        found = self._id_of.get(mask)
        if found is None:
            found = self._id_of[mask] = len(self.masks)
            self.masks.append(mask)
        return found

    def _collect(self) -> None:
        """Forget holder sets no key uses any more (churn leaves them behind)."""
        used = np.flatnonzero(np.bincount(self.ids, minlength=len(self.masks)))
        used = used[used != 0]
        remap = np.zeros(len(self.masks), np.uint32)
        remap[used] = np.arange(1, len(used) + 1, dtype=np.uint32)
        masks = [0, *(self.masks[i] for i in used.tolist())]
        self._table = (self.keys, remap[self.ids], masks)
        self._id_of = {mask: i for i, mask in enumerate(masks)}
        self._masks_at_collect = len(masks)


def _insert(at: Rows, *columns: tuple[npt.NDArray[Any], npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    """Each ``(old, new)`` column with ``new`` inserted before the rows ``at`` of ``old`` (``at``
    sorted, as ``searchsorted`` gives it): ``np.insert`` for several columns, the slots worked out once."""
    total = len(columns[0][0]) + len(at)
    new_rows = at + np.arange(len(at))
    old_rows = np.ones(total, np.bool_)
    old_rows[new_rows] = False
    merged = []
    for old, new in columns:
        out = np.empty(total, old.dtype)
        out[new_rows] = new
        out[old_rows] = old
        merged.append(out)
    return merged
