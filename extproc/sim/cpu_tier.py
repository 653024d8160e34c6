"""vLLM's native CPU offloading tier (``OffloadingConnector`` + ``CPUOffloadingManager``, LRU policy).

What a router sees of it, and what it costs, follow vLLM (``kv_offload/cpu/manager.py``,
``policies/lru.py``, ``kv_connector/v1/offloading/scheduler.py``):

* **Write-through, not a victim cache.** Every full block a request computes is stored to the CPU
  tier (GPU->CPU copy after the forward pass), whether or not the GPU will ever evict it; blocks the
  tier already holds are skipped. The tier is therefore mostly a superset of the GPU's recent
  blocks, and its capacity, not GPU + CPU, bounds the hit rate.
* **LRU over offloaded blocks**, at the offloaded block size (here the published block size: one
  CPU block is k GPU blocks, keyed by its last sub-block's hash, as vLLM's
  ``BlockHashListWithBlockSize`` does). A store evicts least recently used blocks, never one of the
  keys it is storing nor one being loaded; when too few are evictable the whole store is skipped
  (vLLM's ``prepare_store`` returns None) and retried at the request's next store.
* **Recency**: a lookup touches every offloaded block of the request, and so does a store that
  stored something; touches run tail to head so a request's head is evicted last.
* **A load keeps the CPU copy** (ref-counted while the transfer runs, evictable again after).
* **Events**: vLLM's connector turns each eviction round into one ``BlockRemoved`` listing every
  evicted hash and each completed store into one ``BlockStored``, both ``medium="CPU"``; the
  ``BlockStored`` carries only hashes (``parent_block_hash`` None, ``token_ids`` empty, no LoRA),
  so a router must resolve them through the hashes it learned from the GPU tier's events. Stores
  complete here in the step that computed the blocks, right after that step's GPU events.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from extproc.sim.kv_events import BlockRemoved, BlockStored, KVEvent

#: vLLM's medium for the CPU offload tier (``CPULoadStoreSpec.medium()``).
MEDIUM_CPU = "CPU"


class CpuTier:
    """``num_blocks`` offloaded blocks of ``block_size`` tokens each, least recently used first."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Insertion order is recency: the first key is the least recently used.
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        #: Keys with a CPU->GPU load in flight (vLLM's ref_cnt > 0): never evicted.
        self._pins: Counter[bytes] = Counter()
        self._events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    @property
    def num_pinned(self) -> int:
        """Keys with a load in flight."""
        return len(self._pins)

    def keys(self) -> list[bytes]:
        """Held keys, least recently used first."""
        return list(self._lru)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def lookup(self, keys: Sequence[bytes], start: int) -> int:
        """How many of ``keys[start:]`` are held, consecutively from ``start`` (a prefix continues)."""
        lru, hit = self._lru, start
        while hit < len(keys) and keys[hit] in lru:
            hit += 1
        return hit - start

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark held keys most recently used, tail first, so the head ends up the last to go."""
        lru = self._lru
        move = lru.move_to_end
        for key in reversed(keys):
            if key in lru:
                move(key)

    def store(self, keys: Sequence[bytes]) -> int | None:
        """Store the keys not held yet, evicting LRU blocks; returns how many were new.

        None (nothing changed) when too few blocks are evictable. ``keys`` themselves are protected
        from this store's evictions, as in vLLM.
        """
        lru = self._lru
        new = [key for key in dict.fromkeys(keys) if key not in lru]
        if not new:
            return 0
        excess = len(lru) + len(new) - self.num_blocks
        if excess > 0:
            protected, pins = set(keys), self._pins
            victims: list[bytes] = []
            for key in lru:  # least recently used first; pins and protected keys are rare
                if key not in protected and not pins[key]:
                    victims.append(key)
                    if len(victims) == excess:
                        break
            if len(victims) < excess:
                return None
            for key in victims:
                del lru[key]
            self._events.append(BlockRemoved(tuple(victims), medium=MEDIUM_CPU))
        for key in new:
            lru[key] = None
        self._events.append(
            BlockStored(
                block_hashes=tuple(new),
                parent_block_hash=None,
                token_ids=(),
                block_size=self.block_size,
                lora_id=None,
                lora_name=None,
                medium=MEDIUM_CPU,
            )
        )
        return len(new)

    def pin(self, keys: Sequence[bytes]) -> None:
        """A load of ``keys`` started: keep them until :meth:`unpin`."""
        self._pins.update(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        pins = self._pins
        for key in keys:
            pins[key] -= 1
            if pins[key] <= 0:
                del pins[key]

    def clear(self) -> None:
        """Drop everything without events (vLLM's ``reset_cache``; the GPU's AllBlocksCleared covers it)."""
        self._lru.clear()
        self._pins.clear()
