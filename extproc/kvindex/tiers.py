"""One source's blocks per cache tier: engine hash -> our keys, ref counts, and its bits in ``holders``.

Internal to :mod:`extproc.kvindex.index` (which documents the layout and the invariant). A
:class:`Tier` changes its own ``blocks`` count and returns how many blocks each call added or
released, so the index can keep its total without walking the sources.

Engine hashes arrive as uint64 and are folded to 60 bits (``& KEY_MASK``) before use: a Python int
below 2**60 is a 32-byte object, one above is 48 bytes, and the index keeps one per block. Within
one source a fold collision needs two of its live hashes to agree on 60 bits (about n**2 / 2**61).
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.kvindex.events import Source
from extproc.kvindex.keys import KEY_MASK, namespace_seed
from extproc.kvindex.results import ApplyResult

#: Our key, or the k keys (in order; the last one ends the engine block) of a re-chunked block.
Entry = int | tuple[int, ...]


class Tier:
    """One source's blocks on one tier class (GPU, or every lower tier together)."""

    __slots__ = ("aliases", "blocks", "copies", "hashes", "holders")

    def __init__(self, holders: dict[int, int]) -> None:
        #: The index's key -> slot-bitmask dict for this tier class (shared by every source).
        self.holders = holders
        #: Folded engine hash -> entry; insertion order is least recently stored first.
        self.hashes: dict[int, Entry] = {}
        #: Extra copies of an engine hash (beyond the first), only for hashes stored more than once.
        self.copies: dict[int, int] = {}
        #: Extra engine hashes mapping to a key (beyond the first), only for such keys.
        self.aliases: dict[int, int] = {}
        #: Index blocks held: the keys of every entry of ``hashes``, counted with repetition.
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
            for key in (entry,) if isinstance(entry, int) else entry:
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
            if entry is None:
                result.unknown_removals += 1
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
        keys: tuple[int, ...] = (entry,) if isinstance(entry, int) else entry
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

    def evict(self, need: int, bit: int) -> int:
        """Drop the least recently stored entries until ``need`` blocks are gone (or none is left).

        One pass from the front of ``hashes``: CPython leaves deleted slots there until the next
        resize, so callers evict in batches rather than one block per call.
        """
        victims: list[int] = []
        found = 0
        for engine_hash, entry in self.hashes.items():
            victims.append(engine_hash)
            found += 1 if isinstance(entry, int) else len(entry)
            if found >= need:
                break
        released = 0
        for engine_hash in victims:
            self.copies.pop(engine_hash, None)
            released += self._release(self.hashes.pop(engine_hash), bit)
        self.blocks -= released
        return released

    def clear(self, bit: int) -> int:
        """Drop everything; returns how many blocks that was."""
        holders = self.holders
        for entry in self.hashes.values():
            for key in (entry,) if isinstance(entry, int) else entry:
                mask = holders.get(key, 0)
                if mask == bit:
                    del holders[key]
                elif mask & bit:
                    holders[key] = mask & ~bit
        dropped = self.blocks
        self.hashes, self.copies, self.aliases, self.blocks = {}, {}, {}, 0
        return dropped


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
        entry = self.gpu.hashes.get(engine_hash)
        if entry is None and self.lower is not None:
            entry = self.lower.hashes.get(engine_hash)
        return entry


def _decrement(counts: dict[int, int], key: int) -> None:
    """One less in a sparse count dict (entries hold counts >= 1)."""
    count = counts[key]
    if count == 1:
        del counts[key]
    else:
        counts[key] = count - 1
