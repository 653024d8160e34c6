"""The simulated block pool: vLLM v1 prefix-caching semantics and events that match its contents."""

from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from extproc.errors import ConfigError
from extproc.sim.block_hash import NONE_HASH, block_digest, block_hash, extend_block_hashes, none_hash
from extproc.sim.engine_core import EngineParams
from extproc.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from extproc.sim.prefix_cache import PrefixCache


def _hashes(tokens: Sequence[int], block_size: int, lora: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, block_size, lora)
    return hashes


def _run(
    cache: PrefixCache, rid: str, tokens: Sequence[int], lora: str | None = None, lora_id: int | None = None
) -> int:
    """Admit a request, compute its whole prompt and cache its full blocks; returns the hit tokens."""
    hashes = _hashes(tokens, cache.block_size, lora)
    hit = cache.longest_hit(hashes, len(tokens))
    assert cache.allocate(rid, hashes, hit, len(tokens), lora_name=lora, lora_id=lora_id)
    cache.record_query(len(tokens), hit * cache.block_size)
    cache.cache_blocks(rid, hashes, tokens, len(tokens))
    return hit * cache.block_size


class Replica:
    """What a subscriber rebuilds from the events: a multiset of hashes, each checked against its tokens."""

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.counts: Counter[bytes] = Counter()

    def apply(self, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.counts.clear()
            elif isinstance(event, BlockRemoved):
                (digest,) = event.block_hashes
                assert self.counts[digest] > 0, f"removed a hash that is not cached: {digest.hex()[:12]}"
                self.counts[digest] -= 1
                if not self.counts[digest]:
                    del self.counts[digest]
            else:
                self._check_stored(event)
                self.counts.update(event.block_hashes)

    def _check_stored(self, event: BlockStored) -> None:
        """Re-chunk the tokens at hash granularity and re-chain from the parent: every hash must match."""
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        k = event.block_size // self.hash_block_size
        chain = _hashes_from(event.parent_block_hash, event.token_ids, self.hash_block_size, event.lora_name)
        assert tuple(chain[k - 1 :: k]) == event.block_hashes


def _hashes_from(parent: bytes | None, tokens: Sequence[int], size: int, lora: str | None) -> list[bytes]:
    out = []
    for start in range(0, len(tokens), size):
        parent = block_hash(parent, tokens[start : start + size], lora)
        out.append(parent)
    return out


def test_block_hash_layout() -> None:
    """The digest is sha256(parent or NONE_HASH, count and tokens as uint32 LE, LoRA name): stable."""
    import hashlib

    expected = hashlib.sha256(NONE_HASH + struct.pack("<3I", 2, 7, 70000)).digest()
    assert block_hash(None, [7, 70000], None) == expected
    assert NONE_HASH == none_hash("vllm-none-hash") != none_hash("other-seed")
    assert len(block_hash(expected, [1], "adapter")) == 32


def test_xxhash_hashes_the_same_layout_into_16_bytes() -> None:
    """vLLM's --prefix-caching-hash-algo xxhash: xxh3_128 of the same layout."""
    import xxhash

    layout = NONE_HASH + struct.pack("<3I", 2, 7, 70000)
    assert block_hash(None, [7, 70000], None, digest=block_digest("xxhash")) == xxhash.xxh3_128_digest(layout)


def test_an_unknown_hash_algorithm_is_refused_by_name() -> None:
    expected = "prefix_caching_hash_algo must be one of sha256, xxhash, got 'md5'"
    with pytest.raises(ConfigError, match=expected):
        EngineParams(prefix_caching_hash_algo="md5")


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize(("lora", "salt"), [(None, None), ("adapter", None), (None, "tenant")])
def test_extending_a_chain_in_steps_gives_the_digests_of_hashing_block_by_block(
    lora: str | None, salt: str | None, algo: str
) -> None:
    """However the tokens arrive (a prompt, then generated tokens, partial blocks left over), the
    chain is each full block's digest on its parent's, as :func:`block_hash` makes it one by one."""
    digest = block_digest(algo)
    tokens = [(i * 7919) % 150_000 for i in range(1_000)]
    expected: list[bytes] = []
    parent = None
    for start in range(0, 992, 16):
        parent = block_hash(parent, tokens[start : start + 16], lora, salt, digest)
        expected.append(parent)
    assert len(set(expected)) == len(expected)
    hashes: list[bytes] = []
    for end in (5, 16, 300, 300, 999, 1_000):
        extend_block_hashes(hashes, tokens[:end], 16, lora, salt, digest)
        assert hashes == expected[: end // 16]


@pytest.mark.parametrize(
    ("a", "b", "lora_a", "lora_b", "shared"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], None, None, 1),
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], None, None, 2),
        ([1, 2, 3, 4, 5, 6, 7, 8], [0, 2, 3, 4, 5, 6, 7, 8], None, None, 0),
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], "sql", None, 0),
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], "sql", "chat", 0),
        ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8], "sql", "sql", 2),
    ],
    ids=["common-head", "identical", "first-token-differs", "lora-vs-base", "two-loras", "same-lora"],
)
def test_hash_chain_shares_equal_prefixes_only(
    a: list[int], b: list[int], lora_a: str | None, lora_b: str | None, shared: int
) -> None:
    """Equal leading blocks share digests; one differing token or another LoRA breaks the chain."""
    ha, hb = _hashes(a, 4, lora_a), _hashes(b, 4, lora_b)
    same = [x == y for x, y in zip(ha, hb, strict=True)]
    assert same == [True] * shared + [False] * (len(ha) - shared)


@pytest.mark.parametrize(
    ("second", "hit_tokens"),
    [
        (list(range(12)), 8),
        ([*range(12), 99], 12),
        ([*range(13), 99], 12),
        ([*range(6), 50, 51, 52], 4),
        ([*range(3)], 0),
        ([*range(4)], 0),
        ([*range(5)], 4),
        ([77, *range(1, 12)], 0),
    ],
    ids=[
        "full-hit-capped",
        "all-blocks",
        "longer",
        "partial",
        "shorter-than-block",
        "one-block",
        "block+1",
        "miss",
    ],
)
def test_lookup_counts_tokens_and_keeps_one_to_compute(second: list[int], hit_tokens: int) -> None:
    """Hits are whole leading blocks, capped at prompt_len - 1; queries and hits count tokens."""
    cache = PrefixCache(16, 4)
    assert _run(cache, "a", list(range(12))) == 0
    cache.free("a")
    assert _run(cache, "b", second) == hit_tokens
    assert (cache.queries, cache.hits) == (12 + len(second), hit_tokens)


def test_partial_tail_is_never_cached() -> None:
    """Only full blocks are hashed, cached and announced."""
    cache = PrefixCache(8, 4)
    _run(cache, "a", list(range(10)))
    (event,) = cache.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == tuple(range(8)) and len(event.block_hashes) == 2
    assert sum(cache.cached_hashes().values()) == 2


def test_stored_events_chain_and_skip_hits() -> None:
    """Incremental caching links events by parent; a request's cache hits are not announced again."""
    cache = PrefixCache(16, 4)
    tokens = list(range(16))
    hashes = _hashes(tokens, 4, "sql")
    assert cache.allocate("a", hashes, 0, 16, lora_name="sql", lora_id=3)
    cache.cache_blocks("a", hashes, tokens, 6)
    cache.cache_blocks("a", hashes, tokens, 7)  # still inside block 1: nothing new
    cache.cache_blocks("a", hashes, tokens, 16)
    first, second = cache.take_events()
    assert first == BlockStored((hashes[0],), None, (0, 1, 2, 3), 4, 3, "sql")
    assert second == BlockStored(tuple(hashes[1:]), hashes[0], tuple(range(4, 16)), 4, 3, "sql")
    _run(cache, "b", [*range(12), 100, 101, 102, 103], "sql", 3)
    (third,) = cache.take_events()
    assert isinstance(third, BlockStored) and third.parent_block_hash == hashes[2]
    assert third.token_ids == (100, 101, 102, 103)


def _evicted(events: Sequence[KVEvent]) -> list[bytes]:
    return [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]


def test_eviction_is_lru_and_tail_first() -> None:
    """Freed blocks stay cached; allocation evicts the least recently freed, a request's tail first."""
    cache = PrefixCache(8, 2)
    a, b = list(range(8)), list(range(100, 108))
    ha, hb = _hashes(a, 2), _hashes(b, 2)
    _run(cache, "a", a)
    _run(cache, "b", b)
    cache.free("a")
    cache.free("b")
    cache.take_events()
    assert cache.num_free == 8 and cache.usage == 0.0
    # A new 3-block request evicts a's tail first: a3, a2, a1.
    _run(cache, "c", list(range(200, 206)))
    assert _evicted(cache.take_events()) == [ha[3], ha[2], ha[1]]
    # A hit takes a cached block out of the free queue: reusing b0..b1 spares them from eviction.
    assert _run(cache, "d", [*b[:4], 7]) == 4
    assert _run(cache, "e", list(range(300, 304))) == 0
    assert _evicted(cache.take_events()) == [ha[0], hb[3], hb[2]]
    assert cache.usage == 1.0


def test_allocation_refused_changes_nothing() -> None:
    """Too few free blocks (hits in the free queue do not count as free) leaves the pool untouched."""
    cache = PrefixCache(4, 2)
    tokens = list(range(8))
    _run(cache, "a", tokens)
    cache.free("a")
    cache.take_events()
    hashes = _hashes([*tokens, 9, 9], 2)
    hit = cache.longest_hit(hashes, 10)
    assert hit == 4
    before = cache.cached_hashes()
    assert not cache.allocate("b", hashes, hit, 10)
    assert cache.num_free == 4 and cache.cached_hashes() == before and cache.take_events() == []


def test_grow_refused_changes_nothing() -> None:
    """Growing past the free blocks returns False and keeps the request's blocks."""
    cache = PrefixCache(3, 2)
    assert cache.allocate("a", [], 0, 2)
    assert cache.grow("a", 6) and cache.num_blocks_of("a") == 3
    assert not cache.grow("a", 7) and cache.num_blocks_of("a") == 3


def test_concurrent_duplicates_are_stored_and_removed_per_copy() -> None:
    """Two requests computing the same block each store it; the hash stays cached while a copy lives."""
    cache = PrefixCache(4, 2)
    tokens = [5, 6, 7, 8]
    hashes = _hashes(tokens, 2)
    for rid in ("a", "b"):
        assert cache.allocate(rid, hashes, cache.longest_hit(hashes, 4), 4)
    for rid in ("a", "b"):
        cache.cache_blocks(rid, hashes, tokens, 4)
    assert cache.cached_hashes() == Counter({hashes[0]: 2, hashes[1]: 2})
    replica = Replica(2)
    replica.apply(cache.take_events())
    cache.free("a")
    cache.free("b")
    assert cache.allocate("c", [], 0, 2)  # evicts a's tail copy only
    replica.apply(cache.take_events())
    assert replica.counts == cache.cached_hashes() == Counter({hashes[0]: 2, hashes[1]: 1})
    assert cache.longest_hit([*hashes, b"x"], 6) == 2


def test_reset_refused_while_blocks_are_in_use() -> None:
    """reset() fails (no event, cache kept) while a request holds blocks; then clears with one event."""
    cache = PrefixCache(8, 2)
    _run(cache, "a", list(range(6)))
    cache.take_events()
    assert not cache.reset()
    assert cache.take_events() == [] and sum(cache.cached_hashes().values()) == 3
    cache.free("a")
    assert cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.cached_hashes() == Counter()
    assert _run(cache, "b", list(range(6))) == 0
    # Evicting a block whose hash the reset dropped announces nothing.
    cache.free("b")
    cache.take_events()
    assert cache.reset()
    _run(cache, "c", list(range(100, 116)))
    assert _evicted(cache.take_events()) == []


@pytest.mark.parametrize(
    ("tokens", "groups"),
    [(10, 2), (11, 2), (12, 3), (3, 0)],
    ids=["two-groups-and-a-half", "odd-tail", "three-groups", "no-full-group"],
)
def test_published_block_size_groups(tokens: int, groups: int) -> None:
    """With k=2 events describe aligned pairs of blocks: last sub-hash, previous group's hash as parent."""
    cache = PrefixCache(16, 2, published_block_size=4)
    ids = list(range(tokens))
    hashes = _hashes(ids, 2)
    _run(cache, "a", ids)
    events = cache.take_events()
    if not groups:
        assert events == [] and cache.cached_hashes() == Counter()
        return
    (event,) = events
    assert event == BlockStored(
        tuple(hashes[2 * g + 1] for g in range(groups)), None, tuple(range(4 * groups)), 4, None, None
    )
    Replica(2).apply(events)
    assert cache.cached_hashes() == Counter(event.block_hashes)


def test_published_group_removed_once_on_first_sub_block_eviction() -> None:
    """A group's hash goes with its first evicted sub-block; evicting the others announces nothing."""
    cache = PrefixCache(4, 2, published_block_size=4)
    ids = list(range(8))
    hashes = _hashes(ids, 2)
    assert cache.allocate("a", hashes, 0, 8)
    cache.cache_blocks("a", hashes, ids, 5)
    cache.cache_blocks("a", hashes, ids, 8)
    first, second = cache.take_events()
    assert first == BlockStored((hashes[1],), None, (0, 1, 2, 3), 4, None, None)
    assert second == BlockStored((hashes[3],), hashes[1], (4, 5, 6, 7), 4, None, None)
    cache.free("a")  # free queue: s3, s2, s1, s0
    assert cache.allocate("b", [], 0, 2)
    assert cache.take_events() == [BlockRemoved((hashes[3],))]
    assert cache.allocate("c", [], 0, 2)
    assert cache.take_events() == []
    assert cache.cached_hashes() == Counter({hashes[1]: 1})


def test_construction_is_validated() -> None:
    """Bad sizes are refused with the field named."""
    with pytest.raises(ValueError, match="published_block_size"):
        PrefixCache(4, 4, published_block_size=6)
    with pytest.raises(ValueError, match="num_blocks"):
        PrefixCache(0, 4)


# -- differential test: events replayed by a subscriber == the cache's contents ------------------------


@dataclass
class _Live:
    tokens: list[int]
    hashes: list[bytes]
    computed: int
    lora: str | None


@dataclass
class _Workload:
    """A seeded random mix of admissions, partial computes, frees, preemptions and resets."""

    seed: int
    k: int
    log: list[str] = field(default_factory=list)

    def run(self, max_ops: int) -> str | None:
        """Replay the first ``max_ops`` operations; the first mismatch found, or None."""
        rng = random.Random(self.seed)
        block_size = 2
        cache = PrefixCache(24, block_size, published_block_size=block_size * self.k)
        replica = Replica(block_size)
        live: dict[str, _Live] = {}
        heads = [[rng.randrange(50) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
        self.log = []
        for op_index in range(max_ops):
            try:
                self._op(rng, cache, live, heads, op_index)
            except Exception as exc:
                return f"the cache raised at op {op_index}: {exc!r}"
            try:
                replica.apply(cache.take_events())
            except AssertionError as exc:
                return f"replay failed after op {op_index}: {exc}"
            if replica.counts != cache.cached_hashes():
                return f"replica != cache after op {op_index}: {replica.counts} vs {cache.cached_hashes()}"
            held = sum(cache.num_blocks_of(rid) for rid in live)
            if cache.num_free + held < cache.num_blocks:
                return f"leaked blocks after op {op_index}"
        return None

    def _op(
        self, rng: random.Random, cache: PrefixCache, live: dict[str, _Live], heads: list[list[int]], i: int
    ) -> None:
        choice = rng.random()
        if choice < 0.35 or not live:
            tokens = [*rng.choice(heads), *(rng.randrange(50) for _ in range(rng.randrange(0, 9)))]
            lora = rng.choice([None, None, "a"])
            hashes = _hashes(tokens, cache.block_size, lora)
            hit = cache.longest_hit(hashes, len(tokens))
            chunk = rng.randrange(1, len(tokens) - hit * cache.block_size + 1)
            ok = cache.allocate(
                f"r{i}", hashes, hit, hit * cache.block_size + chunk, lora_name=lora, lora_id=1
            )
            self.log.append(f"admit r{i} {lora} {tokens} hit={hit} chunk={chunk} ok={ok}")
            if ok:
                live[f"r{i}"] = _Live(tokens, hashes, hit * cache.block_size, lora)
        elif choice < 0.8:
            rid = rng.choice(sorted(live))
            seq = live[rid]
            target = min(len(seq.tokens), seq.computed + rng.randrange(1, 7))
            if rng.random() < 0.3:
                seq.tokens.append(rng.randrange(50))  # a generated token extends the sequence
                extend_block_hashes(seq.hashes, seq.tokens, cache.block_size, seq.lora)
            if cache.grow(rid, target):
                seq.computed = target
                cache.cache_blocks(rid, seq.hashes, seq.tokens, target)
                self.log.append(f"compute {rid} -> {target}")
            else:
                cache.free(rid)
                del live[rid]
                self.log.append(f"preempt {rid}")
        elif choice < 0.97:
            rid = rng.choice(sorted(live))
            cache.free(rid)
            del live[rid]
            self.log.append(f"free {rid}")
        else:
            if rng.random() < 0.5:  # drain first, so resets also succeed
                for rid in sorted(live):
                    cache.free(rid)
                live.clear()
            self.log.append(f"reset -> {cache.reset()}")


@pytest.mark.parametrize("k", [1, 2, 3], ids=["published=block", "published=2x", "published=3x"])
def test_events_replay_to_exact_cache_contents(k: int) -> None:
    """Replaying every event reproduces cached_hashes() exactly across random seeded workloads."""
    for seed in range(40):
        workload = _Workload(seed, k)
        if workload.run(300) is None:
            continue
        smallest = next(n for n in range(1, 301) if workload.run(n) is not None)
        failure = workload.run(smallest)
        steps = "\n  ".join(workload.log)
        pytest.fail(f"seed={seed} k={k}: {failure}; smallest failing case, {smallest} ops:\n  {steps}")
