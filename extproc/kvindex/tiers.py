"""One source's blocks per cache tier: engine hash -> our keys, ref counts, and its bits in the holders.

Internal to :mod:`extproc.kvindex.index` (which documents the layout, the two layers and the
invariant). A :class:`Tier` changes its own ``blocks`` count and returns how many blocks each call
added or released, so the index can keep its total without walking the sources.

Engine hashes arrive as uint64 and are folded to 60 bits (``& KEY_MASK``) before use: a Python int
below 2**60 is a 32-byte object, one above is 48 bytes, and the recent layer keeps one per block.
Within one source a fold collision needs two of its live hashes to agree on 60 bits (about
n**2 / 2**61).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from extproc.kvindex.events import Source
from extproc.kvindex.keys import KEY_MASK, namespace_seed
from extproc.kvindex.packed import U64, Entry, PackedHolders, PackedRows
from extproc.kvindex.results import ApplyResult

__all__ = ["Entry", "SourceState", "Tier"]


class Tier:
    """One source's blocks on one tier class (GPU, or every lower tier together)."""

    __slots__ = (
        "aliases",
        "blocks",
        "copies",
        "hashes",
        "holders",
        "pending",
        "rechunked",
        "settled",
        "settled_aliases",
        "settled_holders",
    )

    def __init__(self, holders: dict[int, int], settled_holders: PackedHolders) -> None:
        #: The index's recent key -> slot-bitmask dict for this tier class (shared by every source).
        self.holders = holders
        #: The index's settled keys for this tier class (shared by every source).
        self.settled_holders = settled_holders
        #: Recent layer: folded engine hash -> entry; insertion order is least recently stored first.
        self.hashes: dict[int, Entry] = {}
        #: Extra copies of an engine hash (beyond the first), only for hashes stored more than once.
        self.copies: dict[int, int] = {}
        #: Extra recent engine hashes mapping to a key (beyond the first), only for such keys.
        self.aliases: dict[int, int] = {}
        #: Settled layer: older entries, packed.
        self.settled = PackedRows()
        #: Extra settled engine hashes mapping to a key (beyond the first), only for such keys.
        self.settled_aliases: dict[int, int] = {}
        #: Some recent entry is a tuple of keys (a re-chunked engine block).
        self.rechunked = False
        #: Removed engine hashes not in the recent layer, for :meth:`flush` to take from the settled one.
        self.pending: list[int] = []
        #: Index blocks held, both layers: the keys of every entry, counted with repetition.
        self.blocks = 0

    def insert_keys(
        self, engine_hashes: Sequence[int], keys: list[int], bit: int, result: ApplyResult
    ) -> int:
        """The hot path of :meth:`insert`: one key per (unfolded) engine hash. Returns blocks added."""
        mapping, holders, aliases = self.hashes, self.holders, self.aliases
        get_holders, setdefault = holders.get, mapping.setdefault
        added = 0
        for engine_hash, key in zip(engine_hashes, keys, strict=True):
            engine_hash &= KEY_MASK
            # One dict operation instead of two: ``key`` is a fresh int from block_keys, so getting
            # another object back means the hash was already there (short of CPython's cached ints
            # below 257, which a 60-bit key hits with probability 2**-52).
            old = setdefault(engine_hash, key)
            if old is not key:  # already held: another physical copy
                self._copy(engine_hash, old, result)
                continue
            mask = get_holders(key)
            if mask is None:
                holders[key] = bit
            elif mask & bit:
                aliases[key] = aliases.get(key, 0) + 1
            else:
                holders[key] = mask | bit
            added += 1
        self.blocks += added
        result.stored += added
        return added

    def insert(self, hashes: list[int], entries: Sequence[Entry], bit: int, result: ApplyResult) -> int:
        """Map each folded engine hash to its entry and mark the entry's keys held. Returns blocks added."""
        mapping, holders, aliases = self.hashes, self.holders, self.aliases
        added = 0
        for engine_hash, entry in zip(hashes, entries, strict=True):
            old = mapping.get(engine_hash)  # not setdefault: entries may be objects already stored here
            if old is not None:
                self._copy(engine_hash, old, result)
                continue
            mapping[engine_hash] = entry
            if not isinstance(entry, int):
                self.rechunked = True
            for key in _keys(entry):
                mask = holders.get(key)
                if mask is None:
                    holders[key] = bit
                elif mask & bit:
                    aliases[key] = aliases.get(key, 0) + 1
                else:
                    holders[key] = mask | bit
                added += 1
        self.blocks += added
        result.stored += added
        return added

    def _copy(self, engine_hash: int, entry: Entry, result: ApplyResult) -> None:
        """An engine hash stored again while held: count the copy, keep its entry, make it most recent.

        The first entry is kept even if the new tokens hash differently (an engine-hash collision,
        or a publisher bug): its keys are the ones marked held, so they are the ones to release.
        """
        del self.hashes[engine_hash]
        self.hashes[engine_hash] = entry
        self.copies[engine_hash] = self.copies.get(engine_hash, 0) + 1
        result.duplicates += 1

    def remove(self, engine_hashes: Sequence[int], bit: int, result: ApplyResult) -> int:
        """Drop one copy of each (unfolded) engine hash; returns the blocks no longer held."""
        mapping, copies, aliases, holders = self.hashes, self.copies, self.aliases, self.holders
        released = 0
        for engine_hash in engine_hashes:
            engine_hash &= KEY_MASK
            if copies and engine_hash in copies:  # one of several copies: the block stays held
                _decrement(copies, engine_hash)
                result.removed_copies += 1
                continue
            entry = mapping.pop(engine_hash, None)
            if entry is None:  # settled, or unknown: the index flushes them at the end of the batch
                self.pending.append(engine_hash)
            elif isinstance(entry, int) and not (aliases and entry in aliases):  # the common case, inline
                mask = holders.get(entry, 0)
                if mask == bit:
                    del holders[entry]
                elif mask & bit:
                    holders[entry] = mask & ~bit
                released += 1
            else:
                released += self._release(entry, bit)
        self.blocks -= released
        result.removed += released
        return released

    def _release(self, entry: Entry, bit: int) -> int:
        """Un-hold the keys of an entry just taken out of ``hashes``; returns how many (caller counts)."""
        holders, aliases = self.holders, self.aliases
        keys = _keys(entry)
        for key in keys:
            if aliases and key in aliases:  # another engine hash still maps to this key
                _decrement(aliases, key)
                continue
            mask = holders.get(key, 0)
            if mask == bit:
                del holders[key]
            elif mask & bit:
                holders[key] = mask & ~bit
        return len(keys)

    def flush(self, bit: int, result: ApplyResult) -> int:
        """Take the pending removals from the settled layer (one array search for the batch's lot)."""
        if not len(self.settled):
            result.unknown_removals += len(self.pending)
            self.pending = []
            return 0
        keys, unknown = self.settled.take(np.array(self.pending, np.uint64))
        self.pending = []
        self._release_settled(keys, bit)
        released = len(keys)
        self.blocks -= released
        result.removed += released
        result.unknown_removals += unknown
        return released

    def _release_settled(self, keys: U64, bit: int) -> None:
        """Un-hold settled keys whose rows were just removed."""
        aliases = self.settled_aliases
        if aliases:
            kept: list[int] = []
            for key in keys.tolist():
                if key in aliases:  # another settled engine hash still maps to this key
                    _decrement(aliases, key)
                else:
                    kept.append(key)
            keys = np.array(kept, np.uint64)
        self.settled_holders.release(keys, bit)

    def evict(self, need: int, bit: int) -> int:
        """Drop the least recently stored entries until ``need`` blocks are gone (or none is left):
        settled ones first (oldest settling round first), then recent ones.

        Recent ones in one pass from the front of ``hashes``: CPython leaves deleted slots there until
        the next resize, so callers evict in batches rather than one block per call.
        """
        released = 0
        if len(self.settled):
            keys, hashes = self.settled.evict(need)
            if self.copies:
                for engine_hash in hashes.tolist():
                    self.copies.pop(engine_hash, None)
            self._release_settled(keys, bit)
            released = len(keys)
            need -= released
        victims: list[int] = []
        found = 0
        if need > 0:
            for engine_hash, entry in self.hashes.items():
                victims.append(engine_hash)
                found += 1 if isinstance(entry, int) else len(entry)
                if found >= need:
                    break
        for engine_hash in victims:
            self.copies.pop(engine_hash, None)
            released += self._release(self.hashes.pop(engine_hash), bit)
        self.blocks -= released
        return released

    def clear(self, bit: int) -> int:
        """Drop everything; returns how many blocks that was."""
        holders = self.holders
        for entry in self.hashes.values():
            for key in _keys(entry):
                mask = holders.get(key, 0)
                if mask == bit:
                    del holders[key]
                elif mask & bit:
                    holders[key] = mask & ~bit
        if len(self.settled):
            self.settled_holders.release(np.unique(self.settled.clear()), bit)
        dropped = self.blocks
        self.hashes, self.copies, self.aliases, self.blocks = {}, {}, {}, 0
        self.settled_aliases, self.pending, self.rechunked = {}, [], False
        return dropped

    def absorb_copies(self, epoch: int, bit: int) -> int:
        """Recent entries whose engine hash is also settled (stored again since it settled) become a
        copy of the settled entry, now as recent as ``epoch``; returns the blocks no longer counted twice.
        """
        if not self.hashes or not len(self.settled):
            return 0
        return self._absorb(np.fromiter(self.hashes, np.uint64, len(self.hashes)), epoch, bit)

    def _absorb(self, engine_hashes: U64, epoch: int, bit: int) -> int:
        again = self.settled.live(engine_hashes)
        if not again.any():
            return 0
        repeated = engine_hashes[again]
        self.settled.refresh(repeated, epoch)
        dropped = 0
        for engine_hash in repeated.tolist():
            self.copies[engine_hash] = self.copies.get(engine_hash, 0) + 1
            dropped += self._release(self.hashes.pop(engine_hash), bit)
        self.blocks -= dropped
        return dropped

    def settle(self, epoch: int, bit: int) -> int:
        """Move the recent entries to the settled layer; returns the blocks that turned out to be
        copies of settled entries (:meth:`absorb_copies`).

        The index merges the recent holders dict into the settled holders afterwards.
        """
        if not self.hashes:
            return 0
        engine_hashes = np.fromiter(self.hashes, np.uint64, len(self.hashes))
        dropped = self._absorb(engine_hashes, epoch, bit) if len(self.settled) else 0
        if dropped:
            engine_hashes = np.fromiter(self.hashes, np.uint64, len(self.hashes))
        if not self.rechunked:
            keys = np.fromiter(self.hashes.values(), np.uint64, len(self.hashes))
        else:  # re-chunked blocks: one row per index block
            rows = [(h, key) for h, entry in self.hashes.items() for key in _keys(entry)]
            engine_hashes = np.array([h for h, _ in rows], np.uint64)
            keys = np.array([key for _, key in rows], np.uint64)
        self.settled.merge(engine_hashes, keys, epoch, rechunked=self.rechunked)
        settled_aliases = self.settled_aliases
        for key, count in self.aliases.items():
            settled_aliases[key] = settled_aliases.get(key, 0) + count
        self.hashes, self.aliases, self.rechunked = {}, {}, False
        return dropped

    def find(self, engine_hash: int) -> Entry | None:
        """The entry of a folded engine hash in either layer, recent first."""
        entry = self.hashes.get(engine_hash)
        if entry is None and len(self.settled):
            entry = self.settled.find(engine_hash)
        return entry

    def engine_hashes(self) -> int:
        """Engine hashes held (an engine block re-chunked k ways is one)."""
        return len(self.hashes) + self.settled.entries()


class SourceState:
    """A registered source: its slot bit, settings, tiers and flags."""

    __slots__ = ("bit", "block_size", "complete", "gpu", "lower", "mismatched", "namespace", "seed", "source")

    def __init__(self, source: Source, slot: int, namespace: str, block_size: int, gpu: Tier) -> None:
        self.source = source
        self.bit = 1 << slot
        self.namespace = namespace
        self.seed = namespace_seed(namespace)
        self.block_size = block_size
        self.gpu = gpu
        #: Every medium but the GPU (CPU, storage, ...), made on first use.
        self.lower: Tier | None = None
        self.complete = True
        #: The last event block size that could not be re-chunked to ``block_size``.
        self.mismatched: int | None = None

    @property
    def slot(self) -> int:
        return self.bit.bit_length() - 1

    def tiers(self) -> tuple[Tier, ...]:
        """Lower tier first: the order bounds evict in."""
        return (self.gpu,) if self.lower is None else (self.lower, self.gpu)

    def blocks(self) -> int:
        return self.gpu.blocks + (0 if self.lower is None else self.lower.blocks)

    def find(self, engine_hash: int) -> Entry | None:
        """The entry of a folded engine hash on any tier, GPU first."""
        entry = self.gpu.find(engine_hash)
        if entry is None and self.lower is not None:
            entry = self.lower.find(engine_hash)
        return entry


def _keys(entry: Entry) -> tuple[int, ...]:
    """The keys of an entry: our key, or a re-chunked block's k keys in order."""
    return (entry,) if isinstance(entry, int) else entry


def _decrement(counts: dict[int, int], key: int) -> None:
    """One less in a sparse count dict (entries hold counts >= 1)."""
    count = counts[key]
    if count == 1:
        del counts[key]
    else:
        counts[key] = count - 1
