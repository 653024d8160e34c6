"""Domain KV-cache events: what the prefix index consumes, whatever wire encoding they came in.

The decoder (:mod:`extproc.kvindex.decode`) turns both vLLM encodings (tagged arrays before 0.24,
tagged maps since) into these; the index (:mod:`extproc.kvindex.index`) applies them. Nothing here
knows about msgpack field positions, sockets or pods.

Engine hashes are opaque handles, normalised to uint64 ints so that a parent reference and the
hash it refers to compare equal whatever form each took on the wire:

- int64 (negative; vLLM <= 0.10.1 ``builtin`` hashing, SGLang): taken mod 2**64 (``& (2**64-1)``);
- uint64: as is;
- bin (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``): the **last** 8 bytes read big-endian, which is
  the number vLLM's default int mode would have sent for the same digest (reference §1.5).
  SGLang derives its int from the *first* 8 bytes (signed); that only matters when comparing
  hashes across encodings, which we never do: within one stream the mapping is consistent.

The events are frozen ``msgspec.Struct`` classes rather than frozen dataclasses: they are built
once per decoded event on the ingest path, and a frozen slotted dataclass costs ~1.1 µs to build
(``object.__setattr__`` per field) against ~0.09 µs for a Struct (measured, bench/kvindex.py).
They are immutable, slotted, compare by value and are hashable all the same.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from extproc.types import EndpointAddress

#: Media vLLM and SGLang use for the GPU KV pool; None is what vLLM < 0.10.2 sends (GPU only then).
GPU_MEDIA = frozenset({None, "GPU"})
U64_MASK = (1 << 64) - 1


class Source(NamedTuple):
    """Whose KV cache a stream describes: a pod's endpoint and one of its data-parallel ranks.

    Each DP rank has an independent cache, publisher and seq counter (reference §1.8).
    """

    endpoint: EndpointAddress
    dp_rank: int

    def __str__(self) -> str:
        return f"{self.endpoint}/dp{self.dp_rank}"


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Full blocks entered a cache tier (one engine ``cache_full_blocks`` call).

    ``token_ids`` has ``len(engine_hashes) * block_size`` ids, or is empty when the publisher did
    not send tokens (offload connectors re-announcing a GPU block by its hash; the index then finds
    the tokens' keys through the hash).
    """

    #: One uint64 per block, in sequence order.
    engine_hashes: tuple[int, ...]
    #: Hash of the block just before the first one here; None when the span starts at token 0.
    parent_engine_hash: int | None
    token_ids: tuple[int, ...]
    #: Tokens per block *in this event* (vLLM 0.33 partial entries: the span of the single hash).
    block_size: int
    #: The LoRA adapter the blocks were computed with (its own key namespace); None for the base model.
    lora_name: str | None = None
    #: Cache tier: None or "GPU" for the GPU pool, "CPU", "STORAGE", ... for offload tiers.
    medium: str | None = None
    #: The ``cache_salt`` the chain was stored under (first blocks only: a continuation chains from
    #: its parent, salted already); None for unsalted prompts.
    cache_salt: str | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Blocks left a cache tier (vLLM: one hash per event, on eviction or partial-block promotion)."""

    engine_hashes: tuple[int, ...]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The engine reset its prefix cache (``reset_prefix_cache``): nothing it announced is held."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class DecodedBatch(msgspec.Struct, frozen=True, gc=False):
    """One published batch (one engine step with events), decoded."""

    #: The step's wall-clock ``time.time()`` on the engine, seconds.
    ts: float
    events: list[KVEvent]
    #: The DP rank the publisher stamped (None when absent: vLLM 0.9.0, or nil).
    dp_rank: int | None
    #: Events in this batch that were malformed or of an unknown type and were left out.
    skipped: int = 0
    #: Well-formed events of a secondary KV-cache group (sliding window, mamba, ...), left out.
    ignored: int = 0


def normalise_hash(value: int | bytes) -> int:
    """A wire hash as a uint64: ints mod 2**64, bin as its last 8 bytes big-endian (see module doc)."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & U64_MASK
