"""Tolerant decoding of one vLLM / SGLang KV-event payload into domain events.

The wire (reference §1.3-§1.5): a batch is a msgpack array ``[ts, events]`` (vLLM 0.9.0) or
``[ts, events, dp_rank]`` (later; dp_rank may be nil); each event is a tagged array
``["BlockStored", field, ...]`` in declaration order (vLLM <= 0.23) or a map
``{"type": "BlockStored", "<field>": ...}`` (vLLM >= 0.24, SGLang). What we accept:

- extra trailing batch elements, extra trailing event elements and unknown map keys are ignored;
  missing optional fields are None;
- an event of an unknown type, or one that is malformed (a field of the wrong type, a
  ``BlockStored`` without ``block_hashes`` / ``token_ids`` / ``block_size >= 1``, or with
  ``len(token_ids) != len(block_hashes) * block_size`` and non-empty tokens), is left out and
  counted in :attr:`DecodedBatch.skipped`; the rest of the batch is kept;
- events of a secondary KV-cache group of a hybrid model (sliding window, mamba, ...: a
  ``kv_cache_spec_kind`` that is not full/MLA attention, or ``group_idx`` > 0 without a kind) are
  left out and counted in :attr:`DecodedBatch.ignored`, as Dynamo does;
- SGLang's EAGLE radix trees publish ``token_ids`` as ``[a, b]`` bigram pairs, pair j being
  (token j, token j + 1) of the page: the first elements are the page's own tokens, read as such;
- a salted prompt's first blocks carry its ``cache_salt``: SGLang names it (``cache_salt``), vLLM
  (0.17+) puts it in the first block's ``extra_keys`` entry (see :func:`vllm_salt`);
- only a batch that is unusable as a whole raises :class:`KVDecodeError`: not msgpack, not an array
  of at least 2 elements, ``ts`` not a number, or ``events`` not an array.

Speed: one typed ``msgspec`` pass over the whole batch (map form first, then array form) does all
the validation in C; only when it fails (a bad or unknown event somewhere, or a mixed batch) is the
batch decoded again event by event to keep the good ones. Measured on a realistic stream, the typed
pass costs the same as an untyped ``Decoder()`` (within ~3 % per block: both are dominated by
creating the token ints) and leaves no per-field checks to do in Python. Tokens are
``tuple[int, ...]`` without range checks: the index hashes them, and an out-of-vocabulary id only
produces a key no request has.

Memory and time: a decoded payload costs at most ~14x its size (a tuple slot plus an int object
per 3-byte token id, the worst case), so callers must cap payload size; :data:`MAX_PAYLOAD_BYTES`
(16 MiB, the subscriber's default too) is checked here as well. Measured worst case at the cap (one
BlockStored of 4.9M tokens): 220 MiB transient, 0.27 s to decode and 0.55 s to apply, i.e. the
event loop stalls ~0.8 s. Real batches stay under 1 MiB (a 128k-token step is ~0.6 MiB), so 4 MiB
is a safe tighter cap (~55 MiB, ~0.2 s). Deep nesting is refused by msgspec's recursion limit (a
RecursionError, turned into KVDecodeError here).
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from extproc.kvindex.events import (
    U64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    KVEvent,
    normalise_hash,
)

#: Default cap on a payload handed to :func:`decode_batch`, bytes.
MAX_PAYLOAD_BYTES: Final = 16 * 1024 * 1024

_NIL: Final = msgspec.Raw(b"\xc0")
WireHash = int | bytes
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class KVDecodeError(ValueError):
    """A payload that is not a KV-event batch at all; the message says what is wrong with it."""


# --- wire structs: positions are vLLM 0.22's (array form), names are 0.33's (map form) -----------
# Only the fields the index uses are declared; ``lora_id`` is declared (as Raw, never parsed) only
# because ``medium`` and ``lora_name`` come after it in the array form.


class _ArrayStored(msgspec.Struct, array_like=True, gc=False, tag="BlockStored"):
    block_hashes: tuple[WireHash, ...]
    parent_block_hash: WireHash | None
    token_ids: tuple[int, ...]
    block_size: PositiveInt
    lora_id: msgspec.Raw = _NIL
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _ArrayRemoved(msgspec.Struct, array_like=True, gc=False, tag="BlockRemoved"):
    block_hashes: tuple[WireHash, ...]
    medium: str | None = None
    group_idx: int | None = None


class _ArrayCleared(msgspec.Struct, array_like=True, gc=False, tag="AllBlocksCleared"):
    pass


class _MapStored(msgspec.Struct, gc=False, tag_field="type", tag="BlockStored"):
    block_hashes: tuple[WireHash, ...]
    token_ids: tuple[int, ...]
    block_size: PositiveInt
    parent_block_hash: WireHash | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    #: SGLang only.
    cache_salt: str | None = None


class _BigramStored(_MapStored, tag="BlockStored"):
    """SGLang with EAGLE: ``token_ids`` as ``[token j, token j + 1]`` pairs (tried only when the
    plain form fails)."""

    token_ids: tuple[tuple[int, int], ...]  # type: ignore[assignment]


class _MapRemoved(msgspec.Struct, gc=False, tag_field="type", tag="BlockRemoved"):
    block_hashes: tuple[WireHash, ...]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, gc=False, tag_field="type", tag="AllBlocksCleared"):
    pass


#: KV-cache group kinds whose blocks decide a prefix hit (Dynamo's list); see :func:`_main_group`.
MAIN_ATTENTION_KINDS: Final = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

_ArrayEvent = _ArrayStored | _ArrayRemoved | _ArrayCleared
_MapEvent = _MapStored | _MapRemoved | _MapCleared
_WireEvent = _ArrayEvent | _MapEvent


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    dp_rank: int | None = None


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    dp_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    """The batch shell only; each event stays raw bytes until decoded on its own."""

    ts: float
    events: list[msgspec.Raw]
    dp_rank: msgspec.Raw = _NIL


_FAST_DECODERS: Final = (msgspec.msgpack.Decoder(_MapBatch), msgspec.msgpack.Decoder(_ArrayBatch))
_LOOSE_DECODER: Final = msgspec.msgpack.Decoder(_LooseBatch)
_ARRAY_EVENT_DECODER: Final = msgspec.msgpack.Decoder(_ArrayEvent)
_MAP_EVENT_DECODER: Final = msgspec.msgpack.Decoder(_MapEvent)
_BIGRAM_DECODER: Final = msgspec.msgpack.Decoder(_BigramStored)
_RANK_DECODER: Final = msgspec.msgpack.Decoder(int | None)
#: First byte of a msgpack map: fixmap 0x80-0x8f, map16 0xde, map32 0xdf.
_MAP_HEADERS: Final = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def decode_batch(payload: bytes, *, max_bytes: int = MAX_PAYLOAD_BYTES) -> DecodedBatch:
    """Decode one payload; raises :class:`KVDecodeError` (only) when the batch itself is unusable."""
    if len(payload) > max_bytes:
        raise KVDecodeError(f"payload is {len(payload)} bytes, over the {max_bytes}-byte cap")
    for decoder in _FAST_DECODERS:
        try:
            fast = decoder.decode(payload)
        except Exception:  # any failure of the C decoder means "not this shape"
            continue
        events, invalid, ignored = _to_domain(fast.events)
        return DecodedBatch(ts=fast.ts, events=events, dp_rank=fast.dp_rank, skipped=invalid, ignored=ignored)
    return _decode_loose(payload)


def _decode_loose(payload: bytes) -> DecodedBatch:
    """The slow path: the batch shell, then each event on its own so one bad event costs only itself."""
    try:
        loose = _LOOSE_DECODER.decode(payload)
    except RecursionError:
        raise KVDecodeError("not a KV event batch: nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise KVDecodeError(f"not a KV event batch [ts, events, dp_rank?]: {_describe(exc)}") from None
    except Exception as exc:  # DecodeError, or e.g. UnicodeDecodeError for a bad str: not msgpack
        raise KVDecodeError(f"payload is not valid msgpack: {exc}") from None
    wire: list[_WireEvent] = []
    skipped = 0
    for raw in loose.events:
        is_map = memoryview(raw)[0] in _MAP_HEADERS
        decoder = _MAP_EVENT_DECODER if is_map else _ARRAY_EVENT_DECODER
        try:
            wire.append(decoder.decode(raw))
            continue
        except Exception:  # a bad event costs only itself
            pass
        try:
            if not is_map:
                raise ValueError("not a map")
            wire.append(_first_of_pairs(_BIGRAM_DECODER.decode(raw)))
        except Exception:  # neither form: a bad event costs only itself
            skipped += 1
    events, invalid, ignored = _to_domain(wire)
    rank = _rank(loose.dp_rank)
    return DecodedBatch(ts=loose.ts, events=events, dp_rank=rank, skipped=skipped + invalid, ignored=ignored)


def _first_of_pairs(bigram: _BigramStored) -> _MapStored:
    """An EAGLE page as a plain one: pair j's first element is the page's token j."""
    fields = {f: getattr(bigram, f) for f in _MapStored.__struct_fields__}
    return _MapStored(**{**fields, "token_ids": tuple(pair[0] for pair in bigram.token_ids)})


def _describe(exc: msgspec.ValidationError) -> str:
    """msgspec's message in the batch's own terms (``$[1]`` is the events array)."""
    text = str(exc).replace("`object`", "`map`")
    if text.startswith("Expected `array`, got") and "- at" not in text:
        return f"the batch is not an array ({text})"
    return text.replace("`$[0]`", "`ts` ($[0])").replace("`$[1]`", "`events` ($[1])")


def _rank(raw: msgspec.Raw) -> int | None:
    """The batch's dp_rank when it is an int; anything else (nil, a string, ...) reads as absent."""
    try:
        rank: int | None = _RANK_DECODER.decode(raw)
    except Exception:  # not an int: read as absent
        return None
    return rank


def _to_domain(wire_events: list[Any]) -> tuple[list[KVEvent], int, int]:
    """Wire structs as domain events, plus how many were dropped as inconsistent and as secondary."""
    events: list[KVEvent] = []
    append = events.append
    invalid = ignored = 0
    for wire in wire_events:
        if type(wire) is _MapStored or type(wire) is _ArrayStored:
            if not _main_group(wire.group_idx, wire.kv_cache_spec_kind):
                ignored += 1
                continue
            hashes = _hashes(wire.block_hashes)
            tokens = wire.token_ids
            if not hashes or (tokens and len(tokens) != len(hashes) * wire.block_size):
                invalid += 1
                continue
            parent = wire.parent_block_hash
            salt = None
            if parent is None:
                # Only a chain's first block needs the salt: later ones chain from its key.
                salt = getattr(wire, "cache_salt", None)
                if salt is None and len(wire.extra_keys) > 1:  # nil or [] is 1 byte
                    salt = vllm_salt(wire.extra_keys, wire.lora_name)
            append(
                BlockStored(
                    hashes,
                    None if parent is None else normalise_hash(parent),
                    tokens,
                    wire.block_size,
                    wire.lora_name,
                    wire.medium,
                    salt or None,
                )
            )
        elif type(wire) is _MapRemoved or type(wire) is _ArrayRemoved:
            if _main_group(wire.group_idx, None):
                append(BlockRemoved(_hashes(wire.block_hashes), wire.medium))
            else:
                ignored += 1
        else:
            append(AllBlocksCleared())
    return events, invalid, ignored


def vllm_salt(extra_keys: msgspec.Raw, lora_name: str | None) -> str | None:
    """The ``cache_salt`` in a vLLM event's ``extra_keys`` (reference §2.1), for its first block.

    ``extra_keys`` has one entry per block hash: nil, or the block's extra hash keys in vLLM's
    order: LoRA name, multimodal items, cache salt, prompt-embeds digest, untagged (0.31+ strips
    the tags it hashes with). The salt is the first block's last string that is not the LoRA name.
    Multimodal items are ``[id, offset]`` pairs from 0.19 and are passed over; a bare image id
    (0.17-0.18) or an embeds digest read as a salt keeps those blocks from matching plain-text
    prompts, which is right: our keys cannot see images or embeddings. Anything unreadable: None.
    """
    try:
        entries = msgspec.msgpack.decode(extra_keys)
    except Exception:  # not ours to refuse: the blocks still index, unsalted
        return None
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], list):
        return None
    strings = [item for item in entries[0] if isinstance(item, str)]
    if lora_name is not None and lora_name in strings:
        strings.remove(lora_name)
    return strings[-1] if strings else None


def _main_group(group_idx: int | None, kind: str | None) -> bool:
    """Whether an event describes the KV-cache group that decides prefix hits (Dynamo's rule).

    Hybrid models (vLLM 0.20+ HMA) publish one event per KV-cache group: full attention, sliding
    window, mamba, ... A sliding-window group drops blocks that fell out of its window, so counting
    its events would make holes in prefixes that the full-attention group still serves. Offload
    managers name the kind; the GPU pool does not (0.33), so there group 0 is taken as the main one.
    """
    if kind is not None:
        return kind in MAIN_ATTENTION_KINDS
    return not group_idx


def _hashes(wire: tuple[WireHash, ...]) -> tuple[int, ...]:
    """Normalised hashes; the common case (all non-negative ints: uint64 already) costs one ``min``."""
    try:
        if min(wire) >= 0:  # type: ignore[operator]
            return wire  # type: ignore[return-value]
    except (TypeError, ValueError):  # bin among them, or empty
        pass
    from_bytes = int.from_bytes
    return tuple(from_bytes(h[-8:], "big") if type(h) is bytes else h & U64_MASK for h in wire)  # type: ignore[operator]
