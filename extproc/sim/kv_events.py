"""The simulator's KV-cache events, as vLLM's ``distributed/kv_events.py`` defines them.

These are what a simulated engine step produces; :mod:`extproc.sim.kv_wire` turns a batch of
them into the exact bytes vLLM publishes. Hashes are kept as digests (32 bytes; 16 with xxhash), the
way vLLM >= 0.10.2 keeps ``BlockHash`` internally; the wire encoder turns them into uint64 (vLLM's default,
the last 8 bytes read big-endian) or leaves them as bytes.

Fields vLLM has but a simulated GPU pool never fills (``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``, ...) are not modelled here; the encoder writes them with the
values vLLM's GPU pool sends (nil, and ``group_idx`` 0). ``extra_keys`` is written only for a
salted chain's first event (the salt is all it would carry here).

They are frozen ``msgspec.Struct`` classes, not frozen dataclasses, for the reason the router's own
events are (:mod:`extproc.kvindex.events`): an engine makes one per evicted block, and a frozen
slotted dataclass costs ~10x a Struct to build.
"""

from __future__ import annotations

import msgspec

#: vLLM's medium for the GPU KV pool (``MEDIUM_GPU``).
MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Full blocks entered the prefix cache (one event per engine ``cache_full_blocks`` call)."""

    #: One digest per block, in sequence order.
    block_hashes: tuple[bytes, ...]
    #: Digest of the block just before the first one here; None when the span starts at token 0.
    parent_block_hash: bytes | None
    #: ``len(block_hashes) * block_size`` token ids.
    token_ids: tuple[int, ...]
    block_size: int
    #: vLLM's integer LoRA id (1-based in the order adapters were loaded), None for the base model.
    lora_id: int | None
    lora_name: str | None
    medium: str = MEDIUM_GPU
    #: The storing request's ``cache_salt`` (its first block's hash includes it).
    cache_salt: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks left the prefix cache (vLLM sends one hash per event, on eviction)."""

    block_hashes: tuple[bytes, ...]
    medium: str = MEDIUM_GPU


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The whole prefix cache was reset (``POST /reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
