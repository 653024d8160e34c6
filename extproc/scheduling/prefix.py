"""How many prompt tokens each candidate endpoint already holds: the prefix-cache scoring input.

Producer, run once per request before picking (STYLE: producers, then pure scorers):

- **precise**: the model has a tokenizer and the candidate's worker set publishes KV events. The
  prompt is tokenized exactly as the engine will (:mod:`extproc.tokenize`), cut into the set's
  ``kvBlockSize`` blocks, keyed like the index keys event tokens (:mod:`extproc.kvindex.keys`),
  and matched against the index: cached tokens = leading blocks held x block size.
- **approximate**: otherwise, the prompt text's chunks are matched against where we sent earlier
  requests (:mod:`extproc.kvindex.approx`), and this request is recorded once routed.
- **none**: no prompt to match (bodies without a prompt or messages).

A tokenizer that cannot tokenize a body (a template error the engine may not share) is counted
and the request falls back to approximate: routing never refuses what the engine might accept.

With a :class:`~extproc.tokenize.pool.TokenizePool`, the prompt is tokenized before the decision,
off the event loop (:meth:`PrefixMatcher.prompt_tokens`), and handed to :meth:`PrefixMatcher.match`
as :class:`Tokenized`; without one, ``match`` tokenizes inline.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from extproc.catalog.model import Catalog, Endpoint, Route
from extproc.errors import BadRequest
from extproc.kvindex.approx import CHARS_PER_TOKEN, ApproxPrefixIndex
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.openai import ChatPrompt, InferenceRequest, Prompt
from extproc.scheduling.path_keys import path_block_keys
from extproc.scheduling.pool import Pool, PoolCache
from extproc.telemetry import LogLimiter
from extproc.tokenize.pool import TokenizePool
from extproc.tokenize.registry import ModelTokenizer, TokenizerRegistry
from extproc.tokenize.segments import SegmentPath
from extproc.tokenize.workers import AFFINITY_BYTES, WorkerFailed, body_ids
from extproc.types import EndpointAddress

log = logging.getLogger(__name__)

PrefixMode = Literal["precise", "approximate", "none"]
#: Prompts shorter than this (characters) are tokenized on the loop even with a pool: ~1,000
#: tokens take well under a millisecond, less than a round trip through a worker thread. The same
#: holds for what a prompt adds to its known prefix (see :mod:`extproc.tokenize.segments`).
INLINE_PROMPT_CHARS = 4096
#: Chat prompts up to this many messages and body bytes are rendered and looked up in the segment
#: tree on the loop (~2.5 µs a message and ~2.5 ns a character to cut: 120 messages, 65 kB, ~0.6 ms);
#: only what they add is encoded in a worker. Larger ones are rendered in a worker too, so no body
#: can stall the loop for long: with 1 MiB, ~32k-token conversations held the loop over 5 ms in 5%
#: of turns on a slow machine, and with 128 kiB none did, at the same decisions/s
#: (bench/results/long_prompts.md).
INLINE_RENDER_MESSAGES = 512
INLINE_RENDER_BYTES = 128 << 10


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached prompt tokens per candidate, and how they were found."""

    mode: PrefixMode
    cached_tokens: dict[EndpointAddress, int] = field(default_factory=dict)
    #: The prompt's length in tokens: exact in precise mode, estimated from its text otherwise.
    prompt_tokens: int | None = None
    #: Approximate keys to record against the endpoint picked (empty when nothing to learn).
    approx_keys: list[int] = field(default_factory=list)
    #: For pods with several data-parallel ranks: the rank holding the cached prefix, per endpoint.
    ranks: dict[EndpointAddress, int] = field(default_factory=dict)
    #: Prompt tokens right after the GPU hit that an offload tier (CPU, storage) holds, per endpoint
    #: (precise mode only; absent = 0). Loading them back is cheaper than recomputing them.
    lower_tier_tokens: dict[EndpointAddress, int] = field(default_factory=dict)


NO_MATCH = PrefixMatch("none")


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A prompt's ids computed before the decision, for ``model``; ``ids`` None: it fell back."""

    model: str
    ids: Sequence[int] | None
    #: The ids' block keys, per block size, where the worker computed them too (others: at match).
    keys: Mapping[int, Sequence[int]] = field(default_factory=dict)
    #: The prompt's segments in the tree, when it walked one: block keys then come from there.
    path: SegmentPath | None = None


#: Upper bounds (seconds) of the buckets of :class:`LoopHold`.
LOOP_HOLD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


@dataclass(slots=True)
class LoopHold:
    """How long each request's tokenization held the event loop: a histogram (per bucket of
    LOOP_HOLD_BUCKETS, the last for longer ones) and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOOP_HOLD_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LOOP_HOLD_BUCKETS, seconds)] += 1
        self.total += seconds


@dataclass(slots=True)
class PrefixCounters:
    lookups: dict[str, int] = field(default_factory=lambda: {"precise": 0, "approximate": 0, "none": 0})
    tokenize_errors: int = 0
    loop_hold: LoopHold = field(default_factory=LoopHold)
    #: The same holds in the loop thread's CPU time: what tokenizing cost the loop's own thread,
    #: without the time it waited for a core or for the GIL (which a busy machine adds to the wall
    #: time) or, tokenizing inline, for the library's own threads (``encode_batch``).
    loop_hold_cpu: LoopHold = field(default_factory=LoopHold)

    def observe_hold(self, started: float, started_cpu: float) -> None:
        """One tokenization on the loop, begun at ``perf_counter()`` ``started`` and
        ``thread_time()`` ``started_cpu``."""
        self.loop_hold.observe(time.perf_counter() - started)
        self.loop_hold_cpu.observe(time.thread_time() - started_cpu)


class PrefixMatcher:
    """Matches a request's prompt against the KV-event index, or our own routing history."""

    def __init__(
        self,
        *,
        index: PrefixIndex,
        tokenizers: TokenizerRegistry,
        approx: ApproxPrefixIndex,
        blocked: Callable[[], frozenset[str]] = frozenset,
        pool: TokenizePool | None = None,
    ) -> None:
        self.index = index
        #: Where prompts are tokenized off the event loop; None: inline, in :meth:`match`.
        self.pool = pool
        self.tokenizers = tokenizers
        self.approx = approx
        self._pools = PoolCache()
        #: Models whose tokenizer disagrees with their engines (tokenizer parity): routed approximately.
        self.blocked = blocked
        self.counters = PrefixCounters()
        self._log_limiter: LogLimiter[str] = LogLimiter(time.monotonic)

    def tokenizes_first(self, route: Route, request: InferenceRequest) -> bool:
        """True when ``request``'s prompt should be tokenized off the loop before the decision.

        Short prompts are tokenized inline: handing one to a thread and back costs more than it.
        Judged by the body's length, which bounds the prompt's (JSON spells every character in
        at least one byte, a message in more than its role): the prompt's own text would take a
        pass over every message to know (~0.15 ms a turn in a conversation of 600). A short prompt
        in a long body (tools, images) is tokenized first too, which costs it nothing: what is
        cheap still runs on the loop (:meth:`prompt_tokens`).
        """
        if self.pool is None:
            return False
        return (
            len(request.body) >= INLINE_PROMPT_CHARS
            and self._tokenizer(route.upstream_model) is not None
            and any(e.kv_events_port is not None for e in route.endpoints)
        )

    async def prompt_tokens(
        self, route: Route, request: InferenceRequest, catalog: Catalog | None = None
    ) -> Tokenized:
        """The prompt's ids, computed in the pool (see :mod:`extproc.tokenize.pool`).

        What is cheap runs here, on the loop: rendering a chat prompt of moderate size, finding its
        known prefix in the segment tree, encoding a short new part (see INLINE_PROMPT_CHARS). How
        long that held the loop is observed in :attr:`PrefixCounters.loop_hold`. The rest goes to
        the pool. In worker processes, given the ``catalog``, the block keys of every block size the
        route's KV-event sets use are computed there too, so the decision only looks them up.
        """
        model = route.upstream_model
        tokenizer = self._tokenizer(model)
        if tokenizer is None or self.pool is None:
            return Tokenized(model, None)
        try:
            block_sizes = self._block_sizes(catalog, route)
            if self.pool.in_processes and request.body:
                return await self._tokenized_in_process(model, request, block_sizes)
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                step = _tokenize_here(model, tokenizer, request, block_sizes)
            finally:
                self.counters.observe_hold(started, started_cpu)
            if isinstance(step, Tokenized):
                return step
            call, size = step
            done = await self.pool.run(call, size=size, opening=request.body)
            return done if done is not None else Tokenized(model, None)
        except Exception as exc:
            self._tokenize_failed(model, exc)
            return Tokenized(model, None)

    async def _tokenized_in_process(
        self, model: str, request: InferenceRequest, block_sizes: tuple[int, ...]
    ) -> Tokenized:
        """The body handed to a worker process whole: it parses, renders and encodes it there."""
        assert self.pool is not None
        seed = namespace_seed(model, request.cache_salt)
        keyer = functools.partial(keys_by_block_size, seed, block_sizes)
        call = functools.partial(body_ids, model, request.path, request.body, keyer)
        answer = await self.pool.run(
            call, affinity=request.body[:AFFINITY_BYTES], size=len(request.body), opening=request.body
        )
        if answer is None or answer.ids is None:
            if answer is not None and answer.error is not None:
                bad_request, message = answer.error
                raise BadRequest(message) if bad_request else WorkerFailed(message)
            return Tokenized(model, None)
        ids = array("I")
        ids.frombytes(answer.ids)
        keys: dict[int, Sequence[int]] = {}
        for size, raw in answer.keys.items():
            column = array("q")
            column.frombytes(raw)
            keys[size] = column
        return Tokenized(model, ids, keys)

    def match(
        self,
        catalog: Catalog,
        route: Route,
        request: InferenceRequest,
        candidates: Sequence[Endpoint] | Pool,
        tokenized: Tokenized | None = None,
    ) -> PrefixMatch:
        """Cached tokens of the candidates that hold some of the prompt (absent = 0); ``tokenized``:
        the ids computed already. Costs what the match finds, not the number of candidates."""
        pool = candidates if isinstance(candidates, Pool) else self._pools.get(catalog, candidates)
        mode: PrefixMode = "none"
        cached: dict[EndpointAddress, int] = {}
        ranks: dict[EndpointAddress, int] = {}
        lower: dict[EndpointAddress, int] = {}
        tokens: Sequence[int] | None = None
        approximate = pool.approximate
        if pool.precise and (tokenized is None or tokenized.model != route.upstream_model):
            tokenized = self._tokens(route.upstream_model, request)
        if pool.precise and tokenized is not None and tokenized.ids is not None:
            tokens = tokenized.ids
            mode = "precise"
            seed = namespace_seed(route.upstream_model, request.cache_salt)
            self._match_precise(pool, seed, tokenized, cached, ranks, lower)
        else:
            approximate = pool.addresses
        keys: list[int] = []
        prompt_tokens = None if tokens is None else len(tokens)
        if approximate:
            text = request.prefix_text
            if text is not None:
                if prompt_tokens is None:
                    prompt_tokens = len(text) // CHARS_PER_TOKEN
                keys = self.approx.keys(text, route.upstream_model, request.cache_salt)
                mode = "approximate" if mode == "none" else mode
                cached.update(self.approx.holders(keys, approximate))
        self.counters.lookups[mode] += 1
        return PrefixMatch(mode, cached, prompt_tokens, keys, ranks, lower)

    def record(self, match: PrefixMatch, endpoint: EndpointAddress) -> None:
        """Learn from a decision (approximate mode only: precise mode learns from the engines)."""
        if match.approx_keys:
            self.approx.record(match.approx_keys, endpoint)

    def _block_sizes(self, catalog: Catalog | None, route: Route) -> tuple[int, ...]:
        """The block sizes of the route's worker sets that publish KV events (none without a
        catalog), from the route's pool: worked out once per catalog snapshot."""
        return () if catalog is None else tuple(sorted(self._pools.get(catalog, route.endpoints).precise))

    def _tokenizer(self, model: str) -> ModelTokenizer | None:
        tokenizer = self.tokenizers.get(model)
        return None if tokenizer is None or model in self.blocked() else tokenizer

    def _tokens(self, model: str, request: InferenceRequest) -> Tokenized | None:
        tokenizer = self._tokenizer(model)
        if tokenizer is None:
            return None
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            prompt = request.read_prompt()
            return None if prompt is None else _tokenize(model, tokenizer, prompt)
        except Exception as exc:
            self._tokenize_failed(model, exc)
        finally:
            self.counters.observe_hold(started, started_cpu)
        return None

    def _tokenize_failed(self, model: str, exc: Exception) -> None:
        self.counters.tokenize_errors += 1
        if isinstance(exc, BadRequest):
            log.debug("prompt not tokenized model=%s error=%s", model, exc.message)
        elif self._log_limiter.allow(model, type(exc).__name__):
            # A tokenizer or template failing on a body we did not foresee is our bug, but the
            # engine may still accept the request: route it approximately, never answer 500.
            log.error("tokenizing a prompt failed (routed approximately) model=%s", model, exc_info=exc)

    def _match_precise(
        self,
        pool: Pool,
        seed: int,
        tokenized: Tokenized,
        cached: dict[EndpointAddress, int],
        ranks: dict[EndpointAddress, int],
        lower: dict[EndpointAddress, int],
    ) -> None:
        """Cached tokens per endpoint: its best data-parallel rank's leading blocks x block size.

        The rank is reported only for pods with several ranks and a hit, so the engine's own load
        balancer still spreads requests that no rank has cached. When any engine offloads to a lower
        tier, ``lower`` gets, for that rank, the tokens an offload tier holds past the GPU hit.
        The index walks every source at once and answers only those holding the prompt's first
        block; holders outside the pool (another route's, another block size's) are passed over.
        """
        token_tuple: tuple[int, ...] | None = None
        # Per endpoint, its best rank: most GPU-cached tokens, then the furthest reach on any tier.
        best: dict[EndpointAddress, tuple[int, int, int]] = {}
        for block_size, addresses in pool.precise.items():
            keys = tokenized.keys.get(block_size)
            if keys is None and tokenized.path is not None:
                keys = path_block_keys(tokenized.path, block_size, seed)
            elif keys is None:
                assert tokenized.ids is not None
                token_tuple = token_tuple or tuple(tokenized.ids)
                keys = block_keys(token_tuple, block_size, seed)
            gpu = self.index.holders(keys)
            # A second walk only when some engine offloads (usually all of a fleet, or none).
            any_tier = self.index.holders(keys, lower_tiers=True) if self.index.has_lower_tiers() else {}
            for source, blocks in (any_tier or gpu).items():
                if source.endpoint not in addresses:
                    continue
                held = gpu.get(source, 0) * block_size
                reach = max(held, blocks * block_size)
                current = best.get(source.endpoint)
                if current is None or (held, reach) > current[:2]:
                    best[source.endpoint] = (held, reach, source.dp_rank)
        multi_rank = pool.multi_rank
        for address, (held, reach, rank) in best.items():
            if held:
                cached[address] = held
            if reach and address in multi_rank:
                ranks[address] = rank
            if reach > held:
                lower[address] = reach - held


def _tokenize_here(
    model: str, tokenizer: ModelTokenizer, request: InferenceRequest, block_sizes: tuple[int, ...]
) -> Tokenized | tuple[Callable[[], Tokenized], int]:
    """What of tokenizing ``request`` runs on the loop: the result, or the call left for the pool
    and its size (the characters it tokenizes; see :meth:`TokenizePool.run`). ``block_sizes``: those
    whose keys a worker computes too."""
    prompt = request.read_prompt()
    if prompt is None:
        return Tokenized(model, None)
    if not _renders_inline(prompt, request):
        keyed = (namespace_seed(model, request.cache_salt), block_sizes)
        return (lambda: _tokenize(model, tokenizer, prompt, keyed)), len(request.body)
    plan = tokenizer.prompt_plan(prompt)
    if plan is None:
        return (lambda: Tokenized(model, tokenizer.prompt_ids(prompt))), len(request.body)
    if plan.new_chars < INLINE_PROMPT_CHARS:
        path = plan.finish(plan.encode(here=True))
        return Tokenized(model, path, path=path)
    # Remembered in the worker too: a prompt past its budget still teaches the tree, so the
    # conversation's next turn is not cold again. The block keys too are computed there, remembered
    # on the segments and handed over: the decision then neither hashes a long new prompt nor
    # walks the path again on the loop.
    keyed = (namespace_seed(model, request.cache_salt), block_sizes)

    def encode_and_key() -> Tokenized:
        path = plan.finish(plan.encode())
        return Tokenized(model, path, _keyed(path, keyed), path=path)

    return encode_and_key, plan.new_chars


def _tokenize(
    model: str, tokenizer: ModelTokenizer, prompt: Prompt, keyed: tuple[int, tuple[int, ...]] = (0, ())
) -> Tokenized:
    """The prompt's ids, and its path in the segment tree when it has one (all in this thread);
    ``keyed``: a seed and block sizes whose keys to compute on the path too."""
    plan = tokenizer.prompt_plan(prompt)
    if plan is None:
        return Tokenized(model, tokenizer.prompt_ids(prompt))
    path = plan.finish(plan.encode(here=plan.new_chars < INLINE_PROMPT_CHARS))
    return Tokenized(model, path, _keyed(path, keyed), path=path)


def _keyed(path: SegmentPath, keyed: tuple[int, tuple[int, ...]]) -> dict[int, Sequence[int]]:
    """The path's block keys for each of ``keyed``'s block sizes (under its seed), computed where
    this runs (a worker) and remembered on the path's segments. Handed to the decision whole, so the
    loop does not walk a long conversation's segments again to join them."""
    seed, block_sizes = keyed
    return {size: path_block_keys(path, size, seed) for size in block_sizes}


def _renders_inline(prompt: Prompt, request: InferenceRequest) -> bool:
    """True when rendering ``prompt`` on the loop costs well under a millisecond (see
    INLINE_RENDER_MESSAGES)."""
    return (
        isinstance(prompt, ChatPrompt)
        and len(prompt.messages) <= INLINE_RENDER_MESSAGES
        and len(request.body) <= INLINE_RENDER_BYTES
    )


def keys_by_block_size(seed: int, block_sizes: tuple[int, ...], ids: Sequence[int]) -> dict[int, bytes]:
    """The ids' block keys for each size (``array('q')`` bytes): run in a tokenizing worker process.

    The keys equal this process's: the seed comes from here, and a tuple of ints hashes the same in
    every process (only str hashes are salted per process).
    """
    tokens = tuple(ids)
    return {size: array("q", block_keys(tokens, size, seed)).tobytes() for size in block_sizes}
