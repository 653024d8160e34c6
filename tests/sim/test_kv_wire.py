"""The simulator's KV-event payloads, decoded with ``msgpack`` and compared with what vLLM sends."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import msgpack
import msgspec
import pytest

from extproc.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from extproc.sim.kv_wire import EventEncoding, HashFormat, encode_batch, wire_hash

# Digests whose last 8 bytes are the uint64s in vLLM 0.33's live capture (reference §1.3).
H1 = hashlib.sha256(b"a").digest()[:24] + b"\x11" * 8
H2 = hashlib.sha256(b"b").digest()[:24] + b"\x22" * 8
# Low 64 bits >= 2**63: must go out as msgpack uint64 (0xcf), not as a negative int64.
HIGH = hashlib.sha256(b"c").digest()[:24] + b"\xf0" + bytes(range(7))
# First 8 bytes >= 2**63: SGLang sends it as a negative int64.
NEGATIVE = b"\xf1" + hashlib.sha256(b"d").digest()[1:]
TOKENS = tuple(range(100, 132))
STORED = BlockStored((H1, H2), None, TOKENS, 16, None, None)
REMOVED = BlockRemoved((H1,))


def decode(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def encode(events: list[KVEvent], encoding: str, hash_format: str = "int", ts: float = 1.5) -> bytes:
    return encode_batch(events, ts=ts, dp_rank=0, encoding=encoding, hash_format=hash_format)


I1, I2 = 0x1111111111111111, 0x2222222222222222


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (STORED, ["BlockStored", [I1, I2], None, list(TOKENS), 16, None, "GPU", None, None, 0, None, None]),
        (REMOVED, ["BlockRemoved", [I1], "GPU", 0]),
        (AllBlocksCleared(), ["AllBlocksCleared"]),
        (
            BlockStored((H2,), H1, TOKENS[:16], 16, 1, "sql-lora"),
            ["BlockStored", [I2], I1, list(TOKENS[:16]), 16, 1, "GPU", "sql-lora", None, 0, None, None],
        ),
    ],
    ids=["stored", "removed", "cleared", "stored-lora-with-parent"],
)
def test_array_events_carry_every_field_in_vllm_0_22_order(event: KVEvent, expected: list[Any]) -> None:
    """Array-era events are ``[tag, ...]`` with all 0.22 fields, defaults included."""
    assert decode(encode([event], "arrays"))[1] == [expected]


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (
            STORED,
            {
                "type": "BlockStored",
                "block_hashes": [I1, I2],
                "parent_block_hash": None,
                "token_ids": list(TOKENS),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            },
        ),
        (REMOVED, {"type": "BlockRemoved", "block_hashes": [I1], "medium": "GPU", "group_idx": 0}),
        (AllBlocksCleared(), {"type": "AllBlocksCleared"}),
    ],
    ids=["stored", "removed", "cleared"],
)
def test_map_events_keep_required_nils_and_omit_defaulted_nils(
    event: KVEvent, expected: dict[str, Any]
) -> None:
    """Map-era events list keys in declaration order, ``type`` first; only defaulted nils are omitted."""
    (got,) = decode(encode([event], "maps"))[1]
    assert list(got.items()) == list(expected.items())


def test_maps_payload_is_byte_identical_to_the_vllm_0_33_capture() -> None:
    """The 0.33 live capture's header (map16 ``de 00 09``) and content are reproduced exactly."""
    ts = 1795970472.95
    payload = encode([STORED], "maps", ts=ts)
    header = b"\x93\xcb" + struct.pack(">d", ts) + b"\x91\xde\x00\x09\xa4type\xabBlockStored"
    assert payload.startswith(header)
    assert decode(payload) == [
        ts,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1229782938247303441, 2459565876494606882],
                "parent_block_hash": None,
                "token_ids": list(range(100, 132)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            }
        ],
        0,
    ]


def test_arrays_payload_matches_the_vllm_0_22_example() -> None:
    """A store and a removal in one step decode to the 0.22 example batch."""
    assert decode(encode([STORED, REMOVED], "arrays", ts=2.0)) == [
        2.0,
        [
            ["BlockStored", [I1, I2], None, list(TOKENS), 16, None, "GPU", None, None, 0, None, None],
            ["BlockRemoved", [I1], "GPU", 0],
        ],
        0,
    ]


@pytest.mark.parametrize("encoding", [EventEncoding.ARRAYS, EventEncoding.MAPS], ids=str)
def test_hashes_at_or_above_2_63_are_uint64(encoding: str) -> None:
    """A low-64-bit value >= 2**63 is written with the 0xcf marker and decodes to the last 8 bytes."""
    payload = encode([BlockRemoved((HIGH,))], encoding)
    value = int.from_bytes(HIGH[-8:], "big")
    assert value >= 2**63
    assert b"\xcf" + HIGH[-8:] in payload
    (event,) = decode(payload)[1]
    hashes = event["block_hashes"] if isinstance(event, dict) else event[1]
    assert hashes == [value]


@pytest.mark.parametrize("encoding", [EventEncoding.ARRAYS, EventEncoding.MAPS], ids=str)
def test_bytes_mode_sends_the_raw_digest_as_bin(encoding: str) -> None:
    """With int hashes off, hashes and parents are the 32-byte digests as msgpack bin 8."""
    payload = encode([BlockStored((H2,), H1, TOKENS[:16], 16, None, None)], encoding, hash_format="bytes")
    assert b"\xc4\x20" + H2 in payload and b"\xc4\x20" + H1 in payload
    (event,) = decode(payload)[1]
    if isinstance(event, dict):
        assert (event["block_hashes"], event["parent_block_hash"]) == ([H2], H1)
    else:
        assert (event[1], event[2]) == ([H2], H1)


@pytest.mark.parametrize(
    ("ts", "dp_rank", "encoding"),
    [(1700000000, 0, "maps"), (1700000000.25, 3, "arrays"), (0.0, 1, "maps")],
    ids=["int-ts-rank0", "float-ts-rank3-arrays", "zero-ts-rank1"],
)
def test_batch_is_a_three_array_with_float64_ts_and_dp_rank(ts: float, dp_rank: int, encoding: str) -> None:
    """The batch is always ``[ts: float64, events, dp_rank]``, even for an integral ts."""
    payload = encode_batch([REMOVED], ts=ts, dp_rank=dp_rank, encoding=encoding, hash_format="int")
    assert payload[:2] == b"\x93\xcb"
    assert struct.unpack(">d", payload[2:10])[0] == float(ts)
    batch = decode(payload)
    assert isinstance(batch[0], float) and len(batch[1]) == 1 and batch[2] == dp_rank


@pytest.mark.parametrize(
    ("encoding", "expected"),
    [("arrays", ["AllBlocksCleared"]), ("maps", {"type": "AllBlocksCleared"})],
    ids=["arrays", "maps"],
)
def test_all_blocks_cleared_forms(encoding: str, expected: Any) -> None:
    """AllBlocksCleared has no fields: a one-element array or a map with only ``type``."""
    assert decode(encode([AllBlocksCleared()], encoding))[1] == [expected]


@pytest.mark.parametrize(
    ("digest", "hash_format", "expected"),
    [
        (HIGH, HashFormat.INT, int.from_bytes(HIGH[-8:], "big")),
        (H1, "int", I1),
        (H1, HashFormat.BYTES, H1),
        (b"\x01\x02", "int", 0x0102),
    ],
    ids=["int-high", "int-plain-str", "bytes", "int-short-digest"],
)
def test_wire_hash(digest: bytes, hash_format: str, expected: int | bytes) -> None:
    """Int mode is vLLM's ``int.from_bytes(d, "big") & (2**64-1)``; bytes mode is the digest."""
    assert wire_hash(digest, hash_format) == expected


def test_empty_step_is_an_empty_events_array() -> None:
    """A batch without events still has all three elements."""
    assert decode(encode([], "maps", ts=3.0)) == [3.0, [], 0]


@pytest.mark.parametrize(
    ("encoding", "hash_format"), [("map", "int"), ("maps", "uint")], ids=["bad-encoding", "bad-hash-format"]
)
def test_unknown_settings_are_rejected(encoding: str, hash_format: str) -> None:
    """A typo in the encoding or hash format fails loudly instead of sending something else."""
    with pytest.raises(ValueError, match="unknown"):
        encode([REMOVED], encoding, hash_format)


# -- SGLang 0.5.23 ------------------------------------------------------------------------------------
# The wire as SGLang's srt/disaggregation/kv_events.py declares it, written out independently here:
# a positional batch, and tagged maps whose optional fields are left out when nil.


class SGLangEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class SGLangStored(SGLangEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SGLangRemoved(SGLangEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SGLangCleared(SGLangEvent, tag="AllBlocksCleared"):
    pass


class SGLangBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[SGLangStored | SGLangRemoved | SGLangCleared]
    attn_dp_rank: int | None = None


def signed_head(digest: bytes) -> int:
    """SGLang's ``hash_str_to_int64``: the hex digest's first 16 characters, as a signed int64."""
    value = int(digest.hex()[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def test_sglang_payload_is_what_sglangs_own_structs_encode() -> None:
    """Decoded with SGLang's declarations and encoded again, the payload is byte for byte the same."""
    salted = BlockStored((H1, NEGATIVE), None, TOKENS, 16, 2, "sql-lora", cache_salt="tenant-a")
    cpu = BlockStored((H2,), None, TOKENS[:16], 16, None, None, medium="CPU")
    removals: list[KVEvent] = [BlockRemoved((H1,)), BlockRemoved((H2,)), BlockRemoved((H1,), medium="CPU")]
    events: list[KVEvent] = [STORED, salted, *removals, cpu, AllBlocksCleared()]
    payload = encode_batch(events, ts=2.5, dp_rank=3, encoding="sglang", hash_format="int")
    batch = msgspec.msgpack.decode(payload, type=SGLangBatch)
    assert msgspec.msgpack.encode(batch) == payload
    assert (batch.ts, batch.attn_dp_rank) == (2.5, 3)
    # Pages coalesce while they continue the previous one alike; hashes are the digests' first 8
    # bytes, signed; removals of one medium merge.
    h1, h2, negative = signed_head(H1), signed_head(H2), signed_head(NEGATIVE)
    assert batch.events == [
        SGLangStored([h1, h2], None, list(TOKENS), 16, None, "GPU"),
        SGLangStored([h1, negative], None, list(TOKENS), 16, None, "GPU", "tenant-a", None, "sql-lora"),
        SGLangRemoved([h1, h2], "GPU"),
        SGLangRemoved([h1], "CPU_PINNED"),
        SGLangStored([h2], None, list(TOKENS[:16]), 16, None, "CPU_PINNED"),
        SGLangCleared(),
    ]
    assert signed_head(NEGATIVE) < 0  # a negative int64 on the wire (msgpack int, not uint64)
    raw = decode(payload)
    assert raw[1][0] == {
        "type": "BlockStored",
        "block_hashes": [h1, h2],
        "parent_block_hash": None,
        "token_ids": list(TOKENS),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
    }
