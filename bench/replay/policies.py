"""Baseline routing policies for the replay benchmark (bench-only), on the scheduler's ``Policy`` seam.

Each one sees exactly what the router's own policy sees (:class:`RequestFacts`, one
:class:`Candidate` per endpoint: our in-flight count, cached prompt tokens from the prefix producer,
engine signals when scraped) so the comparison is about the decision rule, not the inputs. Two keep
state the seam does not carry, fed by the benchmark's request loop (documented on each):

* :class:`RoundRobin` rotates a counter.
* :class:`DynamoCost` reads :class:`ActiveBlocks`, the benchmark's per-endpoint accounting of the
  blocks its in-flight requests hold, split into still-prefilling and decoding, as Dynamo's router
  tracks them from its own routing decisions.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from extproc.scheduling.policy import Candidate, Ranking, RequestFacts
from extproc.types import EndpointAddress


class RoundRobin:
    """Endpoints in address order, starting one further each request (ignores caches and load)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        ordered = sorted(candidates, key=lambda c: c.endpoint.address)
        start = next(self._next) % len(ordered) if ordered else 0
        return Ranking(ordered[start:] + ordered[:start])


class GieLike:
    """A weighted sum of scorers with a max-score pick, shaped like the Gateway API Inference
    Extension's default scheduler profile (prefix-cache, queue and kv-cache-utilization scorers).

    ``score = 3 * prefix_ratio + 2 * (1 - queue_norm) + 1 * (1 - kv_usage)``:

    * ``prefix_ratio`` = cached prompt tokens / prompt tokens, clamped to 1. The benchmark runs this
      policy with the router's *approximate* prefix producer (our routing history of 64-character
      prompt chunks, no KV events), as GIE's default prefix plugin remembers where it sent chunks.
    * ``queue_norm`` = min-max normalised queue depth across candidates (GIE's queue scorer); the
      queue is the engine's waiting count when signals are scraped, else our in-flight count.
    * ``kv_usage`` = the engine's KV-cache usage when scraped; without signals the term is the same
      for every candidate (0), so it drops out.
    """

    name = "gie-like (approx prefix + queue + kv)"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 1.0) -> None:
        self.weights = (prefix_weight, queue_weight, kv_weight)

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        w_prefix, w_queue, w_kv = self.weights
        prompt = max(request.prompt_tokens or 0, 1)
        queues = [_queue(c) for c in candidates]
        low, high = (min(queues), max(queues)) if queues else (0.0, 0.0)
        span = high - low
        scored = []
        for candidate, queue in zip(candidates, queues, strict=True):
            prefix = min(candidate.cached_tokens / prompt, 1.0)
            queue_norm = (queue - low) / span if span else 0.0
            kv = candidate.signals.kv_cache_usage if candidate.signals is not None else 0.0
            score = w_prefix * prefix + w_queue * (1.0 - queue_norm) + w_kv * (1.0 - (kv or 0.0))
            scored.append((-score, rng.random(), candidate))
        scored.sort(key=lambda t: (t[0], t[1]))
        return Ranking([c for _, _, c in scored])


def _queue(candidate: Candidate) -> float:
    signals = candidate.signals
    waiting = signals.waiting if signals is not None else None
    return float(waiting) if waiting is not None else float(candidate.in_flight)


@dataclass(slots=True)
class _Active:
    endpoint: EndpointAddress
    blocks: int
    new_blocks: int
    prefilling: bool = True


class ActiveBlocks:
    """Blocks our in-flight requests hold per endpoint, from our own routing decisions only.

    A request counts its prompt blocks (``ceil(prompt / block_size)``) as active from routing until
    its response ends; its *uncached* blocks count as prefill load until its first token arrives.
    Generated tokens are not counted (Dynamo adds them as decode progresses; the benchmark does not
    see per-token progress without parsing every chunk).
    """

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size
        self._requests: dict[int, _Active] = {}
        self._prefill: dict[EndpointAddress, int] = {}
        self._total: dict[EndpointAddress, int] = {}

    def blocks(self, tokens: int) -> int:
        return -(-max(tokens, 0) // self.block_size)

    def start(
        self, request_id: int, endpoint: EndpointAddress, prompt_tokens: int, cached_tokens: int
    ) -> None:
        blocks = self.blocks(prompt_tokens)
        new = max(blocks - cached_tokens // self.block_size, 0)
        self._requests[request_id] = _Active(endpoint, blocks, new)
        self._prefill[endpoint] = self._prefill.get(endpoint, 0) + new
        self._total[endpoint] = self._total.get(endpoint, 0) + blocks

    def first_token(self, request_id: int) -> None:
        active = self._requests.get(request_id)
        if active is not None and active.prefilling:
            active.prefilling = False
            self._prefill[active.endpoint] -= active.new_blocks

    def finish(self, request_id: int) -> None:
        self.first_token(request_id)
        active = self._requests.pop(request_id, None)
        if active is not None:
            self._total[active.endpoint] -= active.blocks

    def prefill_blocks(self, endpoint: EndpointAddress) -> int:
        return self._prefill.get(endpoint, 0)

    def total_blocks(self, endpoint: EndpointAddress) -> int:
        return self._total.get(endpoint, 0)


class DynamoCost:
    """Lowest cost, shaped like NVIDIA Dynamo's KV router (``temperature = 0``: argmin, ties random).

    ``cost = prefill_load_scale * max(active_prefill_blocks + new_prompt_blocks - overlap_blocks, 0)
    + active_decode_blocks``, where ``overlap_blocks`` = the candidate's cached prompt tokens / block
    size (from the precise KV-event index, as Dynamo's radix tree is fed by KV events),
    ``active_prefill_blocks`` = uncached blocks of its requests still prefilling, and
    ``active_decode_blocks`` = all blocks its in-flight requests hold (:class:`ActiveBlocks`).
    """

    name = "dynamo-like (kv cost)"

    def __init__(self, active: ActiveBlocks, prefill_load_scale: float = 1.0) -> None:
        self.active = active
        self.prefill_load_scale = prefill_load_scale

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        active = self.active
        new_blocks = active.blocks(request.prompt_tokens or 0)
        scored = []
        for c in candidates:
            address = c.endpoint.address
            overlap = c.cached_tokens // active.block_size
            prefill = max(active.prefill_blocks(address) + new_blocks - overlap, 0)
            cost = self.prefill_load_scale * prefill + active.total_blocks(address)
            scored.append((cost, rng.random(), c))
        scored.sort(key=lambda t: (t[0], t[1]))
        return Ranking([c for _, _, c in scored])
