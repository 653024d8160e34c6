"""The simulated engine in model time: vLLM v1 scheduling, latency model, cache behaviour and events."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.errors import ConfigError
from extproc.sim.engine_core import EngineCore, EngineParams, RequestOutput, SimRequest, StepResult
from extproc.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BASE, PER_SEQ, RATE = 0.01, 0.001, 1000.0


def _params(**overrides: Any) -> EngineParams:
    values: dict[str, Any] = {
        "block_size": 4,
        "num_gpu_blocks": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "prefill_tokens_per_s": RATE,
        "decode_base_s": BASE,
        "decode_per_seq_s": PER_SEQ,
    }
    values.update(overrides)
    return EngineParams(**values)


def _req(rid: str, prompt: int | list[int], outputs: int = 1, *, arrival: float = 0.0) -> SimRequest:
    """A request with ``prompt`` tokens (distinct per request id when given as a length)."""
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 97 + 1)
        prompt = [base + i for i in range(prompt)]
    return SimRequest(
        rid, prompt, [9000 + i for i in range(outputs)], arrival_time=arrival, finish_reason="length"
    )


@dataclass
class Trace:
    """Everything a run produced, step by step."""

    steps: list[StepResult] = field(default_factory=list)
    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    events: list[KVEvent] = field(default_factory=list)
    end: float = 0.0

    def first(self, rid: str) -> RequestOutput:
        return self.outputs[rid][0]

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.new_token_ids]


def _drain(core: EngineCore, now: float = 0.0, trace: Trace | None = None, max_steps: int = 10_000) -> Trace:
    trace = trace if trace is not None else Trace()
    for _ in range(max_steps):
        if not core.has_work:
            break
        result = core.step(now)
        now += result.duration
        trace.steps.append(result)
        trace.events.extend(result.events)
        for out in result.outputs:
            trace.outputs.setdefault(out.request_id, []).append(out)
    assert not core.has_work, "the engine did not drain"
    trace.end = now
    return trace


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": True}, "max_model_len"),
        ({"prefill_tokens_per_s": 0.0}, "prefill_tokens_per_s"),
        ({"decode_base_s": -0.1}, "decode_base_s"),
        ({"decode_per_seq_s": float("nan")}, "decode_per_seq_s"),
        ({"published_block_size": 6}, "published_block_size"),
        ({"num_gpu_blocks": 10}, "num_gpu_blocks"),
    ],
    ids=[
        "zero-block",
        "negative-seqs",
        "bool-len",
        "zero-rate",
        "negative-base",
        "nan-per-seq",
        "unaligned",
        "tiny-pool",
    ],
)
def test_params_are_validated(overrides: dict[str, Any], name: str) -> None:
    """Bad engine parameters raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=name):
        _params(**overrides)


def test_defaults_are_an_8b_model_on_one_h100() -> None:
    """The documented estimates: 24k blocks of 16, 16k prefill tok/s, 6 ms + 0.15 ms/seq decode."""
    p = EngineParams()
    assert (p.block_size, p.num_gpu_blocks, p.max_num_seqs) == (16, 24_000, 256)
    assert (p.max_num_batched_tokens, p.max_model_len, p.prefill_tokens_per_s) == (8192, 8192, 16_000.0)
    assert (p.decode_base_s, p.decode_per_seq_s) == (0.006, 0.000_15)


@pytest.mark.parametrize("prompt", [4, 40, 64, 200], ids=["tiny", "short", "one-chunk", "four-chunks"])
def test_ttft_grows_with_uncached_prompt_length(prompt: int) -> None:
    """Alone, TTFT = one step overhead per prefill chunk + prompt / prefill rate."""
    core = EngineCore(_params())
    core.add_request(_req("a", prompt))
    trace = _drain(core)
    chunks = math.ceil(prompt / 64)
    assert trace.first("a").ttft == pytest.approx(chunks * BASE + prompt / RATE)
    assert trace.first("a").queue_time == 0.0


def test_prefix_hit_shortens_ttft_by_the_cached_prefill() -> None:
    """A request sharing 32 prompt tokens with an earlier one only prefills the rest."""
    core = EngineCore(_params())
    shared = list(range(100, 132))
    core.add_request(_req("a", [*shared, 1, 2, 3, 4, 5, 6, 7, 8]))
    _drain(core)
    core.add_request(_req("b", [*shared, 9, 9, 9, 9, 9, 9, 9, 9]))
    trace = _drain(core)
    assert trace.first("b").num_cached_tokens == 32
    assert trace.first("b").ttft == pytest.approx(BASE + 8 / RATE)
    assert (core.prefix_cache_queries, core.prefix_cache_hits) == (80, 32)


@pytest.mark.parametrize(
    ("overrides", "prompts"),
    [
        ({"max_num_seqs": 1}, [8, 8, 8, 8]),
        ({"max_num_batched_tokens": 64}, [200, 8, 8]),
        ({"num_gpu_blocks": 64, "max_model_len": 256}, [200, 60, 8]),
    ],
    ids=["behind-max-num-seqs", "behind-a-big-prefill", "behind-kv-capacity"],
)
def test_ttft_grows_with_queue_depth(overrides: dict[str, Any], prompts: list[int]) -> None:
    """Requests arriving together get their first token later the further back they queue."""
    core = EngineCore(_params(**overrides))
    for i, prompt in enumerate(prompts):
        core.add_request(_req(f"r{i}", prompt, outputs=3))
    trace = _drain(core)
    ttfts = [trace.first(f"r{i}").ttft or 0.0 for i in range(len(prompts))]
    alone = [BASE + p / RATE for p in prompts]
    assert ttfts == sorted(ttfts), ttfts
    assert all(waited > solo * 2 for waited, solo in zip(ttfts[1:], alone[1:], strict=True)), (ttfts, alone)


@pytest.mark.parametrize("batch", [1, 4, 8], ids=["batch-1", "batch-4", "batch-8"])
def test_decode_step_time_grows_with_batch(batch: int) -> None:
    """A pure decode step costs decode_base_s + decode_per_seq_s per running sequence."""
    core = EngineCore(_params())
    for i in range(batch):
        core.add_request(_req(f"r{i}", 4, outputs=3))
    prefill = core.step(0.0)
    assert prefill.num_prefill_tokens == 4 * batch and prefill.num_decode_seqs == 0
    decode = core.step(prefill.duration)
    assert decode.num_decode_seqs == batch and decode.num_prefill_tokens == 0
    assert decode.duration == pytest.approx(BASE + PER_SEQ * batch)


def test_chunked_prefill_spans_steps() -> None:
    """A prompt longer than the token budget prefills in budget-sized chunks; the token comes last."""
    core = EngineCore(_params(max_num_batched_tokens=64))
    core.add_request(_req("a", 150, outputs=2))
    trace = _drain(core)
    assert [s.num_prefill_tokens for s in trace.steps] == [64, 64, 22, 0]
    assert [len(s.outputs) for s in trace.steps] == [0, 0, 1, 1]
    assert trace.first("a").ttft == pytest.approx(3 * BASE + 150 / RATE)


def test_running_requests_are_served_before_new_ones() -> None:
    """A decode batch takes its tokens first; a new prompt gets what is left of the budget."""
    core = EngineCore(_params(max_num_batched_tokens=16))
    core.add_request(_req("a", 4, outputs=5))
    core.step(0.0)
    core.add_request(_req("b", 40))
    step = core.step(1.0)
    assert (step.num_decode_seqs, step.num_prefill_tokens) == (1, 15)


def test_preemption_recomputes_the_most_recent_request() -> None:
    """Out of blocks, the last admitted request is preempted, then recomputed; no token is lost."""
    core = EngineCore(_params(num_gpu_blocks=16, max_model_len=64))
    core.add_request(_req("a", 16, outputs=40))
    core.add_request(_req("b", 16, outputs=40))
    trace = _drain(core)
    assert core.num_preemptions >= 1
    for rid in ("a", "b"):
        assert trace.tokens(rid) == [9000 + i for i in range(40)]
        assert [o.finished for o in trace.outputs[rid]] == [False] * 39 + [True]
    producing = {
        rid: [i for i, s in enumerate(trace.steps) if any(o.request_id == rid for o in s.outputs)]
        for rid in "ab"
    }
    assert producing["a"] == list(range(producing["a"][0], producing["a"][0] + 40)), "a was never preempted"
    assert producing["b"] != list(range(producing["b"][0], producing["b"][0] + 40)), "b was preempted"
    assert core.kv_cache_usage == 0.0


def test_max_num_seqs_is_respected() -> None:
    """Never more than max_num_seqs requests run in one step."""
    core = EngineCore(_params(max_num_seqs=3))
    for i in range(12):
        core.add_request(_req(f"r{i}", 6, outputs=4))
    seen = []
    now = 0.0
    while core.has_work:
        result = core.step(now)
        now += result.duration
        seen.append(core.num_running)
        assert len(result.outputs) <= 3
    assert max(seen) == 3


@pytest.mark.parametrize("where", ["running", "waiting", "unknown"], ids=["running", "waiting", "unknown"])
def test_abort_frees_blocks(where: str) -> None:
    """Aborting drops the request without output and returns its blocks to the pool."""
    core = EngineCore(_params(max_num_seqs=1))
    core.add_request(_req("a", 20, outputs=10))
    core.add_request(_req("b", 20, outputs=10))
    core.step(0.0)
    assert core.num_running == 1 and core.num_waiting == 1 and core.kv_cache_usage > 0
    target = {"running": "a", "waiting": "b", "unknown": "zzz"}[where]
    assert core.abort(target) is (where != "unknown")
    trace = _drain(core, 1.0)
    assert target not in trace.outputs
    assert core.kv_cache_usage == 0.0 and core.cache.num_free == 64


@pytest.mark.parametrize(
    ("req", "match"),
    [
        (_req("a", 200, outputs=57), "max_model_len"),
        (SimRequest("a", [], [1]), "non-empty"),
        (SimRequest("a", [1], []), "at least one output"),
        (_req("dup", 4), "already"),
    ],
    ids=["too-long", "empty-prompt", "no-outputs", "duplicate-id"],
)
def test_add_request_rejects_what_the_http_layer_must_filter(req: SimRequest, match: str) -> None:
    """Invalid requests raise ValueError at add_request."""
    core = EngineCore(_params())
    core.add_request(_req("dup", 4))
    with pytest.raises(ValueError, match=match):
        core.add_request(req)


def test_outputs_carry_tokens_and_timings() -> None:
    """One token per step in order; TTFT and queue time on the first output; e2e and finish on the last."""
    core = EngineCore(_params())
    core.add_request(_req("a", 8, outputs=4, arrival=0.5))
    trace = _drain(core, now=1.0)
    outs = trace.outputs["a"]
    assert trace.tokens("a") == [9000, 9001, 9002, 9003]
    assert outs[0].ttft == pytest.approx(0.5 + BASE + 8 / RATE) and outs[0].queue_time == pytest.approx(0.5)
    assert all(o.ttft is None for o in outs[1:])
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].e2e == pytest.approx(trace.end - 0.5)
    assert (core.prompt_tokens, core.generation_tokens) == (8, 4)


def test_generated_tokens_are_cached_once_computed() -> None:
    """Output tokens enter the cache when their KV is computed (next step), so a follow-up turn hits."""
    core = EngineCore(_params())
    core.add_request(_req("a", [1, 2, 3, 4, 5, 6, 7, 8], outputs=5))
    trace = _drain(core)
    # 13 tokens, the last one sampled but never computed: 12 tokens = 3 full blocks cached.
    stored = [e for e in trace.events if isinstance(e, BlockStored)]
    assert [t for e in stored for t in e.token_ids] == [1, 2, 3, 4, 5, 6, 7, 8, 9000, 9001, 9002, 9003]
    core.add_request(_req("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9000, 9001, 9002, 9003, 9004, 77]))
    assert _drain(core).first("turn2").num_cached_tokens == 12


def test_reset_prefix_cache_refused_while_running() -> None:
    """reset_prefix_cache() is False while a request holds blocks, True (and empty cache) once idle."""
    core = EngineCore(_params())
    core.add_request(_req("a", 8, outputs=3))
    core.step(0.0)
    assert not core.reset_prefix_cache()
    _drain(core, 1.0)
    assert core.reset_prefix_cache()
    assert core.cache.cached_hashes() == Counter()
    assert core.step(2.0).events == [AllBlocksCleared()]


def test_idle_step_takes_no_time() -> None:
    """A step with nothing to do has zero duration and no outputs."""
    result = EngineCore(_params()).step(3.0)
    assert (result.start, result.duration, result.outputs, result.events) == (3.0, 0.0, [], [])


@pytest.mark.parametrize("published", [4, 8], ids=["published=block", "published=2x"])
def test_engine_events_match_cache_contents(published: int) -> None:
    """Under random load with preemptions and LoRA, replaying each step's events equals the cache."""
    core = EngineCore(_params(num_gpu_blocks=40, max_model_len=160, published_block_size=published))
    rng = random.Random(7)
    heads = [[rng.randrange(1, 40) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    replica: Counter[bytes] = Counter()
    now = 0.0
    for i in range(400):
        if rng.random() < 0.3:
            tokens = [*rng.choice(heads), *(rng.randrange(1, 40) for _ in range(rng.randrange(0, 12)))]
            lora = rng.choice([None, "sql"])
            core.add_request(
                SimRequest(
                    f"r{i}", tokens, [rng.randrange(40) for _ in range(rng.randrange(1, 30))], lora, 1, now
                )
            )
        if rng.random() < 0.02:
            core.abort(f"r{rng.randrange(i + 1)}")  # running, waiting, finished or never added
        if rng.random() < 0.01:
            core.reset_prefix_cache()
        result = core.step(now)
        now += result.duration
        _replay(replica, result.events)
        assert replica == core.cache.cached_hashes(), f"step {i}"
    assert core.num_preemptions > 0


def _replay(counts: Counter[bytes], events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, AllBlocksCleared):
            counts.clear()
        elif isinstance(event, BlockRemoved):
            counts.subtract(event.block_hashes)
            assert min(counts.values(), default=0) >= 0
            counts += Counter()  # drop zeros
        else:
            counts.update(event.block_hashes)
