"""The prefix index: which sources hold which of our block keys, fed by domain KV events.

Pure: no sockets, no asyncio, no pods. One writer (the subscriber glue) calls :meth:`apply` per
batch; the request path calls :meth:`match` synchronously in between, so nothing needs a lock.

Layout (designed for CPython's costs: few objects per block, work per event, bit ops per lookup):

- every registered :class:`Source` owns a *slot*, a bit position; freed slots are reused lowest
  first so masks stay short;
- ``holders``: ``dict[key, int]`` per tier class (GPU, and "lower" = every other medium), the
  int a bitmask of the slots holding the key. A key held by one source stores that source's own
  ``1 << slot`` object, so single-holder keys cost no mask object;
- per (source, tier) a :class:`~extproc.kvindex.tiers.Tier`: ``hashes`` maps each engine hash
  (folded to 60 bits) to our key, or to the tuple of k keys of an engine block re-chunked into k
  index blocks; its insertion order *is* the LRU order (a re-store moves the hash to the end).
  Two sparse dicts hold the rare counts: ``copies`` (an engine hash stored again while held: vLLM
  may hold two physical copies and removes them one by one) and ``aliases`` (several engine hashes
  mapping to one key, e.g. the same tokens under different ``cache_salt`` or image hashes, which
  our keys do not see).

Invariant, per tier of a source and per key K: ``bit in holders[K]`` iff some engine hash of the
tier maps to K, and then ``aliases[K]`` + 1 is how many such mappings there are.

Bounds: a source holding more than ``max_entries_per_source`` blocks (both tiers together) loses
its least recently stored ones, lower tiers first; past ``max_entries`` in total the source holding
the most blocks loses its oldest. Each round evicts 1/64 of the bound extra, so the front of a dict
(where CPython leaves deleted slots until the next resize) is scanned once per 1/64 of the bound,
not once per block. Lookups do not refresh recency: the engine's own BlockRemoved is the real
eviction signal, these bounds are a backstop for lost removals and hostile streams.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from extproc.kvindex.events import GPU_MEDIA, BlockRemoved, BlockStored, DecodedBatch, Source
from extproc.kvindex.keys import KEY_MASK, block_keys, namespace_seed
from extproc.kvindex.results import ApplyResult, IndexStats, SourceStats
from extproc.kvindex.tiers import Entry, SourceState, Tier


class PrefixIndex:
    """Longest cached prefix per source, in our own block keys (:mod:`extproc.kvindex.keys`)."""

    def __init__(self, *, max_entries: int, max_entries_per_source: int) -> None:
        if max_entries < 1 or max_entries_per_source < 1:
            raise ValueError(f"bounds must be >= 1, got {max_entries=} {max_entries_per_source=}")
        self._max_entries = max_entries
        self._max_per_source = max_entries_per_source
        self._gpu: dict[int, int] = {}
        self._lower: dict[int, int] = {}
        self._states: dict[Source, SourceState] = {}
        self._by_slot: list[SourceState | None] = []
        self._free_slots: list[int] = []
        self._all_bits = 0
        self._blocks = 0
        self._totals = ApplyResult()

    # --- sources -------------------------------------------------------------------------------

    def add_source(self, source: Source, *, namespace: str, block_size: int) -> None:
        """Register a source; ``block_size`` is the worker set's ``kvBlockSize`` (tokens per index block).

        Registering it again with the same settings keeps its blocks; with other settings its blocks
        are dropped (keys at another block size or namespace could never match again).
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        state = self._states.get(source)
        if state is not None:
            if (state.namespace, state.block_size) != (namespace, block_size):
                self._clear(state)
                state.namespace, state.seed = namespace, namespace_seed(namespace)
                state.block_size, state.mismatched = block_size, None
            return
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._by_slot)
        if slot == len(self._by_slot):
            self._by_slot.append(None)
        state = SourceState(source, slot, namespace, block_size, Tier(self._gpu))
        self._by_slot[slot] = state
        self._states[source] = state
        self._all_bits |= state.bit

    def drop_source(self, source: Source) -> None:
        """Forget a source and all its blocks (endpoint gone). Unknown sources are ignored."""
        state = self._states.pop(source, None)
        if state is None:
            return
        self._clear(state)
        self._all_bits &= ~state.bit
        self._by_slot[state.slot] = None
        heapq.heappush(self._free_slots, state.slot)

    def clear_source(self, source: Source) -> None:
        """Drop a source's blocks but keep it registered (publisher restarted: history is gone)."""
        self._clear(self._states[source])

    def set_complete(self, source: Source, complete: bool) -> None:
        """Record whether the source's stream is its publisher's whole history (set by the glue)."""
        self._states[source].complete = complete

    def incomplete_sources(self) -> frozenset[Source]:
        return frozenset(s for s, state in self._states.items() if not state.complete)

    def sources(self) -> list[Source]:
        return list(self._states)

    # --- events --------------------------------------------------------------------------------

    def apply(self, source: Source, batch: DecodedBatch) -> ApplyResult:
        """Apply one decoded batch of ``source``'s events, in order. Raises KeyError for unknown sources."""
        state = self._states[source]
        result = ApplyResult(skipped=batch.skipped, ignored=batch.ignored)
        for event in batch.events:
            if type(event) is BlockRemoved:  # the most frequent event at steady state
                self._remove(state, event, result)
            elif type(event) is BlockStored:
                self._store(state, event, result)
                # A cheap over-approximation of "a bound is exceeded"; _enforce_bounds checks exactly.
                over = self._blocks > self._max_entries or state.gpu.blocks > self._max_per_source
                if over or state.lower is not None:
                    self._enforce_bounds(state, result)
            else:
                result.cleared += 1
                self._clear(state)
        self._totals.add(result)
        return result

    def _store(self, state: SourceState, event: BlockStored, result: ApplyResult) -> None:
        count = len(event.engine_hashes)
        tier = state.gpu if event.medium in GPU_MEDIA else self._lower_tier(state)
        tokens = event.token_ids
        if not tokens:
            self._blocks += self._store_by_hash(state, tier, event, result)
            return
        if count == 0 or event.block_size < 1 or len(tokens) != count * event.block_size:
            result.invalid += count
            return
        k, rest = divmod(event.block_size, state.block_size)
        if rest or not k:
            result.mismatched += count
            state.mismatched = event.block_size
            return
        parent = event.parent_engine_hash
        if parent is None:
            if event.lora_name is None and event.cache_salt is None:
                seed = state.seed
            else:
                seed = namespace_seed(event.lora_name or state.namespace, event.cache_salt)
            keys = block_keys(tokens, state.block_size, seed)
        else:
            parent &= KEY_MASK
            entry = state.gpu.hashes.get(parent)
            if entry is None:
                entry = state.find(parent)
                if entry is None:
                    result.unresolved += count
                    return
            keys = block_keys(tokens, state.block_size, 0, entry if isinstance(entry, int) else entry[-1])
        if k == 1:
            self._blocks += tier.insert_keys(event.engine_hashes, keys, state.bit, result)
        else:
            chunks = [tuple(keys[i : i + k]) for i in range(0, len(keys), k)]
            self._blocks += tier.insert(
                [h & KEY_MASK for h in event.engine_hashes], chunks, state.bit, result
            )

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
        else:
            self._blocks -= tier.remove(event.engine_hashes, state.bit, result)

    def _lower_tier(self, state: SourceState) -> Tier:
        if state.lower is None:
            state.lower = Tier(self._lower)
        return state.lower

    def _clear(self, state: SourceState) -> None:
        """Drop every block of ``state`` on every tier."""
        for tier in state.tiers():
            self._blocks -= tier.clear(state.bit)

    # --- bounds --------------------------------------------------------------------------------

    def _enforce_bounds(self, state: SourceState, result: ApplyResult) -> None:
        if state.blocks() > self._max_per_source:
            self._shrink(state, state.blocks() - self._max_per_source, self._max_per_source, result)
        while self._blocks > self._max_entries:  # the source holding the most blocks pays
            largest = max(self._states.values(), key=SourceState.blocks)
            self._shrink(largest, self._blocks - self._max_entries, self._max_entries, result)

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
        return bool(self._lower)

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

        Cost: one dict lookup and two bit operations per key until no source is left, plus one
        entry per holder: it follows the matched blocks and their holders, not how many sources
        are registered (a source absent from the answer holds nothing of the prompt).
        """
        return self._walk(keys, self._all_bits, lower_tiers) if self._all_bits else {}

    def _walk(self, keys: Sequence[int], mask: int, lower_tiers: bool) -> dict[Source, int]:
        result: dict[Source, int] = {}
        if lower_tiers and self._lower:
            position, mask = self._walk_any_tier(keys, mask, result)
        else:
            position, mask = self._walk_gpu(keys, mask, result)
        if position:
            self._record(mask, position, result)
        return result

    def _walk_gpu(self, keys: Sequence[int], mask: int, result: dict[Source, int]) -> tuple[int, int]:
        """Narrow ``mask`` key by key, recording each source where it drops out (after one key
        at least); returns where the walk stopped and who was still in."""
        get = self._gpu.get
        position = 0
        for key in keys:
            held = get(key, 0)
            if held != mask:  # usually equal: prefixes are contiguous, so holders narrow as we go
                held &= mask
                if held != mask:
                    if position:
                        self._record(mask ^ held, position, result)
                    mask = held
                    if not mask:
                        break
            position += 1
        return position, mask

    def _walk_any_tier(self, keys: Sequence[int], mask: int, result: dict[Source, int]) -> tuple[int, int]:
        """:meth:`_walk_gpu` counting a block held on the GPU or on a lower tier."""
        get, get_lower = self._gpu.get, self._lower.get
        position = 0
        for key in keys:
            held = (get(key, 0) | get_lower(key, 0)) & mask
            if held != mask:
                if position:
                    self._record(mask ^ held, position, result)
                mask = held
                if not mask:
                    break
            position += 1
        return position, mask

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
        """Sizes and counters for metrics and /debug (O(sources))."""
        totals = ApplyResult()
        totals.add(self._totals)
        sources = {
            source: SourceStats(
                namespace=state.namespace,
                block_size=state.block_size,
                gpu_blocks=state.gpu.blocks,
                lower_blocks=0 if state.lower is None else state.lower.blocks,
                engine_hashes=sum(len(tier.hashes) for tier in state.tiers()),
                complete=state.complete,
                mismatched_block_size=state.mismatched,
            )
            for source, state in self._states.items()
        }
        return IndexStats(
            gpu_keys=len(self._gpu),
            lower_keys=len(self._lower),
            blocks=self._blocks,
            max_entries=self._max_entries,
            max_entries_per_source=self._max_per_source,
            totals=totals,
            sources=sources,
        )
