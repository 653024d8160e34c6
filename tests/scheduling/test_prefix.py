"""Cached prompt tokens per candidate: precise (tokenizer + KV events), approximate (our history), none.

The catalog comes from the real builder; the index is fed real vLLM payloads (the simulator's
encoder) for the prompt's token ids as the shipped tokenizer and llama3 template produce them,
computed here independently of the matcher.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from catalog.test_build import build, eps, iws, svc
from prometheus_client import CollectorRegistry

from extproc.catalog.model import Catalog, Route
from extproc.kvindex.approx import CHARS_PER_BLOCK, CHARS_PER_TOKEN, ApproxPrefixIndex
from extproc.kvindex.events import Source
from extproc.kvindex.follow import plan_sources
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.openai import InferenceRequest, parse_request, read_request
from extproc.scheduling.prefix import PrefixMatch, PrefixMatcher, Tokenized
from extproc.serve.prefix_routing import MatcherCollector
from extproc.settings import TokenizerSpec
from extproc.sim.kv_events import BlockStored
from extproc.sim.kv_wire import encode_batch
from extproc.tokenize import shipped_chat_template, shipped_tokenizer
from extproc.tokenize.pool import TokenizePool
from extproc.tokenize.registry import SHIPPED_TOKENIZER, TokenizerRegistry
from extproc.tokenize.segments import SegmentCache
from extproc.tokenize.workers import ProcessWorkers, WorkerSetup
from extproc.types import EndpointAddress

#: A model with a tokenizer, and one without.
LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"
QWEN = "Qwen/Qwen2-7B-Instruct"
REGISTRY = TokenizerRegistry.load([TokenizerSpec(LLAMA, SHIPPED_TOKENIZER, "llama3")])
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
APPROX_TOKENS_PER_BLOCK = CHARS_PER_BLOCK // CHARS_PER_TOKEN

# LLAMA is served by "kv" (KV events, kvBlockSize 16), "big" (KV events, kvBlockSize 32) and
# "plain" (no KV events); QWEN by "qwen" (KV events, but no tokenizer).
KV1 = EndpointAddress("10.0.0.1:8000")
KV2 = EndpointAddress("10.0.0.2:8000")
BIG = EndpointAddress("10.0.3.1:8000")
PLAIN = EndpointAddress("10.0.1.1:8000")
Q1 = EndpointAddress("10.0.2.1:8000")
Q2 = EndpointAddress("10.0.2.2:8000")

LONG = (
    "You are a careful assistant. Answer questions about the quarterly report below, citing the "
    "section you used. The report covers revenue, costs, hiring, and the outlook for next year. "
) * 4
PROMPTS: list[tuple[str, dict[str, Any]]] = [
    (COMPLETIONS, {"prompt": LONG}),
    (CHAT, {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "Revenue?"}]}),
]
PROMPT_IDS = ["completions", "chat"]


def as_sent(path: str, payload: dict[str, Any]) -> InferenceRequest:
    """The request as serve reads it, from its JSON body (whose length decides where it is tokenized)."""
    return parse_request(orjson.dumps(payload), path=path)


def worker_set(
    name: str, ips: list[str], model: str, *, kv: bool, block_size: int = 16
) -> list[dict[str, Any]]:
    ws = iws(name, models=[{"name": model}])
    ws["spec"]["kvBlockSize"] = block_size
    if kv:
        ws["spec"]["kvEvents"] = {"port": 5557, "replayPort": 5558}
    return [ws, svc(name), eps(f"{name}-1", name, ips)]


def make_catalog() -> Catalog:
    return build(
        *worker_set("kv", ["10.0.0.1", "10.0.0.2"], LLAMA, kv=True),
        *worker_set("big", ["10.0.3.1"], LLAMA, kv=True, block_size=32),
        *worker_set("plain", ["10.0.1.1"], LLAMA, kv=False),
        *worker_set("qwen", ["10.0.2.1", "10.0.2.2"], QWEN, kv=True),
    )


def engine_tokens(path: str, payload: dict[str, Any]) -> list[int]:
    """The prompt token ids vLLM computes with the shipped tokenizer and llama3 template."""
    tokenizer = shipped_tokenizer()
    if path == COMPLETIONS:
        return tokenizer.encode(payload["prompt"], add_special_tokens=True)
    text = shipped_chat_template("llama3").render(
        payload["messages"], bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    return tokenizer.encode(text, add_special_tokens=False)


def estimated_tokens(path: str, payload: dict[str, Any]) -> int:
    """Without token ids, the prompt's length is estimated at ~4 characters a token."""
    text = read_request(path, {"model": LLAMA, **payload}).prefix_text
    assert text is not None
    return len(text) // CHARS_PER_TOKEN


class Router:
    """A catalog, an index registered from it (as the follower does) and a matcher over both."""

    def __init__(
        self,
        *,
        blocked: frozenset[str] = frozenset(),
        pool: TokenizePool | None = None,
        registry: TokenizerRegistry = REGISTRY,
    ) -> None:
        self.catalog = make_catalog()
        self.index = PrefixIndex(max_entries=100_000, max_entries_per_source=100_000)
        for source, plan in plan_sources(self.catalog).items():
            self.index.add_source(source, namespace=plan.namespace, block_size=plan.block_size)
        self.ingest = IndexIngest(self.index)
        self.matcher = PrefixMatcher(
            index=self.index,
            tokenizers=registry,
            approx=ApproxPrefixIndex(),
            blocked=lambda: blocked,
            pool=pool,
        )
        #: The matcher's metrics, as serve's /metrics exposes them.
        self.metrics = CollectorRegistry()
        self.metrics.register(MatcherCollector(self.matcher))
        self._seq = 0

    def lookups(self) -> dict[str, float]:
        """``extproc_prefix_lookups_total`` by mode."""
        return {
            mode: self.metrics.get_sample_value("extproc_prefix_lookups_total", {"mode": mode}) or 0
            for mode in ("precise", "approximate", "none")
        }

    def tokenize_errors(self) -> float:
        return self.metrics.get_sample_value("extproc_prefix_tokenize_errors_total") or 0

    def loop_holds(self) -> dict[str, tuple[float, float]]:
        """(count, sum) of the loop-hold histograms: wall and CPU."""
        return {
            kind: (
                self.metrics.get_sample_value(f"extproc_tokenize_loop{kind}_seconds_count") or 0,
                self.metrics.get_sample_value(f"extproc_tokenize_loop{kind}_seconds_sum") or 0,
            )
            for kind in ("", "_cpu")
        }

    def route(self, model: str) -> Route:
        route = self.catalog.resolve(model)
        assert route is not None
        return route

    def match(
        self, model: str, path: str, payload: dict[str, Any], only: Sequence[str] | None = None
    ) -> PrefixMatch:
        route = self.route(model)
        candidates = [e for e in route.endpoints if only is None or e.address in only]
        request = read_request(path, {"model": model, **payload})
        return self.matcher.match(self.catalog, route, request, candidates)

    def feed(
        self,
        address: str,
        tokens: Sequence[int],
        blocks: int,
        *,
        engine_block: int = 16,
        first: int = 0,
        medium: str = "GPU",
        salt: str | None = None,
    ) -> None:
        """The engine at ``address`` cached engine blocks ``first`` to ``blocks - 1`` of ``tokens``
        (vLLM's bytes hashes) on ``medium``."""
        digests = [hashlib.sha256(f"{address}/{i}".encode()).digest() for i in range(blocks)]
        events = [
            BlockStored(
                (digests[i],),
                digests[i - 1] if i else None,
                tuple(tokens[i * engine_block : (i + 1) * engine_block]),
                engine_block,
                None,
                None,
                medium=medium,
                cache_salt=salt,
            )
            for i in range(first, blocks)
        ]
        payload = encode_batch(events, ts=1.0, dp_rank=0, encoding="maps", hash_format="int")
        self.ingest.on_batch(Source(EndpointAddress(address), 0), self._seq, payload)
        self._seq += 1
        assert self.ingest.counters.decode_errors == 0


def test_catalog_is_what_the_tests_assume() -> None:
    """LLAMA's route spans the kv, big and plain sets; only KV-event sets are index sources."""
    router = Router()
    assert [e.address for e in router.route(LLAMA).endpoints] == [KV1, KV2, PLAIN, BIG]
    assert {s.endpoint for s in router.index.sources()} == {KV1, KV2, BIG, Q1, Q2}


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
def test_precise_credits_each_endpoint_with_the_blocks_it_holds(path: str, payload: dict[str, Any]) -> None:
    """Cached tokens = leading blocks held x the set's block size; holders of nothing are absent (0)."""
    router = Router()
    tokens = engine_tokens(path, payload)
    assert len(tokens) >= 8 * 16
    router.feed(KV1, tokens, 5)
    router.feed(BIG, tokens, 2, engine_block=32)
    router.feed(Q1, tokens, 8)  # another model's pod: not a candidate
    match = router.match(LLAMA, path, payload)
    assert match.mode == "precise"
    assert match.cached_tokens == {KV1: 5 * 16, BIG: 2 * 32}
    assert match.prompt_tokens == len(tokens)
    assert router.lookups() == {"precise": 1, "approximate": 0, "none": 0}
    assert router.tokenize_errors() == 0


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
def test_precise_counts_only_the_leading_blocks_the_prompt_shares(path: str, payload: dict[str, Any]) -> None:
    """A pod that cached another prompt sharing the first blocks is credited with those blocks only."""
    router = Router()
    tokens = engine_tokens(path, payload)
    other = [*tokens[: 3 * 16], *(t + 1 for t in tokens[3 * 16 :])]
    router.feed(KV2, other, 8)
    assert router.match(LLAMA, path, payload).cached_tokens[KV2] == 3 * 16
    assert router.match(LLAMA, COMPLETIONS, {"prompt": "Something else entirely."}).cached_tokens == {}


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
def test_a_salted_prompt_is_credited_only_with_blocks_cached_under_its_salt(
    path: str, payload: dict[str, Any]
) -> None:
    """Engines never serve a ``cache_salt`` request from another salt's blocks: we never count them."""
    router = Router()
    tokens = engine_tokens(path, payload)
    router.feed(KV1, tokens, 5)  # unsalted
    router.feed(KV2, tokens, 3, salt="tenant-a")  # vLLM's extra_keys carry the salt
    assert router.match(LLAMA, path, payload).cached_tokens[KV1] == 5 * 16
    assert router.match(LLAMA, path, payload).cached_tokens.get(KV2, 0) == 0
    salted = router.match(LLAMA, path, {**payload, "cache_salt": "tenant-a"})
    assert salted.mode == "precise"
    assert salted.cached_tokens == {KV2: 3 * 16}
    other = router.match(LLAMA, path, {**payload, "cache_salt": "tenant-b"})
    assert other.cached_tokens == {}


def test_approximate_affinity_keeps_salted_prompts_apart() -> None:
    """Where we only remember our own decisions, a salted prompt follows only its own salt."""
    router = Router()
    first = router.match(QWEN, COMPLETIONS, {"prompt": LONG, "cache_salt": "tenant-a"})
    router.matcher.record(first, Q1)
    assert router.match(QWEN, COMPLETIONS, {"prompt": LONG, "cache_salt": "tenant-a"}).cached_tokens[Q1] > 0
    assert Q1 not in router.match(QWEN, COMPLETIONS, {"prompt": LONG}).cached_tokens
    assert (
        router.match(QWEN, COMPLETIONS, {"prompt": LONG, "cache_salt": "tenant-b"}).cached_tokens.get(Q1, 0)
        == 0
    )


def test_untokenizable_request_falls_back_to_approximate() -> None:
    """A body the template refuses (unknown role) is counted and matched approximately, and learns."""
    router = Router()
    payload = {"messages": [{"role": "wizard", "content": LONG}]}
    router.feed(KV1, engine_tokens(COMPLETIONS, {"prompt": LONG}), 5)
    first = router.match(LLAMA, CHAT, payload)
    assert first.mode == "approximate" and first.prompt_tokens == estimated_tokens(CHAT, payload)
    assert first.cached_tokens == {}
    assert first.approx_keys
    router.matcher.record(first, KV2)
    second = router.match(LLAMA, CHAT, payload)
    assert second.mode == "approximate"
    assert second.cached_tokens[KV2] == len(first.approx_keys) * APPROX_TOKENS_PER_BLOCK > 0
    assert set(second.cached_tokens) == {KV2}
    assert router.tokenize_errors() == 2
    assert router.lookups() == {"precise": 0, "approximate": 2, "none": 0}


@pytest.mark.parametrize(
    ("path", "first", "second", "shared_chunks"),
    [
        (COMPLETIONS, {"prompt": "p" * 200 + "first question"}, {"prompt": "p" * 200 + "second"}, 3),
        (
            CHAT,
            {"messages": [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "A?"}]},
            {"messages": [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "B?"}]},
            (len("<system>") + 300 + len("<user>")) // CHARS_PER_BLOCK,
        ),
    ],
    ids=PROMPT_IDS,
)
def test_model_without_tokenizer_learns_from_recorded_decisions(
    path: str, first: dict[str, Any], second: dict[str, Any], shared_chunks: int
) -> None:
    """With no tokenizer, a request sharing an earlier one's prefix credits the pod that one went to."""
    router = Router()
    router.feed(Q2, engine_tokens(path, first), 4)  # without the model's tokens its KV events cannot count
    before = router.match(QWEN, path, first)
    assert before.mode == "approximate"
    assert before.cached_tokens == {}
    router.matcher.record(before, Q1)
    after = router.match(QWEN, path, second)
    assert after.mode == "approximate"
    assert after.cached_tokens == {Q1: shared_chunks * APPROX_TOKENS_PER_BLOCK}
    assert router.tokenize_errors() == 0


def test_endpoints_without_kv_events_are_matched_approximately() -> None:
    """With a tokenizer, pods without KV events are credited from history, alongside precise pods."""
    router = Router()
    path, payload = PROMPTS[0]
    router.feed(KV1, engine_tokens(path, payload), 3)
    only_plain = router.match(LLAMA, path, payload, only=[PLAIN])
    assert only_plain.mode == "approximate" and only_plain.prompt_tokens == estimated_tokens(path, payload)
    assert only_plain.cached_tokens == {}
    router.matcher.record(only_plain, PLAIN)
    mixed = router.match(LLAMA, path, payload)
    assert mixed.mode == "precise"
    learned = len(only_plain.approx_keys) * APPROX_TOKENS_PER_BLOCK
    assert learned > 0
    assert mixed.cached_tokens == {KV1: 3 * 16, PLAIN: learned}
    assert router.lookups() == {"precise": 1, "approximate": 1, "none": 0}


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
def test_model_blocked_by_tokenizer_parity_is_matched_approximately(
    path: str, payload: dict[str, Any]
) -> None:
    """A model whose tokenizer disagrees with its engines ignores the KV-event index."""
    router = Router(blocked=frozenset({LLAMA}))
    router.feed(KV1, engine_tokens(path, payload), 5)
    match = router.match(LLAMA, path, payload)
    assert match.mode == "approximate" and match.prompt_tokens == estimated_tokens(path, payload)
    assert match.cached_tokens == {}
    assert router.tokenize_errors() == 0


@pytest.mark.parametrize(
    ("model", "text"),
    [(QWEN, None), (QWEN, 5), (LLAMA, None), (LLAMA, 5)],
    ids=["no-tokenizer-null", "no-tokenizer-number", "tokenizer-null", "tokenizer-number"],
)
def test_malformed_text_parts_do_not_break_matching(model: str, text: Any) -> None:
    """A body the engine will refuse is still matched (approximately or not at all), never an exception."""
    router = Router()
    payload = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    match = router.match(model, CHAT, payload)
    assert match.mode in ("precise", "approximate", "none")


def test_tokenizer_is_not_consulted_without_kv_event_candidates() -> None:
    """A body the template would refuse is no tokenize error when no candidate publishes KV events."""
    router = Router()
    match = router.match(LLAMA, CHAT, {"messages": [{"role": "wizard", "content": LONG}]}, only=[PLAIN])
    assert match.mode == "approximate"
    assert router.tokenize_errors() == 0


@pytest.mark.parametrize(
    ("model", "path", "payload", "tokenize_errors"),
    [
        (LLAMA, "/v1/embeddings", {"input": LONG}, 0),
        (QWEN, "/v1/embeddings", {"input": LONG}, 0),
        (LLAMA, COMPLETIONS, {"max_tokens": 5}, 1),
        (QWEN, COMPLETIONS, {"max_tokens": 5}, 0),
        (QWEN, CHAT, {"messages": "not a list"}, 0),
    ],
    ids=[
        "embeddings-with-tokenizer",
        "embeddings-without-tokenizer",
        "no-prompt-with-tokenizer",
        "no-prompt-without-tokenizer",
        "unreadable-messages",
    ],
)
def test_requests_without_a_prompt_match_nothing(
    model: str, path: str, payload: dict[str, Any], tokenize_errors: int
) -> None:
    """Other paths and bodies without a prompt give mode none and nothing to record."""
    router = Router()
    match = router.match(model, path, payload)
    assert match == PrefixMatch("none")
    router.matcher.record(match, Q1)
    assert len(router.matcher.approx) == 0
    assert router.lookups() == {"precise": 0, "approximate": 0, "none": 1}
    assert router.tokenize_errors() == tokenize_errors


def test_lookups_are_counted_per_mode() -> None:
    """Each lookup counts once, under the mode it was answered in."""
    router = Router()
    path, payload = PROMPTS[1]
    for _ in range(3):
        router.match(LLAMA, path, payload)
    for _ in range(2):
        router.match(QWEN, path, payload)
    router.match(LLAMA, path, payload, only=[PLAIN])
    router.match(LLAMA, "/v1/embeddings", {"input": "x"})
    assert router.lookups() == {"precise": 3, "approximate": 3, "none": 1}


def dp_catalog(ips: list[str]) -> Catalog:
    """One worker set of pods with 2 data-parallel ranks each, publishing KV events."""
    ws = iws("dp", models=[{"name": LLAMA}])
    ws["metadata"]["annotations"] = {"kinference.buoyant.io/data-parallel-size": "2"}
    ws["spec"]["kvEvents"] = {"port": 5557}
    return build(ws, svc("dp"), eps("dp-1", "dp", ips))


def match_after_rank1_stores(catalog: Catalog, *, medium: str) -> PrefixMatch:
    """Rank 1 of 10.0.9.1 stores the first 3 blocks of ``PROMPTS[0]`` on ``medium``; that prompt's match."""
    index = PrefixIndex(max_entries=10_000, max_entries_per_source=10_000)
    for source, plan in plan_sources(catalog).items():
        index.add_source(source, namespace=plan.namespace, block_size=plan.block_size)
    path, payload = PROMPTS[0]
    tokens = engine_tokens(path, payload)
    digests = [hashlib.sha256(f"dp/{i}".encode()).digest() for i in range(3)]
    event = BlockStored(tuple(digests), None, tuple(tokens[: 3 * 16]), 16, None, None, medium=medium)
    payload_bytes = encode_batch([event], ts=0.0, dp_rank=1, encoding="maps", hash_format="int")
    IndexIngest(index).on_batch(Source(EndpointAddress("10.0.9.1:8000"), 1), 0, payload_bytes)
    scorer = PrefixMatcher(index=index, tokenizers=REGISTRY, approx=ApproxPrefixIndex())
    route = catalog.resolve(LLAMA)
    assert route is not None
    return scorer.match(catalog, route, read_request(path, {"model": LLAMA, **payload}), route.endpoints)


def test_data_parallel_pod_reports_the_rank_holding_the_prefix() -> None:
    """A pod with 2 DP ranks is credited with its best rank's prefix, and that rank is named."""
    catalog = dp_catalog(["10.0.9.1", "10.0.9.2"])
    plans = plan_sources(catalog)
    assert sorted(plans) == [
        Source(EndpointAddress("10.0.9.1:8000"), 0),
        Source(EndpointAddress("10.0.9.1:8000"), 1),
        Source(EndpointAddress("10.0.9.2:8000"), 0),
        Source(EndpointAddress("10.0.9.2:8000"), 1),
    ]
    assert plans[Source(EndpointAddress("10.0.9.1:8000"), 1)].target.pub_address == "tcp://10.0.9.1:5558"
    match = match_after_rank1_stores(catalog, medium="GPU")
    assert match.cached_tokens == {EndpointAddress("10.0.9.1:8000"): 48}
    assert match.ranks == {EndpointAddress("10.0.9.1:8000"): 1}


def test_offloaded_blocks_after_the_gpu_hit_are_reported_per_endpoint() -> None:
    """CPU-tier blocks extend an endpoint's prefix as lower-tier tokens; GPU hits stay as they were."""
    router = Router()
    path, payload = PROMPTS[0]
    tokens = engine_tokens(path, payload)
    assert len(tokens) >= 5 * 16
    a, b, c = (str(e.address) for e in router.route(LLAMA).endpoints[:3])
    router.feed(a, tokens, 2)  # GPU: blocks 0-1
    router.feed(a, tokens, 5, first=2, medium="CPU")  # CPU: blocks 2-4
    router.feed(b, tokens, 3, medium="CPU")  # CPU only: blocks 0-2
    match = router.match(LLAMA, path, payload)
    assert match.cached_tokens[EndpointAddress(a)] == 32
    assert EndpointAddress(b) not in match.cached_tokens
    assert match.lower_tier_tokens == {EndpointAddress(a): 48, EndpointAddress(b): 48}
    assert EndpointAddress(c) not in match.lower_tier_tokens


def test_without_offload_tiers_no_lower_tier_tokens_are_reported() -> None:
    router = Router()
    path, payload = PROMPTS[0]
    a = str(router.route(LLAMA).endpoints[0].address)
    router.feed(a, engine_tokens(path, payload), 3)
    match = router.match(LLAMA, path, payload)
    assert match.cached_tokens[EndpointAddress(a)] == 48
    assert match.lower_tier_tokens == {}


def test_data_parallel_pod_names_the_rank_whose_offload_tier_holds_the_prefix() -> None:
    """No GPU hit anywhere, rank 1 holds the prefix on CPU: rank 1 is named, its tokens count as offloaded."""
    match = match_after_rank1_stores(dp_catalog(["10.0.9.1"]), medium="CPU")
    assert match.cached_tokens == {}
    assert match.lower_tier_tokens == {EndpointAddress("10.0.9.1:8000"): 48}
    assert match.ranks == {EndpointAddress("10.0.9.1:8000"): 1}


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
async def test_tokens_computed_in_the_pool_match_as_inline_ones(path: str, payload: dict[str, Any]) -> None:
    """Tokenized off the loop first, a prompt is credited exactly as when tokenized inline."""
    pool = TokenizePool(threads=2)
    router = Router(pool=pool)
    try:
        tokens = engine_tokens(path, payload)
        router.feed(KV1, tokens, 5)
        route = router.route(LLAMA)
        request = as_sent(path, {"model": LLAMA, **payload})
        assert router.matcher.tokenizes_first(route, request) == (len(request.body) >= 4096)
        tokenized = await router.matcher.prompt_tokens(route, request)
        assert tokenized == Tokenized(LLAMA, tokens)
        match = router.matcher.match(router.catalog, route, request, route.endpoints, tokenized)
        assert (match.mode, match.cached_tokens[KV1], match.prompt_tokens) == ("precise", 5 * 16, len(tokens))
        assert match == router.match(LLAMA, path, payload)  # the inline path agrees
    finally:
        pool.close()


@pytest.mark.parametrize(("path", "payload"), PROMPTS, ids=PROMPT_IDS)
async def test_tokens_computed_in_a_worker_process_match_as_inline_ones(
    path: str, payload: dict[str, Any]
) -> None:
    """With --tokenize-processes the body is tokenized in another process, to the same credit."""
    workers = ProcessWorkers(1, WorkerSetup((TokenizerSpec(LLAMA, SHIPPED_TOKENIZER, "llama3"),)))
    pool = TokenizePool(budget=30.0, workers=workers)  # generous: the worker starts on the first call
    router = Router(pool=pool)
    try:
        tokens = engine_tokens(path, payload)
        router.feed(KV1, tokens, 5)
        route = router.route(LLAMA)
        request = parse_request(orjson.dumps({"model": LLAMA, **payload}), path=path)
        tokenized = await router.matcher.prompt_tokens(route, request, router.catalog)
        assert tokenized.ids is not None and list(tokenized.ids) == tokens
        # The block keys came from the worker too, for both block sizes of LLAMA's KV-event sets,
        # equal to this process's (a tuple of ints hashes alike in every process).
        seed = namespace_seed(LLAMA)
        assert {size: list(keys) for size, keys in tokenized.keys.items()} == {
            size: block_keys(tokens, size, seed) for size in (16, 32)
        }
        match = router.matcher.match(router.catalog, route, request, route.endpoints, tokenized)
        assert match == router.match(LLAMA, path, payload)
        # A salted body's keys come from the worker under the salted seed.
        salted = parse_request(orjson.dumps({"model": LLAMA, "cache_salt": "t", **payload}), path=path)
        salted_keys = (await router.matcher.prompt_tokens(route, salted, router.catalog)).keys
        assert list(salted_keys[16]) == block_keys(tokens, 16, namespace_seed(LLAMA, "t"))
        # A body the engine would refuse is counted, and routed approximately.
        refused = parse_request(
            orjson.dumps({"model": LLAMA, "messages": [{"role": "user", "content": 42}]}), path=CHAT
        )
        assert await router.matcher.prompt_tokens(route, refused) == Tokenized(LLAMA, None)
        assert router.tokenize_errors() == 1
    finally:
        pool.close()


async def test_a_prompt_not_tokenized_within_its_budget_is_matched_approximately() -> None:
    """Past --tokenize-budget-ms the request does not wait: it is routed by our own history."""
    pool = TokenizePool(threads=1, budget=0.01)
    router = Router(pool=pool)
    busy = threading.Event()
    try:
        # The only thread is busy (a long prompt before this one), so this one cannot make it.
        pool.workers.submit(busy.wait, b"")
        route = router.route(LLAMA)
        request = read_request(COMPLETIONS, {"model": LLAMA, "prompt": LONG * 20})
        tokenized = await router.matcher.prompt_tokens(route, request)
        assert tokenized == Tokenized(LLAMA, None)
        assert pool.fallbacks["budget"] == 1
        match = router.matcher.match(router.catalog, route, request, route.endpoints, tokenized)
        assert match.mode == "approximate" and match.prompt_tokens == len(LONG * 20) // CHARS_PER_TOKEN
    finally:
        busy.set()
        pool.close()


async def test_without_a_tokenizer_or_kv_events_nothing_is_tokenized_first() -> None:
    pool = TokenizePool(threads=1)
    router = Router(pool=pool)
    try:
        long = as_sent(COMPLETIONS, {"model": LLAMA, "prompt": LONG * 20})
        short = as_sent(COMPLETIONS, {"model": LLAMA, "prompt": "Hello"})
        assert router.matcher.tokenizes_first(router.route(LLAMA), long)
        assert not router.matcher.tokenizes_first(router.route(LLAMA), short)  # cheaper inline
        qwen = as_sent(COMPLETIONS, {"model": QWEN, "prompt": LONG * 20})
        assert not router.matcher.tokenizes_first(router.route(QWEN), qwen)  # KV events, no tokenizer
        assert not Router().matcher.tokenizes_first(router.route(LLAMA), long)  # no pool: inline
    finally:
        pool.close()


def with_segment_tree() -> TokenizerRegistry:
    specs = [TokenizerSpec(LLAMA, SHIPPED_TOKENIZER, "llama3")]
    return TokenizerRegistry.load(specs, segment_cache_bytes=1 << 22)


@pytest.mark.parametrize("pooled", [False, True], ids=["inline", "pool"])
async def test_a_conversation_walked_through_the_segment_tree_is_credited_as_without_it(pooled: bool) -> None:
    """Turn after turn (short and long new turns), the tree's ids and remembered block keys give
    the credit whole-prompt tokenizing gives, and the turns after the first walk a known prefix."""
    pool = TokenizePool(threads=2, budget=30.0) if pooled else None
    tree, plain = Router(pool=pool, registry=with_segment_tree()), Router()
    route = tree.route(LLAMA)
    messages: list[dict[str, str]] = [{"role": "system", "content": LONG}]
    try:
        for turn in range(6):
            messages.append({"role": "user", "content": f"question {turn} " + LONG * 3 * (turn % 3)})
            payload = {"messages": list(messages)}
            tokens = engine_tokens(CHAT, payload)
            for router in (tree, plain):  # both indexes: the pod holds all but the last blocks
                router.feed(KV1, tokens, len(tokens) // 16 - 1)
            request = read_request(CHAT, {"model": LLAMA, **payload})
            if pooled:
                tokenized = await tree.matcher.prompt_tokens(route, request)
                assert tokenized.path is not None and list(tokenized.ids or []) == tokens
                match = tree.matcher.match(tree.catalog, route, request, route.endpoints, tokenized)
            else:
                match = tree.match(LLAMA, CHAT, payload)
            assert match == plain.match(LLAMA, CHAT, payload)
            assert match.cached_tokens[KV1] == (len(tokens) // 16 - 1) * 16
            messages.append({"role": "assistant", "content": f"answer {turn}"})
        cache = tree_of(tree)
        assert cache.stats.hits > 0 and cache.bytes > 0
    finally:
        if pool is not None:
            pool.close()


def tree_of(router: Router) -> SegmentCache:
    entry = router.matcher.tokenizers.get(LLAMA)
    assert entry is not None and entry.tokenizer.segment_cache is not None
    return entry.tokenizer.segment_cache


async def test_a_long_prompts_block_keys_come_from_the_pool_with_its_ids() -> None:
    """Keys for each block size the route's KV-event sets use are computed in the worker and handed
    over whole (the loop does not walk the prompt's segments again); they credit the engines' blocks
    as keys computed at match do."""
    pool = TokenizePool(threads=1, budget=30.0)
    router = Router(pool=pool, registry=with_segment_tree())
    try:
        payload = {"messages": [{"role": "system", "content": LONG * 20}, {"role": "user", "content": "Hi"}]}
        tokens = engine_tokens(CHAT, payload)
        router.feed(KV1, tokens, 7)
        route = router.route(LLAMA)
        request = as_sent(CHAT, {"model": LLAMA, **payload})
        assert router.matcher.tokenizes_first(route, request)
        tokenized = await router.matcher.prompt_tokens(route, request, router.catalog)
        assert tokenized.path is not None  # walked the segment tree
        seed = namespace_seed(LLAMA, None)
        assert {size: list(keys) for size, keys in tokenized.keys.items()} == {
            size: block_keys(tuple(tokens), size, seed) for size in (16, 32)
        }
        match = router.matcher.match(router.catalog, route, request, route.endpoints, tokenized)
        assert (match.mode, match.cached_tokens[KV1]) == ("precise", 7 * 16)
        assert match == router.match(LLAMA, CHAT, payload)  # tokenized inline, keyed at match
    finally:
        pool.close()


async def test_a_prompt_past_its_budget_still_teaches_the_tree() -> None:
    """The request is routed without its ids, but its worker finishes and remembers the prompt:
    the conversation's next turn is not cold again."""
    pool = TokenizePool(threads=1, budget=0.01)
    router = Router(pool=pool, registry=with_segment_tree())
    busy = threading.Event()
    try:
        pool.workers.submit(busy.wait, b"")
        route = router.route(LLAMA)
        payload = {"messages": [{"role": "system", "content": LONG * 20}, {"role": "user", "content": "Hi"}]}
        request = read_request(CHAT, {"model": LLAMA, **payload})
        assert await router.matcher.prompt_tokens(route, request) == Tokenized(LLAMA, None)
        busy.set()
        for _ in range(200):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        tokenized = await router.matcher.prompt_tokens(route, request)
        assert tokenized.path is not None and list(tokenized.ids or []) == engine_tokens(CHAT, payload)
        assert tree_of(router).stats.hits >= len(tokenized.path.segments)
    finally:
        busy.set()
        pool.close()


async def test_only_a_conversations_next_turn_past_its_budget_teaches_the_tree() -> None:
    """Past its budget, a one-off prompt is not tokenized afterwards; the conversation's second turn,
    which repeats its first, is: its third turn then finds the history in the tree."""
    pool = TokenizePool(threads=1, budget=0.01)
    router = Router(pool=pool, registry=with_segment_tree())
    route = router.route(LLAMA)
    busy = threading.Event()

    async def past_budget(messages: list[dict[str, str]]) -> Any:
        """Sent while the only worker is busy; the tree's hits before, and after its late run."""
        request = parse_request(orjson.dumps({"model": LLAMA, "messages": messages}), path=CHAT)
        busy.clear()
        holding = asyncio.create_task(pool.run(busy.wait))  # the only worker, taken through the pool
        await asyncio.sleep(0.01)
        assert await router.matcher.prompt_tokens(route, request) == Tokenized(LLAMA, None)
        busy.set()
        await holding
        for _ in range(200):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        return request

    try:
        await past_budget([{"role": "user", "content": "A one-off question: " + LONG * 20}])
        messages = [{"role": "user", "content": LONG * 20}]
        await past_budget(messages)
        assert tree_of(router).bytes == 0 and pool.skipped == 2  # neither taught the tree
        messages += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And?"}]
        await past_budget(messages)
        assert tree_of(router).bytes > 0 and pool.skipped == 2
        messages += [{"role": "assistant", "content": "Another."}, {"role": "user", "content": "Then?"}]
        request = parse_request(orjson.dumps({"model": LLAMA, "messages": messages}), path=CHAT)
        hits = tree_of(router).stats.hits
        tokenized = await router.matcher.prompt_tokens(route, request)
        assert tokenized.path is not None and list(tokenized.ids or []) == engine_tokens(
            CHAT, {"messages": messages}
        )
        assert tree_of(router).stats.hits > hits  # the history was known
    finally:
        busy.set()
        pool.close()


async def test_how_long_tokenizing_held_the_loop_is_observed_once_per_prompt() -> None:
    """A conversation's next turn is walked and encoded on the loop, a long new prompt is encoded
    in the pool: either way the time the loop was held is one observation per prompt."""
    pool = TokenizePool(threads=1)
    router = Router(pool=pool, registry=with_segment_tree())
    try:
        route = router.route(LLAMA)
        history = [{"role": "system", "content": LONG * 20}]
        for turn in ("Hi", "And then?", LONG * 20):
            payload = {"messages": [*history, {"role": "user", "content": turn}]}
            request = read_request(CHAT, {"model": LLAMA, **payload})
            tokenized = await router.matcher.prompt_tokens(route, request)
            assert list(tokenized.ids or []) == engine_tokens(CHAT, payload)
        holds = router.loop_holds()
        for count, total in holds.values():
            assert count == 3 and total > 0
        # The loop thread cannot have spent more CPU time than wall time (with the clocks' grain).
        assert holds["_cpu"][1] <= holds[""][1] + 0.001
    finally:
        pool.close()


def test_without_a_pool_tokenizing_in_the_decision_is_observed_as_holding_the_loop() -> None:
    router = Router()
    payload = {"messages": [{"role": "user", "content": "Hi"}]}
    assert router.match(LLAMA, CHAT, payload).mode == "precise"
    for count, total in router.loop_holds().values():
        assert count == 1 and total > 0
