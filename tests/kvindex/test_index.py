"""The prefix index: store/remove semantics, re-chunking, tiers, bounds, and a differential test."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from extproc.kvindex.decode import decode_batch
from extproc.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, KVEvent, Source
from extproc.kvindex.index import HOT_BLOCKS, PrefixIndex
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.sim.block_hash import extend_block_hashes
from extproc.sim.engine_core import EngineCore, EngineParams, SimRequest
from extproc.sim.kv_wire import encode_batch
from extproc.types import EndpointAddress

A = Source(EndpointAddress("10.0.0.1:8000"), 0)
B = Source(EndpointAddress("10.0.0.2:8000"), 0)
C = Source(EndpointAddress("10.0.0.2:8000"), 1)
MODEL = "llama"
RNG = random.Random(3)
DOC = tuple(RNG.randrange(128_000) for _ in range(16 * 8))
OTHER = tuple(RNG.randrange(128_000) for _ in range(16 * 8))
KEYS = block_keys(DOC, 16, namespace_seed(MODEL))
H = [1000 + i for i in range(8)]  # engine hashes of DOC's blocks


#: How many blocks the index keeps in its recent layer before settling them (set per test below).
HOT = {"blocks": HOT_BLOCKS}


@pytest.fixture(autouse=True, params=["recent", "settled"])
def layer(request: pytest.FixtureRequest) -> None:
    """Every test runs twice: with blocks in the recent layer (dicts), and with blocks settled into
    the packed layer at the end of every batch that stored any."""
    HOT["blocks"] = HOT_BLOCKS if request.param == "recent" else 1


def make_index(
    *sources: Source, block_size: int = 16, max_entries: int = 10**6, per_source: int = 10**6
) -> PrefixIndex:
    index = PrefixIndex(max_entries=max_entries, max_entries_per_source=per_source, hot_blocks=HOT["blocks"])
    for source in sources:
        index.add_source(source, namespace=MODEL, block_size=block_size)
    return index


def stored(first: int, count: int, *, size: int = 16, parent: bool = True, **kw: str | None) -> BlockStored:
    """DOC's engine blocks [first, first+count) at ``size`` tokens each, chained to block first-1."""
    return BlockStored(
        tuple(H[first : first + count]),
        H[first - 1] if parent and first else None,
        DOC[first * size : (first + count) * size],
        size,
        kw.get("lora_name"),
        kw.get("medium"),
    )


def apply(index: PrefixIndex, source: Source, *events: KVEvent) -> None:
    index.apply(source, DecodedBatch(ts=0.0, events=list(events), dp_rank=source.dp_rank))


def test_stored_blocks_match_as_a_prefix() -> None:
    """A source holding DOC's first 3 blocks matches 3 of its keys, 0 of another document's."""
    index = make_index(A, B)
    result = index.apply(A, DecodedBatch(ts=0.0, events=[stored(0, 3)], dp_rank=0))
    assert result.stored == 3
    assert index.match(KEYS) == {A: 3, B: 0}
    assert index.match(KEYS[:2]) == {A: 2, B: 0}
    assert index.match(block_keys(OTHER, 16, namespace_seed(MODEL))) == {A: 0, B: 0}
    assert index.match([]) == {A: 0, B: 0}


def test_holders_answers_only_the_sources_holding_the_prompt() -> None:
    """The request path's lookup names the holders of the first block and how far each goes; a
    registered source holding nothing of the prompt is left out (it holds 0)."""
    index = make_index(A, B, C)
    apply(index, A, stored(0, 3))
    apply(index, C, stored(0, 5))
    assert index.holders(KEYS) == {A: 3, C: 5}
    assert index.holders(KEYS[1:]) == {A: 2, C: 4}
    assert index.holders(block_keys(OTHER, 16, namespace_seed(MODEL))) == {}
    assert index.holders([]) == {}
    apply(index, B, stored(0, 2, medium="CPU"))
    assert index.holders(KEYS) == {A: 3, C: 5}
    assert index.holders(KEYS, lower_tiers=True) == {A: 3, B: 2, C: 5}


def test_a_block_stored_twice_survives_one_removal() -> None:
    """Engine hashes are ref-counted: two copies need two removals; a third is an unknown removal."""
    index = make_index(A)
    apply(index, A, stored(0, 2), stored(0, 2))
    first = index.apply(A, DecodedBatch(ts=0.0, events=[BlockRemoved((H[1],))], dp_rank=0))
    assert (first.removed, first.removed_copies) == (0, 1)
    assert index.match(KEYS) == {A: 2}
    second = index.apply(
        A, DecodedBatch(ts=0.0, events=[BlockRemoved((H[1],)), BlockRemoved((H[1],))], dp_rank=0)
    )
    assert (second.removed, second.unknown_removals) == (1, 1)
    assert index.match(KEYS) == {A: 1}
    assert index.stats().totals.duplicates == 2


def test_removals_and_stores_in_one_batch_apply_in_order() -> None:
    """Removed, stored again and removed in one batch: gone. Stored again, then removed once: still
    held (two copies). The same whether the blocks were stored recently or long ago (settled)."""
    index = make_index(A)
    apply(index, A, stored(0, 3))
    apply(index, A, BlockRemoved((H[2],)), stored(2, 1), BlockRemoved((H[2],)))
    assert index.match(KEYS) == {A: 2}
    apply(index, A, stored(1, 1), BlockRemoved((H[1],)))
    assert index.match(KEYS) == {A: 2}
    result = index.apply(
        A, DecodedBatch(ts=0.0, events=[BlockRemoved((H[1], H[0])), BlockRemoved((H[0],))], dp_rank=0)
    )
    assert (result.removed, result.unknown_removals) == (2, 1)
    assert index.match(KEYS) == {A: 0} and index.stats().blocks == 0


def test_parents_resolve_across_batches_and_unknown_parents_are_counted() -> None:
    """A continuation chains from its parent's key; one whose parent is unknown is skipped and counted."""
    index = make_index(A)
    apply(index, A, stored(0, 2))
    apply(index, A, stored(2, 3))
    assert index.match(KEYS) == {A: 5}
    result = index.apply(
        A, DecodedBatch(ts=0.0, events=[stored(6, 2)], dp_rank=0)
    )  # parent H[5] never stored
    assert (result.stored, result.unresolved) == (0, 2)
    assert index.match(KEYS) == {A: 5}


def test_all_blocks_cleared_and_drop_source_only_touch_that_source() -> None:
    """AllBlocksCleared empties one source; drop_source forgets it, and its slot is reused cleanly."""
    index = make_index(A, B)
    apply(index, A, stored(0, 4))
    apply(index, B, stored(0, 2))
    apply(index, A, AllBlocksCleared())
    assert index.match(KEYS) == {A: 0, B: 2}
    apply(index, A, stored(0, 3))
    index.drop_source(B)
    index.drop_source(B)  # idempotent
    assert index.match(KEYS) == {A: 3}
    assert index.match(KEYS, [B]) == {B: 0}
    index.add_source(C, namespace=MODEL, block_size=16)  # takes B's old slot: must not inherit its blocks
    assert index.match(KEYS) == {A: 3, C: 0}
    assert index.stats().blocks == 3


@pytest.mark.parametrize("k", [2, 4], ids=["k2", "k4"])
def test_coarser_event_blocks_are_rechunked(k: int) -> None:
    """An event block of k*16 tokens becomes k index blocks; its hash maps to all k, removal drops all k."""
    index = make_index(A)
    first = BlockStored((7,), None, DOC[: 16 * k], 16 * k, None, None)
    second = BlockStored((8,), 7, DOC[16 * k : 32 * k], 16 * k, None, None)
    result = index.apply(A, DecodedBatch(ts=0.0, events=[first, second], dp_rank=0))
    assert result.stored == 2 * k
    assert index.match(KEYS) == {A: 2 * k}
    assert index.stats().sources[A].engine_hashes == 2
    apply(index, A, BlockRemoved((8,)))
    assert index.match(KEYS) == {A: k}
    apply(index, A, BlockRemoved((7,)))
    assert index.match(KEYS) == {A: 0} and index.stats().blocks == 0


@pytest.mark.parametrize(
    ("event_size", "source_size"),
    [(24, 16), (8, 16), (16, 32), (48, 32)],
    ids=["not-a-multiple", "finer", "finer-half", "one-and-a-half"],
)
def test_block_sizes_that_do_not_rechunk_are_counted_and_reported(event_size: int, source_size: int) -> None:
    """Event blocks that are not a whole multiple of the source's are skipped, counted, and shown in stats."""
    index = make_index(A, block_size=source_size)
    event = BlockStored((1, 2), None, DOC[: 2 * event_size], event_size, None, None)
    result = index.apply(A, DecodedBatch(ts=0.0, events=[event], dp_rank=0))
    assert (result.stored, result.mismatched) == (0, 2)
    assert index.stats().sources[A].mismatched_block_size == event_size


def test_lora_blocks_live_in_the_adapters_namespace() -> None:
    """The same tokens under a LoRA adapter match the adapter's keys, not the base model's."""
    index = make_index(A, B)
    apply(index, A, stored(0, 3, lora_name="sql-lora"))
    apply(index, B, stored(0, 2))
    apply(index, A, stored(3, 1, lora_name="sql-lora"))  # a continuation chains from the adapter's keys
    lora_keys = block_keys(DOC, 16, namespace_seed("sql-lora"))
    assert index.match(KEYS) == {A: 0, B: 2}
    assert index.match(lora_keys) == {A: 4, B: 0}


def test_salted_blocks_match_only_requests_with_the_same_salt() -> None:
    """``cache_salt`` keeps a prompt's cache apart: another salt, or none, matches none of it."""
    index = make_index(A, B)
    salted = [2000 + i for i in range(8)]  # the engine's hashes differ under a salt
    apply(index, A, BlockStored(tuple(salted[:3]), None, DOC[:48], 16, None, None, "tenant-a"))
    apply(index, A, BlockStored((salted[3],), salted[2], DOC[48:64], 16))  # continuation: no salt field
    apply(index, B, stored(0, 2))
    keys_a = block_keys(DOC, 16, namespace_seed(MODEL, "tenant-a"))
    assert index.match(keys_a) == {A: 4, B: 0}
    assert index.match(KEYS) == {A: 0, B: 2}
    assert index.match(block_keys(DOC, 16, namespace_seed(MODEL, "tenant-b"))) == {A: 0, B: 0}
    # With a LoRA adapter the salt applies within the adapter's namespace.
    apply(index, B, BlockStored((3000,), None, DOC[:16], 16, "sql-lora", None, "tenant-a"))
    assert index.match(block_keys(DOC, 16, namespace_seed("sql-lora", "tenant-a"))) == {A: 0, B: 1}
    assert namespace_seed(MODEL, "") == namespace_seed(MODEL)  # an empty salt is no salt


def test_match_stops_at_the_first_missing_block() -> None:
    """A source holding blocks 0, 1 and 3 matches 2: only leading consecutive blocks count."""
    index = make_index(A, B)
    apply(index, A, stored(0, 4))
    apply(index, A, BlockRemoved((H[2],)))
    apply(index, B, stored(0, 4))
    assert index.match(KEYS) == {A: 2, B: 4}


def test_match_restricted_to_sources() -> None:
    """``sources`` narrows the answer; unregistered sources asked for get 0."""
    index = make_index(A, B)
    apply(index, A, stored(0, 4))
    apply(index, B, stored(0, 1))
    assert index.match(KEYS, [B]) == {B: 1}
    assert index.match(KEYS, [C, A]) == {C: 0, A: 4}
    assert index.match(KEYS, []) == {}


def test_lower_tiers_are_kept_apart_from_the_gpu() -> None:
    """CPU blocks count only with ``lower_tiers``; an offload store without tokens resolves by hash."""
    index = make_index(A, B)
    apply(index, A, stored(0, 4))
    apply(index, A, BlockStored(tuple(H[:4]), None, (), 16, None, "CPU"))  # offloaded copies, no tokens
    apply(index, A, BlockRemoved((H[1],), "GPU"))
    apply(index, B, stored(0, 2, medium="CPU"))
    assert index.match(KEYS) == {A: 1, B: 0}
    assert index.match(KEYS, lower_tiers=True) == {A: 4, B: 2}
    apply(index, A, BlockRemoved((H[0],), "CPU"))
    assert index.match(KEYS, lower_tiers=True) == {A: 4, B: 2}  # block 0 is still on the GPU
    stats = index.stats().sources[A]
    assert (stats.gpu_blocks, stats.lower_blocks) == (3, 3)
    apply(index, A, BlockRemoved((H[0],), "GPU"))
    assert index.match(KEYS, lower_tiers=True) == {A: 0, B: 2}
    unknown = index.apply(
        B, DecodedBatch(ts=0.0, events=[BlockStored((99,), None, (), 16, None, "CPU")], dp_rank=0)
    )
    assert unknown.unresolved == 1


def test_aliased_engine_hashes_keep_a_key_held_until_the_last_goes() -> None:
    """Two engine hashes for the same tokens (e.g. different cache_salt) hold one key twice."""
    index = make_index(A)
    apply(index, A, BlockStored((1,), None, DOC[:16], 16, None, None))
    apply(index, A, BlockStored((2,), None, DOC[:16], 16, None, None))
    apply(index, A, BlockRemoved((1,)))
    assert index.match(KEYS) == {A: 1}
    apply(index, A, BlockRemoved((2,)))
    assert index.match(KEYS) == {A: 0} and index.stats().gpu_keys == 0


def test_per_source_bound_evicts_least_recently_stored() -> None:
    """Past max_entries_per_source the oldest stores go first; storing a block again makes it recent."""
    index = make_index(A, B, per_source=3)
    apply(index, A, stored(0, 1), stored(1, 1), stored(2, 1))
    apply(index, A, stored(0, 1))  # a second copy of block 0: now the most recent
    result = index.apply(A, DecodedBatch(ts=0.0, events=[stored(3, 1)], dp_rank=0))
    assert result.evicted == 1
    apply(index, B, stored(0, 3))
    held = {key for key in KEYS if index.match([key], [A])[A]}
    assert held == {KEYS[0], KEYS[2], KEYS[3]}
    assert index.stats().sources[A].gpu_blocks == 3 and index.stats().totals.evicted == 1


def test_total_bound_evicts_from_the_largest_source() -> None:
    """Past max_entries the largest source loses its oldest blocks, so one flood cannot starve the others."""
    index = make_index(A, B, max_entries=5)
    apply(index, B, stored(0, 2))
    apply(index, A, stored(0, 3))
    result = index.apply(A, DecodedBatch(ts=0.0, events=[stored(3, 2)], dp_rank=0))
    assert result.evicted == 2
    assert index.match(KEYS) == {A: 0, B: 2}
    assert index.stats().blocks == 5
    assert {key for key in KEYS if index.match([key], [A])[A]} == {KEYS[2], KEYS[3], KEYS[4]}


def test_large_bounds_evict_a_batch_at_a_time() -> None:
    """With a bound of 640, one overflow evicts 1 + 640/64 blocks, oldest first."""
    index = make_index(A, per_source=640)
    tokens = tuple(range(16 * 641))
    result = index.apply(
        A,
        DecodedBatch(
            ts=0.0, events=[BlockStored(tuple(range(641)), None, tokens, 16, None, None)], dp_rank=0
        ),
    )
    assert result.evicted == 11
    keys = block_keys(tokens, 16, namespace_seed(MODEL))
    assert index.match(keys[11:], [A]) == {A: 630}
    assert index.match(keys, [A]) == {A: 0}


def test_add_source_again_keeps_or_resets_by_settings() -> None:
    """Same namespace and block size: blocks kept; different ones: blocks dropped (they could never match)."""
    index = make_index(A)
    apply(index, A, stored(0, 2))
    index.add_source(A, namespace=MODEL, block_size=16)
    assert index.match(KEYS) == {A: 2}
    index.add_source(A, namespace=MODEL, block_size=32)
    assert index.match(KEYS) == {A: 0} and index.stats().sources[A].block_size == 32


def test_completeness_flags_and_unknown_sources() -> None:
    """Sources start complete; the glue marks gaps; unknown sources are a caller bug (KeyError)."""
    index = make_index(A, B)
    index.set_complete(B, False)
    assert index.incomplete_sources() == {B}
    assert not index.stats().sources[B].complete
    index.set_complete(B, True)
    assert index.incomplete_sources() == frozenset()
    with pytest.raises(KeyError):
        index.apply(C, DecodedBatch(ts=0.0, events=[], dp_rank=1))
    with pytest.raises(ValueError, match="block_size"):
        index.add_source(C, namespace=MODEL, block_size=0)
    with pytest.raises(ValueError, match="bounds"):
        PrefixIndex(max_entries=0, max_entries_per_source=1)
    assert index.sources() == [A, B]


def test_invalid_events_built_by_hand_are_counted_not_applied() -> None:
    """Events that bypass the decoder's checks cannot break the index's invariants."""
    index = make_index(A)
    bad = [
        BlockStored((1, 2), None, DOC[:16], 16, None, None),
        BlockStored((), None, DOC[:16], 16, None, None),
        BlockStored((1,), None, DOC[:16], 0, None, None),
    ]
    result = index.apply(A, DecodedBatch(ts=0.0, events=list(bad), dp_rank=0, skipped=4))
    assert (result.invalid, result.skipped, index.stats().blocks) == (3, 4, 0)


# --- differential test: the index against a dict-of-sets reference ------------------------------


class Reference:
    """What the index must answer, the slow obvious way (no bounds): per (source, tier) a dict
    engine hash -> [copies, keys]; a source holds a key if any live entry of a tier lists it."""

    def __init__(self) -> None:
        self.settings: dict[Source, tuple[str, int]] = {}
        self.tiers: dict[tuple[Source, bool], dict[int, list[object]]] = {}

    def add(self, source: Source, namespace: str, block_size: int) -> None:
        if self.settings.get(source, (namespace, block_size)) != (namespace, block_size):
            self.clear(source)
        self.settings[source] = (namespace, block_size)

    def clear(self, source: Source) -> None:
        self.tiers.pop((source, True), None)
        self.tiers.pop((source, False), None)

    def find(self, source: Source, engine_hash: int) -> tuple[int, ...] | None:
        for gpu in (True, False):
            entry = self.tiers.get((source, gpu), {}).get(engine_hash)
            if entry is not None:
                return entry[1]  # type: ignore[return-value]
        return None

    def apply(self, source: Source, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            return self.clear(source)
        tier = self.tiers.setdefault((source, event.medium in (None, "GPU")), {})
        if isinstance(event, BlockRemoved):
            for h in event.engine_hashes:
                if h in tier and tier[h][0] == 1:
                    del tier[h]
                elif h in tier:
                    tier[h][0] -= 1  # type: ignore[operator]
            return None
        namespace, size = self.settings[source]
        if not event.token_ids:
            found = [(h, self.find(source, h)) for h in event.engine_hashes]
            entries = [(h, keys) for h, keys in found if keys is not None]
        else:
            k, rest = divmod(event.block_size, size)
            parent = None if event.parent_engine_hash is None else self.find(source, event.parent_engine_hash)
            if rest or not k or (event.parent_engine_hash is not None and parent is None):
                return None
            seed = namespace_seed(event.lora_name or namespace)
            keys = block_keys(event.token_ids, size, seed, None if parent is None else parent[-1])
            entries = [(h, tuple(keys[i * k : (i + 1) * k])) for i, h in enumerate(event.engine_hashes)]
        for h, keys in entries:
            tier.setdefault(h, [0, keys])[0] += 1  # type: ignore[operator]
        return None

    def blocks(self, source: Source) -> tuple[int, int]:
        """Blocks held on the GPU and on lower tiers: every live entry's keys, with repetition."""
        gpu, lower = (self.tiers.get((source, gpu), {}) for gpu in (True, False))
        return sum(len(e[1]) for e in gpu.values()), sum(len(e[1]) for e in lower.values())  # type: ignore[arg-type]

    def match(self, keys: Sequence[int], sources: list[Source], lower: bool) -> dict[Source, int]:
        result = {}
        for source in sources:
            tiers = [self.tiers.get((source, gpu), {}) for gpu in ((True, False) if lower else (True,))]
            held = {key for tier in tiers for entry in tier.values() for key in entry[1]}  # type: ignore[attr-defined]
            result[source] = next((i for i, key in enumerate(keys) if key not in held), len(keys))
        return result


@dataclass(frozen=True)
class Op:
    """One step of a random scenario: apply an event, drop or (re-)add a source."""

    kind: str
    source: Source
    event: KVEvent | None = None
    namespace: str = MODEL
    block_size: int = 16

    def __repr__(self) -> str:
        return (
            f"Op({self.kind}, {self.source}, {self.event!r})"
            if self.event
            else f"Op({self.kind}, {self.source})"
        )


SOURCES = [A, B, C, Source(EndpointAddress("10.0.0.3:8000"), 0)]
FINE = {SOURCES[3]}  # registered with block size 8: 16-token events are re-chunked in two


def scenario(seed: int, length: int) -> tuple[list[Op], list[tuple[int, ...]]]:
    """A seeded event stream over SOURCES: shared prefixes, continuations, duplicates, removals,
    offload stores with and without tokens, mismatched sizes, unknown parents, clears, drops."""
    rng = random.Random(seed)
    vocab = rng.randint(3, 40)  # small vocabularies make equal blocks in different places
    prefixes = [tuple(rng.randrange(vocab) for _ in range(16 * rng.randint(1, 3))) for _ in range(2)]
    docs = [
        rng.choice(prefixes) + tuple(rng.randrange(vocab) for _ in range(16 * rng.randint(1, 4)))
        for _ in range(5)
    ]
    salts = {s: rng.choice([0, hash(s)]) for s in SOURCES}  # equal engine hashes across pods, or not
    history: dict[Source, list[BlockStored]] = {s: [] for s in SOURCES}
    ops = [Op("add", s, block_size=8 if s in FINE else 16) for s in SOURCES]
    for _ in range(length):
        source = rng.choice(SOURCES)
        roll = rng.random()
        if roll < 0.5:
            event = random_store(rng, docs, salts[source])
            history[source].append(event)
        elif roll < 0.6 and history[source]:
            event = rng.choice(history[source][-8:])  # again: duplicate copies
            if rng.random() < 0.5:
                event = BlockStored(event.engine_hashes, None, (), event.block_size, None, "CPU")
            history[source].append(event)
        elif roll < 0.85:
            stores = history[source] or [BlockStored((1,), None, (), 16)]
            origin = rng.choice(stores[-8:] if rng.random() < 0.7 else stores)  # recent ones mostly
            medium = origin.medium if rng.random() < 0.7 else rng.choice([None, "GPU", "CPU"])
            event = BlockRemoved((rng.choice(origin.engine_hashes),), medium)
        elif roll < 0.9:
            event = AllBlocksCleared()
        elif roll < 0.95:
            ops.append(Op("drop", source))
            ops.append(Op("add", source, block_size=8 if source in FINE else 16))
            continue
        else:
            ops.append(
                Op(
                    "add",
                    source,
                    namespace=rng.choice([MODEL, "other"]),
                    block_size=8 if source in FINE else 16,
                )
            )
            continue
        ops.append(Op("apply", source, event))
    return ops, docs


def random_store(rng: random.Random, docs: list[tuple[int, ...]], salt: int) -> BlockStored:
    doc = rng.choice(docs)
    size = rng.choice([16, 16, 16, 32, 24, 8])
    blocks = len(doc) // size
    if not blocks:
        size, blocks = 16, len(doc) // 16
    first = rng.randrange(blocks) if rng.random() < 0.6 else 0
    count = rng.randint(1, blocks - first)
    lora = rng.choice([None, None, None, "lora-x"])

    def engine_hash(block: int) -> int:  # a chained hash over the prefix, like vLLM's
        return hash((salt, lora, doc[: (block + 1) * size])) & ((1 << 64) - 1)

    return BlockStored(
        tuple(engine_hash(b) for b in range(first, first + count)),
        engine_hash(first - 1) if first else None,
        doc[first * size : (first + count) * size],
        size,
        lora,
        rng.choice([None, "GPU", "GPU", "CPU"]),
    )


def queries(docs: list[tuple[int, ...]]) -> list[tuple[list[int], list[Source]]]:
    """Every document as keys in every namespace at each block size, with the sources using that size."""
    result = []
    for tokens in docs:
        for namespace in (MODEL, "other", "lora-x"):
            for size, sources in ((16, [s for s in SOURCES if s not in FINE]), (8, sorted(FINE))):
                result.append((block_keys(tokens, size, namespace_seed(namespace)), sources))
    return result


def first_disagreement(ops: list[Op], docs: list[tuple[int, ...]], *, counts: bool = True) -> str | None:
    """Run ``ops`` through both models, checking every query (and with ``counts`` each source's
    block counts) after every op; describe the first difference."""
    index = PrefixIndex(max_entries=10**9, max_entries_per_source=10**9, hot_blocks=HOT["blocks"])
    reference = Reference()
    checks = queries(docs)
    for step, op in enumerate(ops):
        if op.kind != "add" and op.source not in reference.settings:
            continue  # shrinking removed the add this op needs
        if op.kind == "add":
            index.add_source(op.source, namespace=op.namespace, block_size=op.block_size)
            reference.add(op.source, op.namespace, op.block_size)
        elif op.kind == "drop":
            index.drop_source(op.source)
            reference.clear(op.source)
            reference.settings.pop(op.source)
        else:
            assert op.event is not None
            index.apply(op.source, DecodedBatch(ts=0.0, events=[op.event], dp_rank=op.source.dp_rank))
            reference.apply(op.source, op.event)
        stats = index.stats().sources
        for source in reference.settings if counts else ():
            got, want = (stats[source].gpu_blocks, stats[source].lower_blocks), reference.blocks(source)
            if got != want:
                return f"after op {step} ({op!r}): {source} holds (gpu, lower) blocks {got}, reference {want}"
        for keys, sources in checks:
            for lower in (False, True):
                live = [s for s in sources if s in reference.settings]
                got, want = index.match(keys, live, lower_tiers=lower), reference.match(keys, live, lower)
                if got != want:
                    return f"after op {step} ({op!r}), lower_tiers={lower}: index {got} != reference {want}"
                every = reference.match(keys, list(reference.settings), lower)
                held = {s: n for s, n in every.items() if n}
                if (got_held := index.holders(keys, lower_tiers=lower)) != held:
                    return f"after op {step} ({op!r}), lower_tiers={lower}: holders {got_held} != {held}"
    return None


def shrink(ops: list[Op], docs: list[tuple[int, ...]], *, counts: bool = True) -> list[Op]:
    """Greedily drop ops (halves, then singles) while the disagreement persists: a minimal repro."""
    chunk = len(ops) // 2
    while chunk >= 1:
        i = 0
        while i < len(ops):
            candidate = ops[:i] + ops[i + chunk :]
            if first_disagreement(candidate, docs, counts=counts) is not None:
                ops = candidate
            else:
                i += chunk
        chunk //= 2
    return ops


@pytest.mark.parametrize("seed", range(40))
def test_index_agrees_with_a_dict_of_sets_reference(seed: int) -> None:
    """Seeded random streams: every match, GPU-only and all tiers, equals the reference's."""
    ops, docs = scenario(seed, length=80)
    problem = first_disagreement(ops, docs)
    if problem is not None:
        smallest = shrink(ops, docs)
        listing = "\n".join(repr(op) for op in smallest)
        pytest.fail(
            f"seed {seed}: {problem}\nsmallest failing sequence ({len(smallest)} ops):\n{listing}\n"
            f"-> {first_disagreement(smallest, docs)}"
        )


@pytest.mark.parametrize("seed", range(40, 60))
def test_both_layers_at_once_agree_with_the_reference(seed: int) -> None:
    """Settling every few blocks leaves some blocks recent and some settled, a hash stored again
    after it settled in both, and removals split between them: matches still equal the reference's
    (block counts may count a re-stored block twice until the next settling, so they are not compared)."""
    HOT["blocks"] = 3
    ops, docs = scenario(seed, length=80)
    problem = first_disagreement(ops, docs, counts=False)
    if problem is not None:
        smallest = shrink(ops, docs, counts=False)
        listing = "\n".join(repr(op) for op in smallest)
        pytest.fail(f"seed {seed}: {problem}\nsmallest failing sequence ({len(smallest)} ops):\n{listing}")


# --- end to end: the simulator's engine -> real wire bytes -> decode -> index --------------------


@pytest.mark.parametrize(
    ("encoding", "hash_format"),
    [("maps", "int"), ("arrays", "int"), ("maps", "bytes")],
    ids=["maps-int", "arrays-int", "maps-bytes"],
)
def test_index_fed_by_the_simulated_engine_matches_its_cache(encoding: str, hash_format: str) -> None:
    """Every step's events, encoded as vLLM does and decoded by us, give exactly the engine's cache hits."""
    params = EngineParams(
        block_size=16, num_gpu_blocks=48, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512
    )
    core = EngineCore(params)
    index = make_index(A)
    rng = random.Random(encoding + hash_format)
    prefixes = [[rng.randrange(50) for _ in range(16 * rng.randint(1, 6))] for _ in range(3)]
    prompts: list[tuple[list[int], str | None]] = []
    now = 0.0
    for number in range(40):
        lora = rng.choice([None, None, "sql-lora"])
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 40))]
        prompts.append((prompt, lora))
        request = SimRequest(f"r{number}", prompt, [1] * rng.randint(1, 20), lora, 1 if lora else None)
        core.add_request(request)
        while core.has_work and rng.random() < 0.7:
            step = core.step(now)
            now += step.duration
            if step.events:
                payload = encode_batch(
                    step.events, ts=now, dp_rank=0, encoding=encoding, hash_format=hash_format
                )
                index.apply(A, decode_batch(payload))
        for tokens, adapter in prompts:
            hashes: list[bytes] = []
            extend_block_hashes(hashes, tokens, 16, adapter)
            expected = core.cache.longest_hit(hashes, len(tokens) + 16)
            keys = block_keys(tokens, 16, namespace_seed(adapter or MODEL))
            assert index.match(keys) == {A: expected}, (number, tokens, adapter)
    assert index.stats().totals.unresolved == 0 and index.stats().totals.unknown_removals == 0


def test_tokenless_offload_stores_are_ref_counted_like_any_other() -> None:
    """The same hash offloaded twice without tokens needs two removals, then nothing is left."""
    index = make_index(A)
    apply(index, A, stored(0, 2))
    offload = BlockStored(tuple(H[:2]), None, (), 16, None, "CPU")
    apply(index, A, offload, offload)
    apply(index, A, BlockRemoved(tuple(H[:2]), None))  # the GPU copies go
    apply(index, A, BlockRemoved(tuple(H[:2]), "CPU"))
    assert index.match(KEYS, lower_tiers=True) == {A: 2}
    apply(index, A, BlockRemoved(tuple(H[:2]), "CPU"))
    assert index.match(KEYS, lower_tiers=True) == {A: 0}
    stats = index.stats()
    assert (stats.blocks, stats.lower_keys, stats.totals.unknown_removals) == (0, 0, 0)


def test_bounds_count_rechunked_blocks_and_evict_whole_engine_blocks() -> None:
    """A 32-token engine block is 2 index blocks: one over the bound of 4 evicts that one engine block."""
    index = make_index(A, per_source=4)
    events = [
        BlockStored((7 + i,), 7 + i - 1 if i else None, DOC[32 * i : 32 * i + 32], 32) for i in range(3)
    ]
    result = index.apply(A, DecodedBatch(ts=0.0, events=events, dp_rank=0))
    assert (result.stored, result.evicted) == (6, 2)
    assert index.stats().sources[A].gpu_blocks == 4
    assert index.match(KEYS[2:6]) == {A: 4} and index.match(KEYS) == {A: 0}


@pytest.mark.parametrize("sources", [5, 70], ids=["uint64-masks", "wide-masks"])
def test_long_prompts_drop_holders_at_every_chunk_boundary(sources: int) -> None:
    """A lookup over a long prompt walks it in chunks (512 keys, then 1024, ...): sources whose
    prefix ends just before, at and after a chunk boundary are each credited exactly their prefix,
    whether their blocks settled long ago or were stored since, with up to 64 sources and more."""
    lengths = [0, 1, 2, 511, 512, 513, 1023, 1024, 1100, 1536, 1537, 1600]
    tokens = tuple(random.Random(sources).randrange(128_000) for _ in range(16 * 1600))
    keys = block_keys(tokens, 16, namespace_seed(MODEL))
    members = [Source(EndpointAddress(f"10.1.0.{i}:8000"), 0) for i in range(sources)]
    # Settling every 300 blocks or so as well: a lookup then sees both layers at once.
    mixed = PrefixIndex(max_entries=10**6, max_entries_per_source=10**6, hot_blocks=300)
    index = make_index(*members)
    for source in members:
        mixed.add_source(source, namespace=MODEL, block_size=16)
    expected = {}
    for i, source in enumerate(members):
        held = lengths[i % len(lengths)]
        for first in range(0, held, 64):  # one event per 64 blocks, each chained to the last
            count = min(64, held - first)
            event = BlockStored(
                tuple(range(first, first + count)),
                first - 1 if first else None,
                tokens[first * 16 : (first + count) * 16],
                16,
                None,
                None,
            )
            apply(index, source, event)
            apply(mixed, source, event)
        if held:
            expected[source] = held
    assert 0 < mixed.stats().settled_blocks < mixed.stats().blocks
    for lookup in (index, mixed):
        assert lookup.holders(keys) == expected
        assert lookup.match(keys) == {source: expected.get(source, 0) for source in members}
        assert lookup.holders(keys[:700]) == {source: min(n, 700) for source, n in expected.items()}
