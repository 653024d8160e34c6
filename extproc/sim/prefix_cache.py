"""vLLM v1's GPU block pool with prefix caching, for one DP rank, and the KV events it emits.

Faithful where a KV-aware router depends on it (``v1/core/block_pool.py``, ``kv_cache_manager.py``):

* Blocks are chained by content: a full block's hash covers its parent's hash, its tokens and the
  LoRA name, so equal prefixes share hashes and adapters live in separate namespaces. Partial tails
  are never hashed or cached.
* Physical blocks are ref-counted. Unreferenced blocks sit in an LRU free queue *and stay cached*
  until allocation pops them (least recently freed first); only then are they evicted, one
  ``BlockRemoved`` per hash. Requests free their blocks tail first, so tails are evicted before heads.
* Two physical blocks may hold the same hash (two requests computed the same block concurrently);
  each copy is announced and each eviction is announced, so subscribers must ref-count per hash.
* A lookup never covers the whole prompt: at least one token is recomputed (vLLM needs logits).
* Optionally a CPU offload tier (:mod:`extproc.sim.cpu_tier`) below the GPU pool: blocks are written
  through to it as they are cached, and a lookup continues into it past the GPU hit; loaded blocks
  are cached on the GPU again when their load completes (:meth:`PrefixCache.finish_load`).

Blocks are hashed by :mod:`extproc.sim.block_hash`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.sim.cpu_tier import CpuTier
from extproc.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class _Seq:
    """The blocks one running request holds, in sequence order."""

    blocks: list[int]
    #: Leading blocks already in the cache (hits plus blocks this request cached).
    num_cached: int
    lora_name: str | None
    lora_id: int | None
    cache_salt: str | None
    #: Leading offloaded (published-size) blocks already stored to, or loaded from, the CPU tier.
    num_offloaded: int = 0
    #: CPU-tier keys this request is loading (pinned there until :meth:`PrefixCache.finish_load`).
    loading: tuple[bytes, ...] = ()


class PrefixCache:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens with prefix caching.

    ``published_block_size`` (a multiple k of ``block_size``) models vLLM 0.12+ KV groups whose
    blocks are coarser than the hash granularity: events then describe aligned groups of k blocks
    (see :class:`GroupPublisher`); a CPU tier of ``cpu_blocks`` offloads at that size too. All state
    is bounded by ``num_blocks`` and ``cpu_blocks`` except the pending events, which the engine takes
    once per step.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        published_block_size: int | None = None,
        cpu_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        published = block_size if published_block_size is None else published_block_size
        if published < block_size or published % block_size:
            raise ValueError(
                f"published_block_size must be a multiple of block_size {block_size}, got {published}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.published_block_size = published
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        # Unreferenced blocks, least recently freed first; cached ones keep their hash until popped.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Hash -> the first physical block holding it; further copies (computed concurrently, rare)
        # in ``_copies``, oldest first. Ints, not a list per hash: a pool of 24,000 blocks would
        # otherwise hold 24,000 lists for the cyclic collector to walk (full collections of the
        # simulator's process took ~100 ms).
        self._cached: dict[bytes, int] = {}
        self._copies: dict[bytes, list[int]] = {}
        self._seqs: dict[str, _Seq] = {}
        self._events: list[KVEvent] = []
        self._groups = GroupPublisher(published // block_size) if published > block_size else None
        #: GPU blocks per offloaded block.
        self._k = published // block_size
        self.cpu = CpuTier(cpu_blocks, published) if cpu_blocks else None
        #: Prompt tokens looked up and tokens found cached (vLLM's prefix_cache_queries / _hits).
        self.queries = 0
        self.hits = 0
        #: The same past the GPU hit, for the CPU tier (vLLM's external_prefix_cache_queries / _hits).
        self.external_queries = 0
        self.external_hits = 0

    # -- accounting ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Unreferenced blocks, cached or not (what allocation can use)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds (0 when it holds none)."""
        seq = self._seqs.get(request_id)
        return 0 if seq is None else len(seq.blocks)

    def cached_hashes(self) -> Counter[bytes]:
        """Multiset of cached digests at the published granularity: what the events describe."""
        if self._groups is not None:
            return self._groups.cached()
        copies = self._copies
        return Counter({digest: 1 + len(copies.get(digest, ())) for digest in self._cached})

    def cpu_hashes(self) -> set[bytes]:
        """Keys the CPU tier holds (published granularity); empty without one."""
        return set() if self.cpu is None else set(self.cpu.keys())

    def take_events(self) -> list[KVEvent]:
        """The events emitted since the last call, in order: the GPU pool's, then the CPU tier's.

        vLLM's scheduler builds a step's batch the same way (block pool events, then the connector's).
        """
        events, self._events = self._events, []
        if self.cpu is not None:
            events.extend(self.cpu.take_events())
        return events

    # -- lookup and allocation -------------------------------------------------------------------

    def longest_hit(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Leading blocks of ``hashes`` that are cached, capped so one of ``num_tokens`` is recomputed."""
        limit = min(len(hashes), max(0, num_tokens - 1) // self.block_size)
        cached = self._cached
        hit = 0
        while hit < limit and hashes[hit] in cached:
            hit += 1
        return hit

    def cpu_hit(self, hashes: Sequence[bytes], num_hit_blocks: int, num_tokens: int) -> int:
        """Blocks past the GPU's ``num_hit_blocks`` that the CPU tier can load (0 without a tier).

        Like vLLM's ``get_num_new_matched_tokens``: touch the request's offloaded blocks, look up from
        the offloaded block holding the GPU hit's end, skip loads under one offloaded block. The same
        cap as :meth:`longest_hit` keeps one token to recompute (vLLM loads the last block and then
        recomputes its last token; the difference is at most one block of prefill).
        """
        cpu = self.cpu
        if cpu is None:
            return 0
        k = self._k
        keys = hashes[k - 1 :: k]
        cpu.touch(keys)
        start = num_hit_blocks // k
        hits = cpu.lookup(keys, start)
        limit = min(len(hashes), max(0, num_tokens - 1) // self.block_size)
        loadable = min((start + hits) * k, limit) - num_hit_blocks
        return loadable if loadable >= k else 0

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup in tokens, as vLLM's PrefixCacheStats does for a newly scheduled request."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def record_external_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count the CPU tier's part of a lookup: the tokens the GPU did not cover, and those it had."""
        self.external_queries += num_tokens
        self.external_hits += num_hit_tokens

    def allocate(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_hit_blocks: int,
        num_tokens: int,
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | None = None,
        num_loaded_blocks: int = 0,
    ) -> bool:
        """Give a new request its cache hits plus new blocks for ``num_tokens`` tokens in total.

        ``num_hit_blocks`` comes from :meth:`longest_hit` in the same step. Returns False and changes
        nothing when the free blocks (hits sitting in the free queue do not count) are too few.
        ``num_loaded_blocks`` (from :meth:`cpu_hit`) follow the hits and are filled by a CPU->GPU load:
        their CPU copies are pinned until :meth:`finish_load` caches them on the GPU.
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds blocks")
        hit_blocks = [self._cached[digest] for digest in hashes[:num_hit_blocks]]
        needed = max(0, -(-num_tokens // self.block_size) - num_hit_blocks)
        evictable_hits = sum(1 for block in hit_blocks if self._ref[block] == 0)
        if needed > len(self._free) - evictable_hits:
            return False
        for block in hit_blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        hit_blocks.extend(self._pop_free(needed))
        seq = _Seq(hit_blocks, num_hit_blocks, lora_name, lora_id, cache_salt)
        self._seqs[request_id] = seq
        if self.cpu is not None:
            if num_loaded_blocks:
                k, end = self._k, num_hit_blocks + num_loaded_blocks
                seq.loading = tuple(hashes[k - 1 :: k][num_hit_blocks // k : -(-end // k)])
                self.cpu.pin(seq.loading)
                # vLLM stores nothing below a load's end: those blocks came from the CPU tier.
                seq.num_offloaded = end // k
            else:
                self._offload(seq, hashes, num_hit_blocks)  # GPU hits the CPU tier lacks
        return True

    def finish_load(
        self, request_id: str, hashes: Sequence[bytes], token_ids: Sequence[int], num_tokens: int
    ) -> None:
        """A CPU->GPU load of the request's first ``num_tokens`` completed: cache them on the GPU.

        vLLM caches the loaded blocks (``BlockStored`` medium GPU) when it sees the load finished.
        """
        seq = self._seqs[request_id]
        self.cache_blocks(request_id, hashes, token_ids, num_tokens)
        if self.cpu is not None and seq.loading:
            self.cpu.unpin(seq.loading)
            seq.loading = ()

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Make the request's blocks cover ``num_tokens``; False (nothing changed) if too few are free."""
        seq = self._seqs[request_id]
        needed = -(-num_tokens // self.block_size) - len(seq.blocks)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        seq.blocks.extend(self._pop_free(needed))
        return True

    def cache_blocks(
        self, request_id: str, hashes: Sequence[bytes], token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Cache the request's blocks that became full, with one ``BlockStored`` for the new span.

        ``hashes`` must cover every full block of the computed tokens. Blocks already cached for the
        request (its hits included) are not announced again. With a CPU tier, the newly full
        offloaded blocks are also written through to it.
        """
        seq = self._seqs[request_id]
        full = min(num_computed_tokens // self.block_size, len(seq.blocks))
        if full > seq.num_cached:
            self._cache_gpu(seq, hashes, token_ids, full)
        if self.cpu is not None:
            self._offload(seq, hashes, full)

    def _cache_gpu(self, seq: _Seq, hashes: Sequence[bytes], token_ids: Sequence[int], full: int) -> None:
        start = seq.num_cached
        block_hash, cached, copies = self._hash, self._cached, self._copies
        for block, digest in zip(seq.blocks[start:full], hashes[start:full], strict=True):
            block_hash[block] = digest
            if digest in cached:
                copies.setdefault(digest, []).append(block)
            else:
                cached[digest] = block
        seq.num_cached = full
        size = self.block_size
        if self._groups is not None:
            event = self._groups.stored(seq, hashes, token_ids, start, full, size)
            if event is not None:
                self._events.append(event)
            return
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes[start:full]),
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=tuple(token_ids[start * size : full * size]),
                block_size=size,
                lora_id=seq.lora_id,
                lora_name=seq.lora_name,
                cache_salt=seq.cache_salt,
            )
        )

    def _offload(self, seq: _Seq, hashes: Sequence[bytes], full: int) -> None:
        """Write the request's offloaded blocks wholly within its first ``full`` blocks through to CPU.

        As vLLM's ``_get_reqs_to_store``: store from the request's next unstored offloaded block on;
        after a store that stored something, touch all of the request's offloaded blocks.
        """
        assert self.cpu is not None
        k = self._k
        end = full // k
        if end <= seq.num_offloaded:
            return
        keys = hashes[k - 1 : end * k : k]
        stored = self.cpu.store(keys[seq.num_offloaded :])
        if stored is None:
            return  # no room: retried at the request's next store, as vLLM does
        seq.num_offloaded = end
        if stored:
            self.cpu.touch(keys)

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first, so its tail is evicted before its head."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.loading and self.cpu is not None:  # aborted while its load ran
            self.cpu.unpin(seq.loading)
        ref, free = self._ref, self._free
        for block in reversed(seq.blocks):
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's ``reset_prefix_cache``); refused while any block is in use.

        The CPU tier is emptied too (vLLM's ``reset_connector``), without events of its own: routers
        drop every tier of a source on ``AllBlocksCleared``, so the one event describes both.
        """
        if len(self._free) != self.num_blocks:
            return False
        if self.cpu is not None:
            self.cpu.clear()
        for block in self._cached.values():
            self._hash[block] = None
        for blocks in self._copies.values():
            for block in blocks:
                self._hash[block] = None
        self._cached.clear()
        self._copies.clear()
        if self._groups is not None:
            self._groups.clear()
        self._events.append(AllBlocksCleared())
        return True

    # -- internals -------------------------------------------------------------------------------

    def _pop_free(self, count: int) -> list[int]:
        """Take the ``count`` least recently freed blocks, evicting the hashes they still hold."""
        popitem, block_hash, cached, ref = self._free.popitem, self._hash, self._cached, self._ref
        events, groups, copies = self._events, self._groups, self._copies
        taken: list[int] = []
        for _ in range(count):
            block, _ = popitem(last=False)
            digest = block_hash[block]
            if digest is not None:
                block_hash[block] = None
                others = copies.get(digest)
                if others is None:
                    del cached[digest]
                else:
                    if cached[digest] == block:
                        cached[digest] = others.pop(0)  # the next oldest copy becomes the first
                    else:
                        others.remove(block)
                    if not others:
                        del copies[digest]
                if groups is None:
                    events.append(BlockRemoved((digest,)))
                else:
                    events.extend(groups.evicted(block))
            ref[block] = 1
            taken.append(block)
        return taken


class GroupPublisher:
    """Events for KV groups publishing k hash-blocks as one coarse block (vLLM 0.12+, reference §1.8).

    A group is announced when the last of its k aligned sub-blocks is cached by a request; its hash is
    that last sub-block's digest (what vLLM's ``BlockHashListWithBlockSize`` takes). Each announcement
    is an *instance* pinned to the k physical sub-blocks the request held; the instance's hash is
    removed once, when the first of those sub-blocks is evicted. At most one instance is created per
    caching of a physical block, so the maps stay bounded by the pool size.
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self._instances: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self._by_block: dict[int, list[int]] = {}
        self._next_id = 0

    def stored(
        self,
        seq: _Seq,
        hashes: Sequence[bytes],
        token_ids: Sequence[int],
        start: int,
        full: int,
        block_size: int,
    ) -> BlockStored | None:
        """Announce the groups whose last sub-block is among the newly cached ``[start, full)``."""
        k = self.k
        first, end = start // k, full // k
        if first >= end:
            return None
        for group in range(first, end):
            members = tuple(seq.blocks[group * k : (group + 1) * k])
            instance = self._next_id
            self._next_id += 1
            self._instances[instance] = (hashes[(group + 1) * k - 1], members)
            for block in members:
                self._by_block.setdefault(block, []).append(instance)
        span = k * block_size
        return BlockStored(
            block_hashes=tuple(hashes[(group + 1) * k - 1] for group in range(first, end)),
            parent_block_hash=hashes[first * k - 1] if first else None,
            token_ids=tuple(token_ids[first * span : end * span]),
            block_size=span,
            lora_id=seq.lora_id,
            lora_name=seq.lora_name,
            cache_salt=seq.cache_salt,
        )

    def evicted(self, block: int) -> list[BlockRemoved]:
        """Remove every live group instance the evicted sub-block belonged to."""
        removed = []
        for instance in self._by_block.pop(block, ()):
            digest, members = self._instances.pop(instance)
            for other in members:
                if other != block:
                    siblings = self._by_block[other]
                    siblings.remove(instance)
                    if not siblings:
                        del self._by_block[other]
            removed.append(BlockRemoved((digest,)))
        return removed

    def clear(self) -> None:
        self._instances.clear()
        self._by_block.clear()

    def cached(self) -> Counter[bytes]:
        return Counter(digest for digest, _ in self._instances.values())
