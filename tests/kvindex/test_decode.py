"""Decoding KV-event payloads: both vLLM encodings, every hash form, and hostile input."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import msgpack
import pytest
from sim.kv_subscriber import decode_batch as reference_decode
from sim.kv_subscriber import hash_to_int

from extproc.kvindex.decode import MAX_PAYLOAD_BYTES, KVDecodeError, decode_batch
from extproc.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch
from extproc.sim import kv_events as sim
from extproc.sim.kv_wire import encode_batch

U64 = (1 << 64) - 1
D1 = hashlib.sha256(b"one").digest()
D2 = hashlib.sha256(b"two").digest()
D3 = hashlib.sha256(b"three").digest()
TOKENS = tuple(range(1000, 1032))


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def stored_array(hashes: list[Any], parent: Any = None, tokens: Any = TOKENS, size: Any = 16) -> list[Any]:
    """A vLLM 0.22 array-form BlockStored with every field."""
    return ["BlockStored", hashes, parent, list(tokens), size, None, "GPU", None, None, 0, None, None]


def stored_map(hashes: list[Any], parent: Any = None, tokens: Any = TOKENS, size: Any = 16) -> dict[str, Any]:
    """A vLLM 0.33 map-form BlockStored as the live capture shows it."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


def pack(*batch: Any) -> bytes:
    return msgpack.packb(list(batch), use_bin_type=True)


SIM_EVENTS: list[sim.KVEvent] = [
    sim.BlockStored((D1, D2), None, TOKENS, 16, None, None),
    sim.BlockStored((D3,), D2, TOKENS[:16], 16, 1, "sql-lora"),
    sim.BlockRemoved((D1,)),
    sim.BlockStored((D1,), None, TOKENS[:16], 16, None, None, medium="CPU"),
    sim.AllBlocksCleared(),
]
EXPECTED = [
    BlockStored((low64(D1), low64(D2)), None, TOKENS, 16, None, "GPU"),
    BlockStored((low64(D3),), low64(D2), TOKENS[:16], 16, "sql-lora", "GPU"),
    BlockRemoved((low64(D1),), "GPU"),
    BlockStored((low64(D1),), None, TOKENS[:16], 16, None, "CPU"),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
@pytest.mark.parametrize("encoding", ["arrays", "maps"])
def test_decodes_what_the_simulator_publishes(encoding: str, hash_format: str) -> None:
    """Both event encodings and both hash formats decode to the same domain events."""
    payload = encode_batch(SIM_EVENTS, ts=12.5, dp_rank=3, encoding=encoding, hash_format=hash_format)
    assert decode_batch(payload) == DecodedBatch(ts=12.5, events=EXPECTED, dp_rank=3, skipped=0)


def random_sim_events(rng: random.Random) -> list[sim.KVEvent]:
    events: list[sim.KVEvent] = []
    for _ in range(rng.randint(0, 6)):
        kind = rng.random()
        digests = tuple(rng.randbytes(32) for _ in range(rng.randint(1, 4)))
        if kind < 0.6:
            size = rng.choice([1, 16, 32])
            tokens = tuple(rng.randrange(200_000) for _ in range(size * len(digests)))
            parent = rng.choice([None, rng.randbytes(32)])
            lora = rng.choice([(None, None), (2, "lora-b")])
            events.append(
                sim.BlockStored(digests, parent, tokens, size, *lora, medium=rng.choice(["GPU", "CPU"]))
            )
        elif kind < 0.9:
            events.append(sim.BlockRemoved(digests[:1], medium=rng.choice(["GPU", "CPU"])))
        else:
            events.append(sim.AllBlocksCleared())
    return events


@pytest.mark.parametrize("encoding", ["arrays", "maps"])
def test_agrees_with_the_independent_reference_decoder(encoding: str) -> None:
    """Seeded random batches decode to what tests/sim/kv_subscriber.py (msgpack, no extproc) reads."""
    rng = random.Random(5)
    for _ in range(200):
        payload = encode_batch(
            random_sim_events(rng),
            ts=1.0,
            dp_rank=0,
            encoding=encoding,
            hash_format=rng.choice(["int", "bytes"]),
        )
        ours, reference = decode_batch(payload), reference_decode(payload)
        assert len(ours.events) == len(reference.events) and ours.dp_rank == reference.dp_rank
        for event, ref in zip(ours.events, reference.events, strict=True):
            assert type(event).__name__ == ref["type"]
            if isinstance(event, BlockStored | BlockRemoved):
                assert event.engine_hashes == tuple(hash_to_int(h) for h in ref["block_hashes"])
                assert event.medium == ref["medium"]
            if isinstance(event, BlockStored):
                parent = ref["parent_block_hash"]
                assert event.parent_engine_hash == (None if parent is None else hash_to_int(parent))
                assert list(event.token_ids) == ref["token_ids"] and event.block_size == ref["block_size"]
                assert event.lora_name == ref["lora_name"]


ONE = stored_array([7], tokens=TOKENS[:16])


@pytest.mark.parametrize(
    ("payload", "ts", "dp_rank"),
    [
        (pack(1.5, [ONE]), 1.5, None),
        (pack(1.5, [ONE], None), 1.5, None),
        (pack(1.5, [ONE], 2), 1.5, 2),
        (pack(1.5, [ONE], 2, "future", {"x": [1]}), 1.5, 2),
        (pack(1.5, [ONE], "not-a-rank"), 1.5, None),
        (pack(7, [ONE], 0), 7.0, 0),
    ],
    ids=["vllm-0.9.0-two-elements", "nil-rank", "rank", "extra-trailing-elements", "odd-rank", "int-ts"],
)
def test_batch_shapes(payload: bytes, ts: float, dp_rank: int | None) -> None:
    """``[ts, events]`` and ``[ts, events, dp_rank, ...]`` decode; a rank that is not an int reads as None."""
    assert decode_batch(payload) == DecodedBatch(
        ts=ts, events=[BlockStored((7,), None, TOKENS[:16], 16, None, "GPU")], dp_rank=dp_rank, skipped=0
    )


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        (-1, U64),
        (-(1 << 63), 1 << 63),
        ((1 << 63) + 5, (1 << 63) + 5),
        (U64, U64),
        (D1, low64(D1)),
        (b"\x01\x02", 0x0102),
        (b"", 0),
    ],
    ids=["int64-minus-1", "int64-min", "uint64-high", "uint64-max", "bin-32", "bin-short", "bin-empty"],
)
@pytest.mark.parametrize("form", ["array", "map"])
def test_hashes_are_normalised_to_uint64(form: str, wire: int | bytes, expected: int) -> None:
    """int64 negatives wrap mod 2**64, bin takes its last 8 bytes big-endian, in hashes and parents."""
    make = stored_array if form == "array" else stored_map
    event = decode_batch(pack(0.0, [make([wire, 9], parent=wire, tokens=TOKENS)], 0)).events[0]
    assert isinstance(event, BlockStored)
    assert event.engine_hashes == (expected, 9) and event.parent_engine_hash == expected
    removed = (
        ["BlockRemoved", [wire], "GPU"]
        if form == "array"
        else {"type": "BlockRemoved", "block_hashes": [wire]}
    )
    assert decode_batch(pack(0.0, [removed], 0)).events == [
        BlockRemoved((expected,), None if form == "map" else "GPU")
    ]


def test_unknown_tags_keys_and_trailing_elements_are_ignored() -> None:
    """Unknown event types are skipped and counted; unknown keys and extra trailing fields are ignored."""
    future_map = {**stored_map([1, 3]), "lookahead_token_ids": [[1, 2]], "brand_new": {"x": [1, {"y": None}]}}
    future_array = [*stored_array([2, 4]), "LOCAL", "tier-0", "session", [[1]], "and more", {"k": 1}]
    payload = pack(
        0.0,
        [["BlockUpdated", [1]], {"type": "KVTransfer"}, future_map, future_array, ["AllBlocksCleared", 1, 2]],
        0,
    )
    batch = decode_batch(payload)
    assert batch.skipped == 2
    assert batch.events == [
        BlockStored((1, 3), None, TOKENS, 16, None, "GPU"),
        BlockStored((2, 4), None, TOKENS, 16, None, "GPU"),
        AllBlocksCleared(),
    ]


def group_array(group_idx: Any, kind: Any) -> list[Any]:
    return ["BlockStored", [5], None, list(TOKENS[:16]), 16, None, "GPU", None, None, group_idx, kind, None]


def group_map(group_idx: Any, kind: Any) -> dict[str, Any]:
    event = {**stored_map([5], tokens=TOKENS[:16]), "group_idx": group_idx, "kv_cache_spec_kind": kind}
    return {k: v for k, v in event.items() if v is not None}


@pytest.mark.parametrize(
    ("make", "group_idx", "kind", "kept"),
    [
        (group_array, 0, None, True),
        (group_array, None, None, True),
        (group_array, 1, None, False),
        (group_map, 1, None, False),
        (group_map, 0, "sliding_window", False),
        (group_map, 2, "mamba", False),
        (group_map, 1, "full_attention", True),
        (group_array, 3, "mla_attention", True),
    ],
    ids=[
        "array-group-0", "array-no-group", "array-group-1", "map-group-1", "sliding-window-kind",
        "mamba-kind", "full-attention-kind", "mla-kind",
    ],
)  # fmt: skip
def test_secondary_kv_cache_groups_are_ignored_and_counted(
    make: Any, group_idx: int | None, kind: str | None, kept: bool
) -> None:
    """Hybrid models: only the main attention group counts (a named main kind, or group 0 / none)."""
    batch = decode_batch(pack(0.0, [make(group_idx, kind)], 0))
    assert (len(batch.events), batch.ignored, batch.skipped) == ((1, 0, 0) if kept else (0, 1, 0))


@pytest.mark.parametrize(
    ("removed", "kept"),
    [
        (["BlockRemoved", [5], "GPU", 0], True),
        (["BlockRemoved", [5], "GPU", 1], False),
        ({"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 2}, False),
    ],
    ids=["group-0", "array-group-1", "map-group-2"],
)
def test_removals_of_secondary_groups_are_ignored(removed: Any, kept: bool) -> None:
    """A BlockRemoved of a secondary group does not un-hold the main group's block."""
    batch = decode_batch(pack(0.0, [removed], 0))
    assert (len(batch.events), batch.ignored) == ((1, 0) if kept else (0, 1))


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        (
            ["BlockStored", [5], None, list(TOKENS[:16]), 16],
            BlockStored((5,), None, TOKENS[:16], 16, None, None),
        ),
        ({"type": "BlockStored", "block_hashes": [5], "token_ids": [1, 2], "block_size": 2}, None),
        (stored_map([5], tokens=TOKENS, size=32), BlockStored((5,), None, TOKENS, 32, None, "GPU")),
        (stored_array([5, 6], tokens=()), BlockStored((5, 6), None, (), 16, None, "GPU")),
        (["BlockRemoved", [5]], BlockRemoved((5,), None)),
    ],
    ids=[
        "vllm-0.9.0-five-fields",
        "map-minimal",
        "partial-entry-span-32",
        "no-tokens-offload",
        "removed-no-medium",
    ],
)
def test_optional_fields_partial_entries_and_tokenless_stores(event: Any, expected: Any) -> None:
    """Missing optional fields are None; a single-hash partial entry and a store without tokens are kept."""
    (got,) = decode_batch(pack(0.0, [event], 0)).events
    assert got == (expected or BlockStored((5,), None, (1, 2), 2, None, None))


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [1], None, list(TOKENS), 0],
        ["BlockStored", [1], None, list(TOKENS), -16],
        ["BlockStored", [1], None, list(TOKENS[:20]), 16],
        ["BlockStored", [1, 2, 3], None, list(TOKENS), 16],
        ["BlockStored", [], None, [], 16],
        ["BlockStored", [1.5], None, list(TOKENS), 32],
        ["BlockStored", [1], None, ["a"] * 32, 32],
        ["BlockStored", [1], None, list(TOKENS), "32"],
        ["BlockStored", [1], [1], list(TOKENS), 32],
        ["BlockStored", 1, None, list(TOKENS), 32],
        ["BlockStored", [1], None],
        ["BlockStored", [1], None, list(TOKENS), 32, None, 7],
        ["BlockStored", [1], None, list(TOKENS), 32, None, "GPU", None, None, "0"],
        {"type": "BlockStored", "block_hashes": [1], "block_size": 16},
        {"type": "BlockStored", "token_ids": list(TOKENS), "block_size": 32},
        {"type": 5},
        {"block_hashes": [1]},
        ["BlockRemoved", "abc"],
        ["BlockRemoved"],
        [],
        "BlockStored",
        None,
        17,
    ],
    ids=[
        "size-zero", "size-negative", "token-count-mismatch", "too-few-tokens", "no-hashes", "float-hash",
        "string-tokens", "string-size", "list-parent", "hashes-not-list", "truncated", "int-medium",
        "str-group", "map-no-tokens", "map-no-hashes", "map-int-type", "map-no-type", "removed-hashes-str",
        "removed-no-hashes", "empty-array", "string", "nil", "int",
    ],
)  # fmt: skip
def test_malformed_events_are_skipped_and_counted(event: Any) -> None:
    """A bad event costs only itself: the good events around it are kept, the bad one is counted."""
    good = stored_array([9], tokens=TOKENS[:16])
    batch = decode_batch(pack(0.0, [good, event, good], 0))
    assert batch.skipped == 1
    assert batch.events == [BlockStored((9,), None, TOKENS[:16], 16, None, "GPU")] * 2


def salted_map(extra_keys: Any = None, **fields: Any) -> dict[str, Any]:
    return {**stored_map([5, 6], tokens=TOKENS), "extra_keys": extra_keys, **fields}


@pytest.mark.parametrize(
    ("event", "salt"),
    [
        (salted_map(cache_salt="tenant-a"), "tenant-a"),
        (salted_map(cache_salt=""), None),
        (salted_map([["tenant-a"], None]), "tenant-a"),
        (salted_map([["sql-lora", "tenant-a"], ["sql-lora"]], lora_name="sql-lora"), "tenant-a"),
        (salted_map([["sql-lora"], ["sql-lora"]], lora_name="sql-lora"), None),
        (salted_map([[["mm-abc", 0], "tenant-a"], [["mm-abc", 16]]]), "tenant-a"),
        (salted_map([None, None]), None),
        (salted_map([[7]]), None),
        (salted_map("not-a-list"), None),
        (salted_map([["tenant-a"], None], parent_block_hash=4), None),
        ([*stored_array([5, 6])[:8], [["tenant-a"], None], 0], "tenant-a"),
    ],
    ids=[
        "sglang-field", "sglang-empty", "vllm-extra-keys", "vllm-lora-then-salt", "vllm-lora-only",
        "vllm-image-pair-then-salt", "vllm-nil-entries", "vllm-old-int-lora", "vllm-garbage",
        "continuation-chains-from-parent", "vllm-array-form",
    ],
)  # fmt: skip
def test_the_cache_salt_of_a_chains_first_blocks_is_read_from_either_engine(
    event: Any, salt: str | None
) -> None:
    """SGLang names the salt; vLLM puts it in the first block's extra keys; both reach the index."""
    batch = decode_batch(pack(0.0, [event], 0))
    assert batch.skipped == 0
    (got,) = batch.events
    assert isinstance(got, BlockStored) and got.engine_hashes == (5, 6)
    assert got.cache_salt == salt


def test_salted_events_from_the_simulator_decode_with_their_salt() -> None:
    first = sim.BlockStored((D1, D2), None, TOKENS, 16, 1, "sql-lora", cache_salt="tenant-a")
    rest = sim.BlockStored((D3,), D2, TOKENS[:16], 16, 1, "sql-lora", cache_salt="tenant-a")
    for encoding in ("arrays", "maps"):
        payload = encode_batch([first, rest], ts=1.0, dp_rank=0, encoding=encoding, hash_format="int")
        assert [e.cache_salt for e in decode_batch(payload).events] == ["tenant-a", None]  # type: ignore[union-attr]
        (ref, _) = reference_decode(payload).events
        assert ref["extra_keys"] == [["sql-lora", "tenant-a"], ["sql-lora"]]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (pack(1.0, [], 0) + b"\x00", "not valid msgpack"),
        (pack(1.0, [], 0)[:-1], "not valid msgpack"),
        (msgpack.packb({"ts": 1.0, "events": []}), "not an array"),
        (msgpack.packb("hello"), "not an array"),
        (pack(1.0), "at least length 2"),
        (pack(), "at least length 2"),
        (pack("yesterday", []), "`ts`"),
        (pack(None, []), "`ts`"),
        (pack(1.0, 5), "`events`"),
        (pack(1.0, {"type": "BlockStored"}), "`events`"),
        (b"\x91" * 100_000 + b"\xc0", "at least length 2"),
        (b"\x93\xcb" + b"\x00" * 8 + b"\x91" * 100_000 + b"\xc0", "nested too deeply"),
        (b"\xdd\xff\xff\xff\xff", "not valid msgpack"),
    ],
    ids=[
        "empty", "reserved-byte", "trailing-bytes", "truncated", "map", "string", "one-element",
        "empty-array", "string-ts", "nil-ts", "events-int", "events-map", "deep-nesting", "deep-in-events",
        "huge-array-header",
    ],
)  # fmt: skip
def test_unusable_batches_raise_kvdecodeerror(payload: bytes, message: str) -> None:
    """Only a batch unusable as a whole raises, with a message that says what is wrong."""
    with pytest.raises(KVDecodeError, match=message):
        decode_batch(payload)


def test_oversized_payloads_are_refused_before_decoding() -> None:
    """The size cap is checked first; the default is 16 MiB."""
    assert MAX_PAYLOAD_BYTES == 16 * 1024 * 1024
    with pytest.raises(KVDecodeError, match="over the 100-byte cap"):
        decode_batch(b"\x00" * 101, max_bytes=100)


def check_well_formed(batch: DecodedBatch) -> None:
    """What the index may rely on for anything decode_batch returns."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            assert event.engine_hashes and event.block_size >= 1
            assert not event.token_ids or len(event.token_ids) == len(event.engine_hashes) * event.block_size
            assert all(type(t) is int for t in event.token_ids)
        if isinstance(event, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h <= U64 for h in event.engine_hashes)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value, biased towards the shapes a KV batch has."""
    choices = [
        lambda: rng.randint(-(1 << 63), U64),
        lambda: rng.randint(0, 300),
        lambda: rng.random(),
        lambda: rng.choice(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type", ""]),
        lambda: rng.randbytes(rng.randint(0, 40)),
        lambda: None,
        lambda: rng.choice([True, False]),
    ]
    if depth < 4:
        choices += [
            lambda: [random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))],
            lambda: {
                rng.choice(["type", "block_hashes", "token_ids", "block_size", "medium", "x"]): random_value(
                    rng, depth + 1
                )
                for _ in range(rng.randint(0, 5))
            },
        ]
    return rng.choice(choices)()


def mutate(rng: random.Random, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if op < 0.5 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op < 0.75:
            del data[rng.randrange(len(data) + 1) :]
        else:
            data[rng.randrange(len(data) + 1) : 0] = rng.randbytes(rng.randint(1, 8))
    return bytes(data)


@pytest.mark.parametrize("kind", ["random-bytes", "random-structures", "mutated-valid-payloads"])
def test_fuzz_never_raises_anything_but_kvdecodeerror(kind: str) -> None:
    """Seeded garbage either decodes to well-formed events or raises KVDecodeError, nothing else."""
    rng = random.Random(kind)
    valid = [
        encode_batch(random_sim_events(rng), ts=1.0, dp_rank=0, encoding=enc, hash_format=fmt)
        for enc in ("arrays", "maps")
        for fmt in ("int", "bytes")
    ]
    for _ in range(3000):
        if kind == "random-bytes":
            payload = rng.randbytes(rng.randint(0, 64))
        elif kind == "random-structures":
            events = [random_value(rng) for _ in range(rng.randint(0, 4))]
            shell = [rng.random(), events, rng.choice([0, None, "x"])][: rng.randint(0, 4)]
            payload = msgpack.packb(shell if rng.random() < 0.9 else random_value(rng), use_bin_type=True)
        else:
            payload = mutate(rng, rng.choice(valid))
        try:
            batch = decode_batch(payload)
        except KVDecodeError:
            continue
        check_well_formed(batch)


def test_decodes_what_an_sglang_engine_publishes() -> None:
    """SGLang's coalesced pages (signed int64 hashes, the salt on every event) index as one prefix."""
    salted = sim.BlockStored((D1, D2), None, TOKENS, 16, None, None, cache_salt="tenant-a")
    payload = encode_batch(
        [salted, sim.BlockRemoved((D2,))], ts=1.0, dp_rank=2, encoding="sglang", hash_format="int"
    )
    batch = decode_batch(payload)
    head = [int.from_bytes(d[:8], "big") for d in (D1, D2)]
    assert batch.dp_rank == 2 and batch.skipped == 0
    assert batch.events == [
        BlockStored((head[0], head[1]), None, TOKENS, 16, None, "GPU", "tenant-a"),
        BlockRemoved((head[1],), "GPU"),
    ]
    # A continuation carries the salt too, but chains from its parent's key: the salt is not re-read.
    rest = sim.BlockStored((D3,), D2, TOKENS[:16], 16, None, None, cache_salt="tenant-a")
    (event,) = decode_batch(
        encode_batch([rest], ts=1.0, dp_rank=0, encoding="sglang", hash_format="int")
    ).events
    assert isinstance(event, BlockStored) and event.cache_salt is None


def test_sglang_eagle_bigram_pages_index_as_their_first_tokens() -> None:
    """EAGLE pages carry (token j, token j+1) pairs: their first elements are the page's tokens."""
    pairs = [[t, t + 1] for t in TOKENS[:16]]
    eagle = {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": None, "token_ids": pairs,
             "block_size": 16, "lora_id": None, "medium": "GPU"}  # fmt: skip
    plain = stored_map([9], tokens=TOKENS[:16])
    batch = decode_batch(pack(0.0, [eagle, plain], 0))
    assert batch.skipped == 0
    assert batch.events == [
        BlockStored(((-5) & U64,), None, TOKENS[:16], 16, None, "GPU"),
        BlockStored((9,), None, TOKENS[:16], 16, None, "GPU"),
    ]
    ragged = {**eagle, "token_ids": [[1, 2, 3]] * 16}
    assert decode_batch(pack(0.0, [ragged], 0)).skipped == 1
