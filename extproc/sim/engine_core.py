"""A vLLM-v1-like continuous-batching scheduler with a latency model, in model time only.

Pure and synchronous: :meth:`EngineCore.step` runs one engine step starting at a model time the
caller gives and returns how long it took, so tests drive it deterministically and
:mod:`extproc.sim.engine_loop` maps it onto the wall clock.

Scheduling follows vLLM v1's ``Scheduler.schedule`` (FCFS):

* A token budget of ``max_num_batched_tokens`` per step. Running requests go first: a decoding one
  takes 1 token, an unfinished prefill takes the next chunk (chunked prefill).
* If no request was preempted, waiting requests are admitted in FIFO order while
  ``len(running) < max_num_seqs`` and budget remains. Each gets its prefix-cache hit, then blocks for
  the chunk it is scheduled (not the whole prompt, like vLLM's ``allocate_slots``). If they are not
  free the queue stops there (head-of-line blocking).
* When a running request needs a block and none is free (even after evicting cached free blocks), the
  most recently admitted running request is preempted: its blocks are freed and it goes back to the
  front of the waiting queue to be recomputed, usually with its own blocks as cache hits.

Token accounting is vLLM's: a request has ``num_tokens`` (prompt plus tokens generated so far) and
``num_computed_tokens``; a step computes ``num_tokens - num_computed`` tokens (capped by the budget),
and when it reaches ``num_tokens`` one token is sampled. A sampled token's KV is computed by the next
step, so blocks become full, get cached and are announced one step after their last token is sampled,
and the final token's KV is never cached, as in vLLM.

Step duration = ``decode_base_s + decode_per_seq_s * decode_seqs + prefill_tokens / prefill_tokens_per_s``
for a step that did any work. Attention cost growing with context length is not modelled.

With a CPU offload tier (``cpu_offload_blocks``), admission follows vLLM's OffloadingConnector: the
prefix hit continues past the GPU hit into the CPU tier; a request with a CPU hit gets GPU blocks for
its hits and the loaded span, leaves the queue without taking a seat or budget and waits for an
asynchronous CPU->GPU load (vLLM's WAITING_FOR_REMOTE_KVS). Loads share one PCIe link: each takes
``tokens / cpu_load_tokens_per_s`` after the previous one ends, overlapping the other requests'
steps. At the first step starting after its load ended, the request's loaded blocks are cached on
the GPU and it goes back to the front of the queue, to be scheduled like a request with that much
GPU hit. Its TTFT therefore includes the load, and ``num_waiting`` counts it meanwhile, as vLLM's
does. When nothing can run but loads are in flight, :meth:`EngineCore.step` returns an *idle* step
lasting until the next load ends.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from extproc.errors import ConfigError
from extproc.sim.block_hash import Digest, block_digest, extend_block_hashes
from extproc.sim.kv_events import KVEvent
from extproc.sim.prefix_cache import PrefixCache


@dataclass(frozen=True, slots=True)
class EngineParams:
    """Engine shape and speed; defaults are estimates for Llama-3-8B (bf16) on one H100 80GB.

    * KV per token = 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB, so a 16-token
      block is 2 MiB. ~0.9 x 80 GB - 16 GB weights - activations ~= 50 GB for KV -> ~24 000 blocks.
    * Prefill: 2 x 8e9 FLOP/token against ~990 TFLOPS dense bf16 at ~25 % effective use -> ~16k tok/s.
    * Decode is memory bound: each step reads the 16 GB of weights at ~3.35 TB/s (~4.8 ms) plus
      overhead -> ~6 ms at batch 1, and ~0.15 ms more per running sequence (its KV reads, sampling).

    These are rough estimates, good enough for routing to see realistic ratios, not a benchmark.
    """

    block_size: int = 16
    num_gpu_blocks: int = 24_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    prefill_tokens_per_s: float = 16_000.0
    #: Fixed cost of one forward pass (weights read once per step).
    decode_base_s: float = 0.006
    #: Extra step time per decoding sequence: decode slows down as the batch grows.
    decode_per_seq_s: float = 0.000_15
    #: Block size the KV events use (a multiple of block_size); None means block_size.
    published_block_size: int | None = None
    #: CPU offload tier size, in published blocks (0: no tier). 2 MiB per 16-token block, so
    #: 96 000 blocks is ~200 GB of host memory (about 4x the GPU's KV) -- see the README.
    cpu_offload_blocks: int = 0
    #: CPU->GPU load speed: 128 KiB of KV per token over ~50 GB/s of effective PCIe Gen5 x16.
    cpu_load_tokens_per_s: float = 380_000.0
    #: vLLM's ``--prefix-caching-hash-algo``: what hashes the blocks (see HASH_ALGOS).
    prefix_caching_hash_algo: str = "sha256"

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"engine {name} must be an integer >= 1, got {value!r}")
        if not self.prefill_tokens_per_s > 0:
            raise ConfigError(f"engine prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}")
        for name in ("decode_base_s", "decode_per_seq_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"engine {name} must be >= 0, got {getattr(self, name)!r}")
        published = self.published_block_size
        if published is not None and (published < self.block_size or published % self.block_size):
            raise ConfigError(
                f"engine published_block_size must be a multiple of block_size {self.block_size}, "
                f"got {published!r}"
            )
        cpu = self.cpu_offload_blocks
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise ConfigError(f"engine cpu_offload_blocks must be an integer >= 0, got {cpu!r}")
        rate = self.cpu_load_tokens_per_s
        if not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"engine cpu_load_tokens_per_s must be > 0, got {rate!r}")
        cpu_tokens = cpu * (published or self.block_size)
        if cpu and cpu_tokens < self.max_model_len:
            # Otherwise a long request's blocks could never be stored at all (vLLM skips the store).
            raise ConfigError(
                f"engine cpu_offload_blocks {cpu} x {published or self.block_size} tokens cannot hold "
                f"one max_model_len {self.max_model_len} sequence; use 0 for no CPU tier"
            )
        block_digest(self.prefix_caching_hash_algo)  # a ConfigError naming it if unknown or missing
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            # vLLM refuses to start when one max-length sequence cannot fit in the KV cache.
            raise ConfigError(
                f"engine num_gpu_blocks {self.num_gpu_blocks} x block_size {self.block_size} tokens "
                f"cannot hold one max_model_len {self.max_model_len} sequence"
            )


@dataclass(slots=True)
class SimRequest:
    """One generation: the HTTP layer chooses exactly the tokens to produce."""

    request_id: str
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    lora_name: str | None = None
    lora_id: int | None = None
    #: Model seconds (:class:`~extproc.sim.engine_loop.EngineLoop` sets it on submit).
    arrival_time: float = 0.0
    #: Copied onto the last output: the HTTP layer knows whether its tokens end in a stop or a length.
    finish_reason: str | None = None
    #: Salts the first block's hash (vLLM's ``cache_salt``): no other salt shares these blocks.
    cache_salt: str | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    #: Prompt tokens served from the prefix cache at first scheduling.
    num_cached_tokens: int
    #: Model seconds from arrival to the end of the step producing the first token (first output only).
    ttft: float | None = None
    #: Model seconds from arrival to first scheduling (first output only).
    queue_time: float | None = None
    #: Model seconds from arrival to the end of the last step, and the request's finish_reason
    #: (last output only).
    e2e: float | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class StepResult:
    """One engine step: its model-time span, outputs and the cache events it caused."""

    start: float
    duration: float
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    #: Nothing ran: the step only waits ``duration`` for a CPU->GPU load; new arrivals may end it early.
    idle: bool = False


class _Req:
    """Scheduler state of one request."""

    __slots__ = (
        "capacity",
        "first_scheduled",
        "hashes",
        "loading",
        "num_cached_tokens",
        "num_computed",
        "num_output",
        "output_token_ids",
        "preempted",
        "req",
        "request_id",
        "tokens",
    )

    def __init__(self, req: SimRequest, block_size: int, digest: Digest) -> None:
        self.req = req
        self.request_id = req.request_id
        self.output_token_ids = req.output_token_ids
        self.tokens = list(req.prompt_token_ids)
        self.hashes: list[bytes] = []
        extend_block_hashes(self.hashes, self.tokens, block_size, req.lora_name, req.cache_salt, digest)
        self.num_computed = 0
        #: Tokens the held blocks can take (a multiple of block_size); avoids a cache call per step.
        self.capacity = 0
        self.num_output = 0
        self.num_cached_tokens = 0
        self.first_scheduled: float | None = None
        self.preempted = False
        #: A CPU->GPU load of its first num_computed tokens is in flight.
        self.loading = False


class EngineCore:
    """One DP rank's scheduler, KV block pool and latency model; driven step by step in model time."""

    def __init__(self, params: EngineParams | None = None) -> None:
        self.params = params if params is not None else EngineParams()
        self._digest = block_digest(self.params.prefix_caching_hash_algo)
        p = self.params
        self.cache = PrefixCache(
            p.num_gpu_blocks,
            p.block_size,
            published_block_size=p.published_block_size,
            cpu_blocks=p.cpu_offload_blocks,
        )
        self._requests: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        #: Requests waiting for a CPU->GPU load: (model time it ends, tie-breaker, request).
        self._loading: list[tuple[float, int, _Req]] = []
        self._load_ids = itertools.count()
        #: Model time the PCIe link is free for the next load (loads are serialized on it).
        self._link_free_at = 0.0
        #: (request, tokens) scheduled by the step in progress, and its latency inputs.
        self._scheduled: list[tuple[_Req, int]] = []
        self._num_prefill_tokens = 0
        self._num_decode_seqs = 0
        #: Counters for metrics (vLLM's num_preemptions, prompt_tokens, generation_tokens).
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        #: Prompt tokens loaded from the CPU tier instead of computed, and the model seconds the loads
        #: took (preempted requests' reloads included, unlike the external-hit counter).
        self.cpu_loaded_tokens = 0
        self.cpu_load_seconds = 0.0

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        """Queue a request; the caller must already have rejected ones over ``max_model_len``."""
        total = len(req.prompt_token_ids) + len(req.output_token_ids)
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        if not req.prompt_token_ids or not req.output_token_ids:
            raise ValueError(f"request {req.request_id!r} needs a non-empty prompt and at least one output")
        if total > self.params.max_model_len:
            raise ValueError(
                f"request {req.request_id!r} has {total} prompt+output tokens, over max_model_len "
                f"{self.params.max_model_len}: the HTTP layer must reject it"
            )
        r = _Req(req, self.params.block_size, self._digest)
        self._requests[req.request_id] = r
        self._waiting.append(r)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks without output; False if it is not in the engine."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        if r.loading:
            self._loading = [entry for entry in self._loading if entry[2] is not r]
            heapq.heapify(self._loading)
            self.cache.free(request_id)
        elif r in self._waiting:
            self._waiting.remove(r)
            if r.num_computed:  # loaded from the CPU tier, not scheduled yet: it holds blocks
                self.cache.free(request_id)
        else:
            self._running.remove(r)
            self.cache.free(request_id)
        return True

    # -- stats -----------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._loading)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Queued requests, those waiting for a CPU->GPU load included (vLLM counts them waiting)."""
        return len(self._waiting) + len(self._loading)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def kv_cache_usage(self) -> float:
        return self.cache.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.cache.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.cache.hits

    @property
    def external_prefix_cache_queries(self) -> int:
        """Prompt tokens past the GPU hit looked up in the CPU tier (0 without one)."""
        return self.cache.external_queries

    @property
    def external_prefix_cache_hits(self) -> int:
        """Prompt tokens found in the CPU tier past the GPU hit, at first scheduling (0 without one)."""
        return self.cache.external_hits

    @property
    def cpu_cache_blocks(self) -> int:
        """Blocks the CPU tier holds (published granularity)."""
        return 0 if self.cache.cpu is None else len(self.cache.cpu)

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache; False (nothing changed) while any request holds blocks."""
        return self.cache.reset()

    # -- stepping --------------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Run one engine step starting at model time ``now``; duration 0 when nothing could run."""
        p = self.params
        if self._loading:
            self._finish_loads(now)
        budget, preempted = self._schedule_running(p.max_num_batched_tokens)
        if not preempted:
            self._admit_waiting(budget, now)
        if not self._scheduled:
            if self._loading:  # only loads are in flight: wait for the first to end
                wait = self._loading[0][0] - now
                return StepResult(now, wait, events=self.cache.take_events(), idle=True)
            return StepResult(now, 0.0, events=self.cache.take_events())
        prefill, decode = self._num_prefill_tokens, self._num_decode_seqs
        duration = p.decode_base_s + p.decode_per_seq_s * decode + prefill / p.prefill_tokens_per_s
        outputs = self._advance(now + duration)
        return StepResult(now, duration, outputs, self.cache.take_events(), prefill, decode)

    def _schedule_running(self, budget: int) -> tuple[int, bool]:
        """Give running requests their next token or prefill chunk, preempting when blocks run out.

        The hot path of a big decode batch: one pass, no call unless a request needs a new block.
        """
        scheduled, running, grow = self._scheduled, self._running, self.cache.grow
        block_size = self.params.block_size
        preempted = False
        prefill = decode = index = 0
        while index < len(running) and budget > 0:
            r = running[index]
            computed = r.num_computed
            n = len(r.tokens) - computed
            if n > budget:
                n = budget
            if computed + n > r.capacity:
                lost = False
                while not grow(r.request_id, computed + n):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is r:
                        lost = True
                        break
                if lost:
                    break  # r itself was preempted: it was the last running request
                r.capacity = -(-(computed + n) // block_size) * block_size
            scheduled.append((r, n))
            budget -= n
            if n == 1 and r.num_output:
                decode += 1
            else:
                prefill += n
            index += 1
        self._num_prefill_tokens, self._num_decode_seqs = prefill, decode
        return budget, preempted

    def _admit_waiting(self, budget: int, now: float) -> None:
        """Admit waiting requests FIFO while seats, budget and blocks for their first chunk last."""
        cache, running, waiting = self.cache, self._running, self._waiting
        block_size, max_seqs = self.params.block_size, self.params.max_num_seqs
        cpu_tier = cache.cpu is not None
        while waiting and budget > 0 and len(running) < max_seqs:
            r = waiting[0]
            num_tokens = len(r.tokens)
            req = r.req
            if r.num_computed:
                # Back from a CPU->GPU load: it holds its blocks, all cached; schedule the rest.
                hit = r.num_computed
                n = min(num_tokens - hit, budget)
                if not cache.grow(r.request_id, hit + n):
                    break
            else:
                hit_blocks = cache.longest_hit(r.hashes, num_tokens)
                loaded = cache.cpu_hit(r.hashes, hit_blocks, num_tokens) if cpu_tier else 0
                hit = hit_blocks * block_size
                if loaded:
                    # vLLM allocates for the hits and the loaded span only, and schedules no work yet.
                    held = (hit_blocks + loaded) * block_size
                    if not cache.allocate(
                        r.request_id,
                        r.hashes,
                        hit_blocks,
                        held,
                        lora_name=req.lora_name,
                        lora_id=req.lora_id,
                        cache_salt=req.cache_salt,
                        num_loaded_blocks=loaded,
                    ):
                        break
                    waiting.popleft()
                    self._record_admission(r, num_tokens, hit, loaded * block_size)
                    self._start_load(r, held, loaded * block_size, now)
                    continue
                n = min(num_tokens - hit, budget)
                if not cache.allocate(
                    r.request_id,
                    r.hashes,
                    hit_blocks,
                    hit + n,
                    lora_name=req.lora_name,
                    lora_id=req.lora_id,
                    cache_salt=req.cache_salt,
                ):
                    break  # head-of-line: later requests wait too, like vLLM
                self._record_admission(r, num_tokens, hit, 0)
            waiting.popleft()
            if not r.preempted and r.first_scheduled is None:
                r.first_scheduled = now
            r.num_computed = hit
            r.capacity = -(-(hit + n) // block_size) * block_size
            running.append(r)
            self._scheduled.append((r, n))
            self._num_prefill_tokens += n
            budget -= n

    def _record_admission(self, r: _Req, num_tokens: int, gpu_hit: int, cpu_hit: int) -> None:
        """Count a first admission's lookups (vLLM keeps preempted requests' out of the counters)."""
        if r.preempted:
            return
        self.cache.record_query(num_tokens, gpu_hit)
        if self.cache.cpu is not None:
            self.cache.record_external_query(num_tokens - gpu_hit, cpu_hit)
        r.num_cached_tokens = gpu_hit + cpu_hit  # vLLM's num_cached_tokens: local + external

    def _start_load(self, r: _Req, held: int, tokens: int, now: float) -> None:
        """Queue a CPU->GPU load of ``tokens``; the request holds its first ``held`` tokens' blocks."""
        start = max(now, self._link_free_at)
        seconds = tokens / self.params.cpu_load_tokens_per_s
        end = self._link_free_at = start + seconds
        r.num_computed = r.capacity = held
        r.loading = True
        heapq.heappush(self._loading, (end, next(self._load_ids), r))
        self.cpu_loaded_tokens += tokens
        self.cpu_load_seconds += seconds

    def _finish_loads(self, now: float) -> None:
        """Loads that ended by ``now``: cache their blocks on the GPU, requeue them at the front in order."""
        done: list[_Req] = []
        while self._loading and self._loading[0][0] <= now:
            r = heapq.heappop(self._loading)[2]
            r.loading = False
            self.cache.finish_load(r.request_id, r.hashes, r.tokens, r.num_computed)
            done.append(r)
        self._waiting.extendleft(reversed(done))

    def _advance(self, end: float) -> list[RequestOutput]:
        """Apply the computed tokens: sample where a request caught up, cache full blocks, finish."""
        block_size, cache = self.params.block_size, self.cache
        outputs: list[RequestOutput] = []
        finished: list[_Req] = []
        for r, n in self._scheduled:
            computed = r.num_computed = r.num_computed + n
            tokens = r.tokens
            if computed == len(tokens):
                index = r.num_output
                token = r.output_token_ids[index]
                tokens.append(token)
                r.num_output = index + 1
                done = index + 1 == len(r.output_token_ids)
                out = RequestOutput(r.request_id, [token], done, r.num_cached_tokens)
                outputs.append(out)
                if not index:
                    self._first_output(r, out, end)
                if done:
                    out.e2e = end - r.req.arrival_time
                    out.finish_reason = r.req.finish_reason
                    finished.append(r)
                if not len(tokens) % block_size:
                    extend_block_hashes(
                        r.hashes, tokens, block_size, r.req.lora_name, r.req.cache_salt, self._digest
                    )
            if n >= block_size or computed % block_size < n:  # a block boundary was crossed
                cache.cache_blocks(r.request_id, r.hashes, tokens, computed)
        self.generation_tokens += len(outputs)
        if finished:
            for r in finished:
                cache.free(r.request_id)
                del self._requests[r.request_id]
            gone = {id(r) for r in finished}
            self._running = [r for r in self._running if id(r) not in gone]
        self._scheduled = []
        return outputs

    def _first_output(self, r: _Req, out: RequestOutput, end: float) -> None:
        arrival = r.req.arrival_time
        out.ttft = end - arrival
        out.queue_time = (r.first_scheduled if r.first_scheduled is not None else arrival) - arrival
        self.prompt_tokens += len(r.req.prompt_token_ids)

    def _preempt(self, r: _Req) -> None:
        """vLLM's recompute preemption: free everything, retry first, keep the tokens already sent.

        Its blocks usually come back as GPU hits, or as a CPU-tier load if they were evicted.
        """
        self.cache.free(r.request_id)
        r.num_computed = 0
        r.capacity = 0
        r.preempted = True
        self._waiting.appendleft(r)
        self.num_preemptions += 1
