"""The prefix index: which sources hold which of our block keys, fed by domain KV events.

Pure: no sockets, no asyncio, no pods. One writer (the subscriber glue) calls :meth:`apply` per
batch; the request path calls :meth:`match` synchronously in between, so nothing needs a lock
(settling rounds in another thread aside, below).

A settling round grows with the blocks held (about a second near a fleet's default memory budget)
and with the sources (~20-30 ms for a thousand). With ``rounds_elsewhere``, :meth:`apply` runs no
round: the glue sees :meth:`round_due`, calls :meth:`begin_round` on the event loop, :meth:`run_round` in a
worker thread (numpy's copies, sorts and searches release the GIL, and the loop gets the GIL back
every few milliseconds anyway), and :meth:`end_round` on the loop again. In between, the index is
frozen as far as the loop can tell: every write (batches, sources added, dropped, cleared) waits in
order and is applied by :meth:`end_round`, and lookups read what the index held when the round
began. A lookup running beside the round is safe because the round only publishes whole tables
(:class:`~extproc.kvindex.packed.PackedHolders`) and empties a recent layer only after publishing
what replaces it, while walks read the recent layer first.

Layout: every registered :class:`Source` owns a *slot*, a bit position (freed slots are reused
lowest first so masks stay short). Blocks live in one of two layers, per tier class (GPU, and
"lower" = every other medium):

- **recent** (dicts, cheap to change, ~120 bytes a block): ``holders`` maps a key to the bitmask of
  the slots holding it (a key held by one source stores that source's own ``1 << slot`` object);
  per (source, tier) a :class:`~extproc.kvindex.tiers.Tier` maps each engine hash (folded to 60
  bits) to our key, or to the tuple of k keys of an engine block re-chunked into k index blocks, its
  insertion order the LRU order (a re-store moves the hash to the end);
- **settled** (:mod:`extproc.kvindex.packed`, flat arrays, ~20 bytes a block plus 12 a distinct
  key): once the blocks stored since the last settling pass ``max(hot_blocks, blocks / 32)``, every
  recent block moves there in one round (an *epoch*). Removals of settled blocks are collected during
  a batch and taken in one array search at its end.

Two sparse dicts per layer hold the rare counts: ``copies`` (an engine hash stored again while held:
vLLM may hold two physical copies and removes them one by one) and ``aliases`` (several engine hashes
mapping to one key, e.g. the same tokens under different ``cache_salt`` or image hashes, which our
keys do not see).

Invariant, per layer of a tier of a source and per key K: the source's bit is set in that layer's
holders for K iff some engine hash of that layer maps to K, and then the layer's ``aliases[K]`` + 1
is how many such mappings there are. A source holds K if either layer says so. An engine hash stored
again after it settled is a second mapping in the recent layer until the next settling finds it
and counts it as a copy.

Bounds: a source holding more than ``max_entries_per_source`` blocks (both tiers together) loses
its least recently stored ones (settled before recent, oldest epoch first), lower tiers first; past
``max_entries`` in total the source holding the most blocks loses its oldest. Each round evicts
1/64 of the bound extra, so the work is done in batches, not once per block. Lookups do not refresh
recency: the engine's own BlockRemoved is the real eviction signal, these bounds are a backstop for
lost removals and hostile streams.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections.abc import Callable, Iterable, Sequence

from extproc.kvindex.events import GPU_MEDIA, BlockRemoved, BlockStored, DecodedBatch, Source
from extproc.kvindex.keys import KEY_MASK, block_keys, namespace_seed
from extproc.kvindex.packed import PackedHolders
from extproc.kvindex.results import ApplyResult, IndexStats, SourceStats
from extproc.kvindex.tiers import Entry, SourceState, Tier
from extproc.kvindex.walk import Holdings, walk

#: Blocks stored before the first settling (a small index stays in dicts, the fastest layer).
HOT_BLOCKS = 65_536
#: Past that, a settling round once the blocks stored since the last one pass 1/32 of all blocks.
SETTLE_FRACTION = 32
#: Bytes a block costs at most, as measured (bench/results/kvindex.md: 23-34 settled, plus the
#: recent layer's share): what a memory budget is divided by.
BYTES_PER_BLOCK = 40
#: Slots are 16 bits wide in nothing but this bound: more sources than any fleet registers at once.
MAX_SOURCES = 65_535


def blocks_within(memory_bytes: int) -> int:
    """The block bound that keeps the index within ``memory_bytes``."""
    return max(1, memory_bytes // BYTES_PER_BLOCK)


class PrefixIndex:
    """Longest cached prefix per source, in our own block keys (:mod:`extproc.kvindex.keys`)."""

    def __init__(
        self,
        *,
        max_entries: int,
        max_entries_per_source: int,
        hot_blocks: int = HOT_BLOCKS,
        rounds_elsewhere: bool = False,
    ) -> None:
        if min(max_entries, max_entries_per_source, hot_blocks) < 1:
            raise ValueError(
                f"bounds must be >= 1, got {max_entries=} {max_entries_per_source=} {hot_blocks=}"
            )
        self._max_entries = max_entries
        self._max_per_source = max_entries_per_source
        self._hot_blocks = hot_blocks
        self._gpu: dict[int, int] = {}
        self._lower: dict[int, int] = {}
        self._settled_gpu = PackedHolders()
        self._settled_lower = PackedHolders()
        #: Tiers with removals waiting for :meth:`Tier.flush`, and their slot bits.
        self._pending: list[tuple[Tier, int]] = []
        self._epoch = 0
        self._settle_seconds_max = 0.0
        self._stored_since_settle = 0
        self._settle_at = hot_blocks
        self._states: dict[Source, SourceState] = {}
        self._by_slot: list[SourceState | None] = []
        self._free_slots: list[int] = []
        self._all_bits = 0
        self._blocks = 0
        self._totals = ApplyResult()
        #: Rounds are left to the caller (:meth:`round_due`).
        self._rounds_elsewhere = rounds_elsewhere
        #: While a round runs elsewhere: the writes that wait for it, in order, and the stats then.
        self._deferred: list[tuple[Callable[..., object], tuple[object, ...]]] | None = None
        self._added_in_round: set[Source] = set()
        self._stats_at_round: IndexStats | None = None

    # --- rounds elsewhere -----------------------------------------------------------------------

    def round_due(self) -> bool:
        """A round is due that :meth:`apply` left to the caller (never while one runs)."""
        due = self._stored_since_settle >= self._settle_at
        return due and self._rounds_elsewhere and self._deferred is None

    @property
    def in_round(self) -> bool:
        """Between :meth:`begin_round` and :meth:`end_round`."""
        return self._deferred is not None

    def begin_round(self) -> None:
        """From now until :meth:`end_round`, writes wait; call :meth:`run_round` (in a thread)."""
        if self._deferred is not None:
            raise RuntimeError("a settling round is already running")
        self._stats_at_round = self.stats()
        self._deferred = []

    def run_round(self) -> float:
        """The round itself (the one call that may run in another thread); returns its seconds."""
        if self._deferred is None:
            raise RuntimeError("run_round outside begin_round / end_round")
        took = self._settle()
        self._totals.settle_seconds += took
        return took

    def end_round(self) -> None:
        """Apply the writes that waited, in order."""
        deferred, self._deferred = self._deferred or [], None
        self._stats_at_round = None
        self._added_in_round.clear()
        for write, args in deferred:
            with contextlib.suppress(KeyError):  # a write for a source dropped meanwhile
                write(*args)

    def _defer(self, write: Callable[..., object], *args: object) -> bool:
        if self._deferred is None:
            return False
        self._deferred.append((write, args))
        return True

    # --- sources -------------------------------------------------------------------------------

    def add_source(self, source: Source, *, namespace: str, block_size: int) -> None:
        """Register a source; ``block_size`` is the worker set's ``kvBlockSize`` (tokens per index block).

        Registering it again with the same settings keeps its blocks; with other settings its blocks
        are dropped (keys at another block size or namespace could never match again).
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if self._defer(self._add_source, source, namespace, block_size):
            self._added_in_round.add(source)
            return
        self._add_source(source, namespace, block_size)

    def _add_source(self, source: Source, namespace: str, block_size: int) -> None:
        state = self._states.get(source)
        if state is not None:
            if (state.namespace, state.block_size) != (namespace, block_size):
                self._clear(state)
                state.namespace, state.seed = namespace, namespace_seed(namespace)
                state.block_size, state.mismatched = block_size, None
            return
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._by_slot)
        if slot == MAX_SOURCES:
            raise ValueError(f"the index holds at most {MAX_SOURCES} sources at once")
        if slot == len(self._by_slot):
            self._by_slot.append(None)
        state = SourceState(source, slot, namespace, block_size, Tier(self._gpu, self._settled_gpu))
        self._by_slot[slot] = state
        self._states[source] = state
        self._all_bits |= state.bit

    def drop_source(self, source: Source) -> None:
        """Forget a source and all its blocks (endpoint gone). Unknown sources are ignored."""
        if self._defer(self.drop_source, source):
            return
        state = self._states.pop(source, None)
        if state is None:
            return
        self._clear(state)
        self._all_bits &= ~state.bit
        self._by_slot[state.slot] = None
        heapq.heappush(self._free_slots, state.slot)

    def clear_source(self, source: Source) -> None:
        """Drop a source's blocks but keep it registered (publisher restarted: history is gone)."""
        if not self._defer(self.clear_source, source):
            self._clear(self._states[source])

    def set_complete(self, source: Source, complete: bool) -> None:
        """Record whether the source's stream is its publisher's whole history (set by the glue)."""
        if not self._defer(self.set_complete, source, complete):
            self._states[source].complete = complete

    def incomplete_sources(self) -> frozenset[Source]:
        return frozenset(s for s, state in self._states.items() if not state.complete)

    def sources(self) -> list[Source]:
        return list(self._states)

    def blocks(self) -> int:
        """Index blocks held, all sources and tiers (O(1); :meth:`stats` has the rest)."""
        return self._blocks

    # --- events --------------------------------------------------------------------------------

    def apply(self, source: Source, batch: DecodedBatch) -> ApplyResult:
        """Apply one decoded batch of ``source``'s events, in order. Raises KeyError for unknown sources.

        During a round run elsewhere the batch waits for :meth:`end_round` (an empty result now)."""
        if self._deferred is not None:
            if source not in self._states and source not in self._added_in_round:
                raise KeyError(source)
            self._deferred.append((self.apply, (source, batch)))
            return ApplyResult()
        state = self._states[source]
        result = ApplyResult(skipped=batch.skipped, ignored=batch.ignored)
        for event in batch.events:
            if type(event) is BlockRemoved:  # the most frequent event at steady state
                self._remove(state, event, result)
            elif type(event) is BlockStored:
                added = self._store(state, event, result)
                self._blocks += added
                self._stored_since_settle += added
                # Counts only over-estimate (pending removals, copies of settled blocks): past a
                # bound, _enforce_bounds makes them exact before it evicts anything.
                per_source = state.gpu.blocks if state.lower is None else state.blocks()
                if self._blocks > self._max_entries or per_source > self._max_per_source:
                    self._enforce_bounds(state, result)
            else:
                result.cleared += 1
                self._clear(state)
        if self._pending:
            self._flush(result)
        if self._stored_since_settle >= self._settle_at and not self._rounds_elsewhere:
            result.settle_seconds = self._settle()
        self._totals.add(result)
        return result

    def _flush(self, result: ApplyResult) -> None:
        """Take the batch's removals of settled blocks from the settled layer."""
        for tier, bit in self._pending:
            if tier.pending:
                self._blocks -= tier.flush(bit, result)
        self._pending = []

    def _settle(self) -> float:
        """Move every recent block to the settled layer (one epoch). Its time is the loop's: about
        40 ms per million blocks held (bench/results/kvindex.md), counted in :meth:`stats`."""
        started = time.perf_counter()
        self._epoch += 1
        for state in self._states.values():
            for tier in state.tiers():
                self._blocks -= tier.settle(self._epoch, state.bit)
        layers = ((self._gpu, self._settled_gpu, False), (self._lower, self._settled_lower, True))
        wide = not self._masks_fit_words()
        for recent, settled, lower in layers:
            if not recent:
                continue
            for key, bits in settled.merge(recent, wide=wide):  # a key held in both layers: one more mapping
                while bits:
                    low = bits & -bits
                    aliases = self._tier_at(low.bit_length() - 1, lower).settled_aliases
                    aliases[key] = aliases.get(key, 0) + 1
                    bits ^= low
            recent.clear()
        self._stored_since_settle = 0
        self._settle_at = max(self._hot_blocks, self._blocks // SETTLE_FRACTION)
        took = time.perf_counter() - started
        self._settle_seconds_max = max(self._settle_seconds_max, took)
        return took

    def _masks_fit_words(self) -> bool:
        """Every slot ever given out is below 64: holder masks fit a uint64."""
        return len(self._by_slot) <= 64

    def _tier_at(self, slot: int, lower: bool) -> Tier:
        state = self._by_slot[slot]
        tier = None if state is None else state.lower if lower else state.gpu
        if tier is None:  # settled holders name only registered sources' tiers
            raise AssertionError(f"slot {slot} holds settled keys but has no tier ({lower=})")
        return tier

    def _store(self, state: SourceState, event: BlockStored, result: ApplyResult) -> int:
        """Store one event's blocks; returns how many became held."""
        count = len(event.engine_hashes)
        tier = state.gpu if event.medium in GPU_MEDIA else self._lower_tier(state)
        tokens = event.token_ids
        if not tokens:
            return self._store_by_hash(state, tier, event, result)
        if count == 0 or event.block_size < 1 or len(tokens) != count * event.block_size:
            result.invalid += count
            return 0
        k, rest = divmod(event.block_size, state.block_size)
        if rest or not k:
            result.mismatched += count
            state.mismatched = event.block_size
            return 0
        parent = event.parent_engine_hash
        if parent is None:
            if event.lora_name is None and event.cache_salt is None:
                seed = state.seed
            else:
                seed = namespace_seed(event.lora_name or state.namespace, event.cache_salt)
            keys = block_keys(tokens, state.block_size, seed)
        else:
            parent &= KEY_MASK
            entry = state.gpu.hashes.get(parent)  # the usual case, inline: a parent stored recently
            if entry is None:
                entry = state.find(parent)
                if entry is None:
                    result.unresolved += count
                    return 0
            keys = block_keys(tokens, state.block_size, 0, entry if isinstance(entry, int) else entry[-1])
        if k == 1:
            return tier.insert_keys(event.engine_hashes, keys, state.bit, result)
        chunks = [tuple(keys[i : i + k]) for i in range(0, len(keys), k)]
        return tier.insert([h & KEY_MASK for h in event.engine_hashes], chunks, state.bit, result)

    @staticmethod
    def _store_by_hash(state: SourceState, tier: Tier, event: BlockStored, result: ApplyResult) -> int:
        """A BlockStored without tokens (offload tiers): each hash's keys come from the tier that has it."""
        hashes: list[int] = []
        entries: list[Entry] = []
        for engine_hash in event.engine_hashes:
            entry = state.find(engine_hash & KEY_MASK)
            if entry is None:
                result.unresolved += 1
            else:
                hashes.append(engine_hash & KEY_MASK)
                entries.append(entry)
        return tier.insert(hashes, entries, state.bit, result)

    def _remove(self, state: SourceState, event: BlockRemoved, result: ApplyResult) -> None:
        tier = state.gpu if event.medium in GPU_MEDIA else state.lower
        if tier is None:
            result.unknown_removals += len(event.engine_hashes)
            return
        had_pending = bool(tier.pending)
        self._blocks -= tier.remove(event.engine_hashes, state.bit, result)
        if tier.pending and not had_pending:
            self._pending.append((tier, state.bit))

    def _lower_tier(self, state: SourceState) -> Tier:
        if state.lower is None:
            state.lower = Tier(self._lower, self._settled_lower)
        return state.lower

    def _clear(self, state: SourceState) -> None:
        """Drop every block of ``state`` on every tier (its pending removals with them)."""
        for tier in state.tiers():
            self._blocks -= tier.clear(state.bit)

    # --- bounds --------------------------------------------------------------------------------

    def _enforce_bounds(self, state: SourceState, result: ApplyResult) -> None:
        if self._pending:  # the counts must be exact before anything is evicted
            self._flush(result)
        if state.blocks() > self._max_per_source:
            self._absorb_copies(state)
            if state.blocks() > self._max_per_source:
                self._shrink(state, state.blocks() - self._max_per_source, self._max_per_source, result)
        while self._blocks > self._max_entries:  # the source holding the most blocks pays
            largest = max(self._states.values(), key=SourceState.blocks)
            if self._absorb_copies(largest):
                continue
            self._shrink(largest, self._blocks - self._max_entries, self._max_entries, result)

    def _absorb_copies(self, state: SourceState) -> int:
        """Count blocks stored again since they settled once (see :meth:`Tier.absorb_copies`)."""
        dropped = sum(tier.absorb_copies(self._epoch + 1, state.bit) for tier in state.tiers())
        self._blocks -= dropped
        return dropped

    def _shrink(self, state: SourceState, excess: int, bound: int, result: ApplyResult) -> None:
        """Evict ``excess`` blocks plus 1/64 of ``bound`` from ``state``, oldest first, lower tiers first."""
        need = excess + (bound >> 6)
        for tier in state.tiers():
            if need > 0:
                evicted = tier.evict(need, state.bit)
                self._blocks -= evicted
                result.evicted += evicted
                need -= evicted

    # --- lookups -------------------------------------------------------------------------------

    def block_size_mismatch(self, source: Source) -> tuple[int, int] | None:
        """(the worker set's kvBlockSize, the engine's) when ``source`` sent blocks of a size that is
        not a multiple of it (those events are skipped), else None."""
        state = self._states.get(source)
        if state is None or state.mismatched is None:
            return None
        return state.block_size, state.mismatched

    def has_lower_tier(self, source: Source) -> bool:
        """``source`` has announced blocks on an offload tier (CPU, storage): worth a second lookup."""
        state = self._states.get(source)
        return state is not None and state.lower is not None

    def has_lower_tiers(self) -> bool:
        """Some source holds blocks on an offload tier now: a lookup across tiers can differ."""
        return bool(self._lower) or len(self._settled_lower) > 0

    def match(
        self, keys: Sequence[int], sources: Iterable[Source] | None = None, *, lower_tiers: bool = False
    ) -> dict[Source, int]:
        """For each source, how many leading ``keys`` it holds (its longest cached prefix, in blocks).

        ``sources`` defaults to every registered source; unregistered ones asked for get 0.
        ``lower_tiers`` counts a block held on any tier (GPU or offload) instead of GPU only.
        Every source asked for is in the answer, so this costs O(sources); the request path uses
        :meth:`holders`, whose cost follows the matched blocks.
        """
        if sources is None:
            result = dict.fromkeys(self._states, 0)
            mask = self._all_bits
        else:
            result, mask = {}, 0
            for source in sources:
                result[source] = 0
                state = self._states.get(source)
                if state is not None:
                    mask |= state.bit
        if mask:
            result.update(self._walk(keys, mask, lower_tiers))
        return result

    def holders(self, keys: Sequence[int], *, lower_tiers: bool = False) -> dict[Source, int]:
        """The sources holding at least the first of ``keys``, with how many leading keys each holds.

        Cost: it follows the matched blocks and their holders, not how many sources are registered
        (a source absent from the answer holds nothing of the prompt); see :mod:`extproc.kvindex.walk`.
        """
        return self._walk(keys, self._all_bits, lower_tiers) if self._all_bits else {}

    def _walk(self, keys: Sequence[int], mask: int, lower_tiers: bool) -> dict[Source, int]:
        result: dict[Source, int] = {}
        lower_tiers = lower_tiers and self.has_lower_tiers()

        def record(bits: int, length: int) -> None:
            self._record(bits, length, result)

        holdings = Holdings(
            self._gpu,
            self._settled_gpu,
            (self._lower, self._settled_lower) if lower_tiers else None,
            words=self._masks_fit_words(),
        )
        position, mask = walk(keys, mask, holdings, record)
        if position:
            self._record(mask, position, result)
        return result

    def _record(self, bits: int, length: int, result: dict[Source, int]) -> None:
        """``result[source] = length`` for every source whose slot bit is set in ``bits``."""
        by_slot = self._by_slot
        if not bits & (bits - 1):  # zero or one source: no need to scan
            if bits:
                result[by_slot[bits.bit_length() - 1].source] = length  # type: ignore[union-attr]
            return
        digits = bin(bits)[:1:-1]  # least significant first: digits[slot] == "1"
        slot = digits.find("1")
        while slot >= 0:
            result[by_slot[slot].source] = length  # type: ignore[union-attr]
            slot = digits.find("1", slot + 1)

    # --- introspection -------------------------------------------------------------------------

    def stats(self) -> IndexStats:
        """Sizes and counters for metrics and /debug (O(sources)); during a round run elsewhere,
        as they were when it began."""
        if self._stats_at_round is not None:
            return self._stats_at_round
        totals = ApplyResult()
        totals.add(self._totals)
        sources = {
            source: SourceStats(
                namespace=state.namespace,
                block_size=state.block_size,
                gpu_blocks=state.gpu.blocks,
                lower_blocks=0 if state.lower is None else state.lower.blocks,
                engine_hashes=sum(tier.engine_hashes() for tier in state.tiers()),
                complete=state.complete,
                mismatched_block_size=state.mismatched,
            )
            for source, state in self._states.items()
        }
        tiers = [tier for state in self._states.values() for tier in state.tiers()]
        return IndexStats(
            gpu_keys=len(self._gpu) + len(self._settled_gpu),
            lower_keys=len(self._lower) + len(self._settled_lower),
            settle_rounds=self._epoch,
            settle_seconds_max=self._settle_seconds_max,
            settled_blocks=sum(len(tier.settled) for tier in tiers),
            settled_bytes=sum(tier.settled.nbytes() for tier in tiers)
            + self._settled_gpu.nbytes()
            + self._settled_lower.nbytes(),
            blocks=self._blocks,
            max_entries=self._max_entries,
            max_entries_per_source=self._max_per_source,
            totals=totals,
            sources=sources,
        )
