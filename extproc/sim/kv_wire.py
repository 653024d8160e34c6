"""The exact bytes vLLM, or SGLang, publishes for a batch of KV-cache events (pure; no sockets).

vLLM encodes ``KVEventBatch`` msgspec Structs with a default ``msgspec.msgpack.Encoder()``. To be
byte-for-byte identical we do the same with Structs that mirror vLLM's declarations, rather than
hand-building dicts: msgspec's output depends on the *Struct definition*, not only on the values.
Two examples where a hand-rolled encoder (or the ``msgpack`` library) would differ:

- ``array_like`` Structs ignore ``omit_defaults``, so the array era (vLLM <= 0.23) always writes
  every field, defaults included (``BlockStored`` is 12 elements in 0.22).
- With ``omit_defaults`` msgspec reserves the map header for the *declared* field count before it
  knows how many fields it will omit: 16 declared entries (tag + 15 fields) give a map16 header
  ``de 00 09`` even when only 9 entries are written. vLLM 0.33's live capture starts
  ``93 cb <ts> 91 de 00 09 a4 "type"``; our map Structs therefore declare 0.33's full field list
  (``locality``, ``ownership``, ``session_id``, ``lookahead_token_ids`` are always nil, hence omitted).
  vLLM 0.24-0.29 declared fewer fields and wrote a fixmap header (``8x``); decoders cannot tell.

The batch itself is ``array_like`` in every version: ``[ts: float64, events, data_parallel_rank]``.

SGLang 0.5.23 (``srt/disaggregation/kv_events.py``, ``srt/mem_cache/events.py``) publishes the same
batch shell (``[ts, events, attn_dp_rank]``, the rank always filled in by its publisher) with its
own ``BlockStored``: recorded per page, then coalesced (``KVCacheEventRecorder.enqueue``): a page
that continues the previous event's last page with the same medium, block size, salt, session and
LoRA extends that event, and consecutive ``BlockRemoved`` of one medium merge too. ``lora_id`` is
always nil, the storing request's ``cache_salt`` is on every event, media are ``GPU`` /
``CPU_PINNED``, and each hash is the *first* 8 bytes of the page's SHA-256 digest as a signed int64
(``hash_str_to_int64``). :data:`EventEncoding.SGLANG` writes exactly that.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from extproc.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class EventEncoding(enum.StrEnum):
    """How each event is encoded inside a batch (functions here also accept the plain values)."""

    #: vLLM <= 0.23: ``[tag, field, ...]``, the 0.22 field set, every field present.
    ARRAYS = "arrays"
    #: vLLM >= 0.24: ``{"type": tag, ...}``; fields defaulting to nil are omitted when nil.
    MAPS = "maps"
    #: SGLang 0.5: tagged maps with its own field set, coalesced pages, signed int64 hashes.
    SGLANG = "sglang"


class HashFormat(enum.StrEnum):
    """How block hashes go on the wire (functions here also accept the plain values)."""

    #: vLLM's default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the digest's low 64 bits, uint64.
    INT = "int"
    #: The raw digest as msgpack bin (``=0``).
    BYTES = "bytes"


WireHash = int | bytes
_U64_MASK = (1 << 64) - 1
#: vLLM's GPU block pool always fills ``group_idx`` with the KV-cache group, 0 for plain models.
_GROUP_IDX = 0


def wire_hash(digest: bytes, hash_format: HashFormat | str) -> WireHash:
    """A block digest as vLLM puts it on the wire (``maybe_convert_block_hash``)."""
    if hash_format == HashFormat.INT:
        return int.from_bytes(digest, "big") & _U64_MASK
    if hash_format == HashFormat.BYTES:
        return digest
    raise ValueError(f"unknown hash format {hash_format!r}")


# --- Structs mirroring vllm/distributed/kv_events.py ---------------------------------------------
# Tags are given explicitly because our class names differ from vLLM's; the tag field is "type".


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM 0.22 ``KVCacheEvent``: a tagged array."""


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


# vLLM >= 0.24 sends the same structs as tagged maps (``array_like`` was dropped) and has only added
# fields since, at the end: declaration order is the map key order, and the full 0.33 list also fixes
# the map header's width.


class _MapBlockStored(_ArrayBlockStored, array_like=False, tag="BlockStored"):
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapBlockRemoved(_ArrayBlockRemoved, array_like=False, tag="BlockRemoved"):
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_ArrayAllBlocksCleared, array_like=False, tag="AllBlocksCleared"):
    pass


class _SGLangEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """SGLang's ``KVCacheEvent``: a tagged map, optional fields omitted when nil."""


class _SGLangBlockStored(_SGLangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _SGLangBlockRemoved(_SGLangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SGLangAllBlocksCleared(_SGLangEvent, tag="AllBlocksCleared"):
    pass


class _SGLangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


#: Our media as SGLang names its tiers (``StorageMedium``): host memory is ``CPU_PINNED``.
_SGLANG_MEDIA = {"GPU": "GPU", "CPU": "CPU_PINNED"}


def sglang_hash(digest: bytes) -> int:
    """A page digest as SGLang publishes it: its first 8 bytes, big-endian, as a signed int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def _sglang_events(events: Sequence[KVEvent]) -> list[Any]:
    """One step's events as SGLang's recorder queues them: page by page, coalesced with the tail."""
    queue: list[Any] = []
    for event in events:
        if isinstance(event, BlockStored):
            medium = _SGLANG_MEDIA.get(event.medium, event.medium)
            size, parent = event.block_size, event.parent_block_hash
            for index, digest in enumerate(event.block_hashes):
                page = _SGLangBlockStored(
                    block_hashes=[sglang_hash(digest)],
                    parent_block_hash=None if parent is None else sglang_hash(parent),
                    token_ids=list(event.token_ids[index * size : (index + 1) * size]),
                    block_size=size,
                    lora_id=None,
                    medium=medium,
                    cache_salt=event.cache_salt,
                    lora_name=event.lora_name,
                )
                _enqueue(queue, page)
                parent = digest
        elif isinstance(event, BlockRemoved):
            medium = _SGLANG_MEDIA.get(event.medium, event.medium)
            _enqueue(queue, _SGLangBlockRemoved([sglang_hash(h) for h in event.block_hashes], medium))
        elif isinstance(event, AllBlocksCleared):
            queue.append(_SGLangAllBlocksCleared())
        else:
            raise TypeError(f"not a KV event: {event!r}")
    return queue


def _enqueue(queue: list[Any], event: Any) -> None:
    """SGLang's coalescing: removals of one medium merge; a page continuing the tail's last page,
    alike in everything else, extends it."""
    tail = queue[-1] if queue else None
    if isinstance(tail, _SGLangBlockRemoved) and isinstance(event, _SGLangBlockRemoved):
        if tail.medium == event.medium:
            tail.block_hashes.extend(event.block_hashes)
            return
    elif isinstance(tail, _SGLangBlockStored) and isinstance(event, _SGLangBlockStored):
        alike = (
            tail.medium,
            tail.lora_id,
            tail.block_size,
            tail.cache_salt,
            tail.session_id,
            tail.lora_name,
        ) == (
            event.medium,
            event.lora_id,
            event.block_size,
            event.cache_salt,
            event.session_id,
            event.lora_name,
        )
        if alike and tail.block_hashes and event.parent_block_hash == tail.block_hashes[-1]:
            tail.block_hashes.extend(event.block_hashes)
            tail.token_ids.extend(event.token_ids)
            return
    queue.append(event)


_STRUCTS: dict[str, tuple[type[Any], type[Any], type[Any]]] = {
    EventEncoding.ARRAYS: (_ArrayBlockStored, _ArrayBlockRemoved, _ArrayAllBlocksCleared),
    EventEncoding.MAPS: (_MapBlockStored, _MapBlockRemoved, _MapAllBlocksCleared),
}
_ENCODER = msgspec.msgpack.Encoder()


def _to_struct(event: KVEvent, structs: tuple[type[Any], type[Any], type[Any]], hash_format: str) -> Any:
    stored_cls, removed_cls, cleared_cls = structs
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return stored_cls(
            block_hashes=[wire_hash(h, hash_format) for h in event.block_hashes],
            parent_block_hash=None if parent is None else wire_hash(parent, hash_format),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=_extra_keys(event),
            group_idx=_GROUP_IDX,
        )
    if isinstance(event, BlockRemoved):
        return removed_cls(
            block_hashes=[wire_hash(h, hash_format) for h in event.block_hashes],
            medium=event.medium,
            group_idx=_GROUP_IDX,
        )
    if isinstance(event, AllBlocksCleared):
        return cleared_cls()
    raise TypeError(f"not a KV event: {event!r}")


def _extra_keys(event: BlockStored) -> list[Any] | None:
    """vLLM's per-block ``extra_keys`` for a salted chain's first event, else nil.

    Untagged, as 0.31+ publishes them (reference §2.1): the LoRA name on every block, the salt on the
    first. Unsalted events stay nil: a simulated pool has no images or embeddings, and the LoRA
    name has its own field.
    """
    if event.cache_salt is None or event.parent_block_hash is not None:
        return None
    lora = [] if event.lora_name is None else [event.lora_name]
    return [[*lora, event.cache_salt]] + [lora or None for _ in event.block_hashes[1:]]


def encode_batch(
    events: Sequence[KVEvent],
    *,
    ts: float,
    dp_rank: int,
    encoding: EventEncoding | str,
    hash_format: HashFormat | str,
) -> bytes:
    """One engine step's events as the msgpack payload vLLM's ``ZmqEventPublisher`` sends.

    ``ts`` is the step's wall-clock ``time.time()``; it is always written as a float64. SGLang's
    encoding has one hash form of its own: ``hash_format`` does not apply to it.
    """
    if encoding == EventEncoding.SGLANG:
        return _ENCODER.encode(
            _SGLangBatch(ts=float(ts), events=_sglang_events(events), attn_dp_rank=dp_rank)
        )
    try:
        structs = _STRUCTS[encoding]
    except KeyError:
        raise ValueError(f"unknown event encoding {encoding!r}") from None
    wire_events = [_to_struct(event, structs, hash_format) for event in events]
    batch = _EventBatch(ts=float(ts), events=wire_events, data_parallel_rank=dp_rank)
    return _ENCODER.encode(batch)
