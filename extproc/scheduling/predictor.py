"""Predicted time to first token per candidate, and the policy that ranks by it.

The model is the simulator's (:mod:`extproc.sim.engine_core`) seen from outside: a profile
(:mod:`extproc.scheduling.profiles`) gives the step cost and budgets, the candidate gives the load
and the cached prefix. All times are seconds, token counts tokens. Notation, per engine (a pod with
``d`` data-parallel ranks, known from its signals' ``engine`` labels, splits its counts evenly over
them: a request lands on one rank):

* ``S`` = ``max_num_seqs``, ``B`` = ``max_num_batched_tokens``, ``rate`` = ``prefill_tokens_per_s``,
  ``T`` = ``typical_prompt_tokens``, ``O`` = ``typical_output_tokens``,
  ``step(n) = (decode_base_ms + decode_per_seq_ms x min(n, S)) / 1000``.
* **Load**: ``r0, w0`` = the engine's scraped running and waiting (0 without fresh signals; the
  scheduler passes None for stale ones), ``load = max(in_flight, r0 + w0)``. The ``new = load - r0 -
  w0`` requests our own accounting knows but the last scrape did not show arrived since it, so they
  are assumed to still need a prefill of ``T`` tokens; they take free seats (``S - r0``) unless the
  engine already reports a queue, the rest wait. Running ``R = r0 + seated``, waiting ahead
  ``W = w0 + new - seated``; decoding ``D = min(r0, S)`` (scraped running requests are assumed past
  their prefill).
* **Uncached prompt**: ``U = max(0, prompt_tokens - C)`` with ``C = cached_tokens +
  floor(lower_tier_hit_weight x lower_tier_tokens)``: tokens an offload tier holds right after the GPU
  hit count at the profile's weight, since loading them back costs a fraction of recomputing them
  (prompt unknown: ``T``, the profile's typical prompt, 512 tokens by default). An engine always
  computes at least one token, so prefill work uses ``max(U, 1)``.
* **Seat wait**: we need ``k = max(0, R + W + 1 - S)`` seats to free up. Each running request
  holds its seat ``O`` decode steps, so with a full batch a seat frees every ``O x step(S) / S``:
  ``wait = k x O x step(S) / S``.
* **Prefill ahead and our own** (FCFS, chunked): ``A = (W + seated) x T`` tokens of other
  prefills are ahead of ours. The step budget left after the ``D`` decodes is ``chunk = max(1, B -
  D)``, so ``X = A + max(U, 1)`` tokens take ``ceil(X / chunk)`` steps, each carrying the decodes:
  ``prefill = X / rate + ceil(X / chunk) x step(D)``.
* **Residual**: a busy engine (``load > 0``) is mid-step when we arrive: ``step(D) / 2`` on average.

``TTFT = residual + wait + prefill``. For an idle engine that is exactly the simulator's
``ceil(U / B) x decode_base + U / rate``; with ``N`` decodes running (and seen by the scrape) it is
``step(N) / 2 + U / rate + ceil(U / (B - N)) x step(N)``, again the simulator's for an arrival
mid-step.

**Saturation** (:func:`is_saturated`): with a ``queue_limit`` ``L``, an endpoint is saturated when
``now >= d x S + L``, where ``now = max(in_flight, r0 + w0 - ended)`` and ``ended`` counts our
requests there that ended since the scrape (its queue already holds ``L`` requests: ours would be
beyond the limit; a seat that frees is seen at once, not a scrape later). With a ``kv_cache_limit``
``K`` it is saturated too while the scraped KV-cache use is at least ``K`` and none of our requests
there ended since. Saturated candidates rank last; when all are saturated the request should wait
for room or be shed (429): :attr:`Ranking.shed`, :mod:`extproc.control.flow`.

**Affinity yields to load by construction**: a cached prefix only shrinks ``U``; every request
queued or prefilling ahead adds ``T / rate`` plus its share of steps, and every queued request past
the batch cap adds ``O x step(S) / S`` more, so once a prefix holder's queue costs more than the
cold pods' full prefill, a cold pod ranks first.

**Ranking cost**: candidates rank by ``cost = TTFT + prefill_work_weight x max(U, 1) / rate``, not
by TTFT alone. TTFT is what this request waits; the second term is the compute the pick spends on
it, which every request arriving at that pod during the prefill waits for too, and which (when
another pod holds the prefix) stores a second copy of blocks the fleet already caches, evicting
something else. Greedy TTFT undercharges a cold pod exactly by that externality: in the offline
Mooncake replay (3,000 rows) it sent 104 requests, 2.1% of all prompt tokens, away from a pod that
held their prefix. Over three seeds there, the fleet's hit rate was 11.8-12.7% with weight 0 (TTFT
alone), 12.4-12.6% with 1, 13.1-13.5% with 2 (the default) and 13.2-13.3% with 3, with mean TTFTs
within 2% of each other (``bench/results/replay_offline.md``). More than 1 fits the reasoning: the
compute delays more requests than this one, and the copy it stores evicts blocks.

**Ties**: costs within ``max(5 %, 1 ms)`` of the best remaining one's TTFT above its cost form a
group shuffled with ``rng`` (seeded: reproducible); the prediction error is larger than that.

Approximations (documented, deliberate): requests ahead have a typical prompt, fully uncached;
requests seen by our accounting but not by the scrape are assumed still in prefill (over-estimates
load right after a burst, which spreads bursts); running requests in the scrape are assumed decoding;
a queue caused by a full KV cache (waiting with free seats) is only charged its prefill work; the
attention cost of long contexts is not modelled (nor by the simulator).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from extproc.catalog.model import Endpoint
from extproc.scheduling.policy import Candidate, Prediction, Ranking, RequestFacts
from extproc.scheduling.profiles import Profile
from extproc.types import WorkerSetKey

#: Predictions within this fraction of the best remaining one are ties.
TIE_RELATIVE = 0.05
#: ... or within this many seconds.
TIE_ABSOLUTE_S = 0.001


def effective_cached_tokens(gpu_tokens: int, lower_tokens: int, profile: Profile) -> int:
    """Cached tokens a policy should count: GPU hits, plus lower-tier hits at their weight.

    ``gpu_tokens + floor(lower_tier_hit_weight x lower_tokens)``, where ``lower_tokens`` are the
    prefix tokens found only in a lower tier (CPU, storage) right after the GPU hit.
    """
    return max(0, gpu_tokens) + math.floor(profile.lower_tier_hit_weight * max(0, lower_tokens))


def predict(request: RequestFacts, candidate: Candidate, profile: Profile) -> Prediction:
    """Predict ``candidate``'s TTFT for ``request`` (formulas in the module docstring)."""
    p = profile
    prompt = request.prompt_tokens if request.prompt_tokens is not None else p.typical_prompt_tokens
    cached = (
        effective_cached_tokens(candidate.cached_tokens, candidate.lower_tier_tokens, p)
        if candidate.lower_tier_tokens
        else max(0, candidate.cached_tokens)
    )
    uncached = max(0, prompt - cached)
    signals = candidate.signals
    r0 = w0 = 0
    ranks = 1
    if signals is not None:
        r0 = max(0, signals.running or 0)
        w0 = max(0, signals.waiting or 0)
        ranks = signals.data_parallel_size
    load = max(candidate.in_flight, r0 + w0)
    saturated = (p.queue_limit is not None or p.kv_cache_limit is not None) and is_saturated(candidate, p)

    S, B = p.max_num_seqs, p.max_num_batched_tokens
    if signals is None and candidate.pending_prefill_tokens is not None:
        # Only our own accounting, but exact: the prefill work we routed there and predicted to be
        # still running, and the rest of our requests decoding.
        running = float(min(load, S))
        waiting = float(max(0, load - S))
        decoding = float(min(max(0, load - candidate.pending_prefills), S))
        ahead = float(candidate.pending_prefill_tokens)
    else:
        # Per rank (floats: an even split over the ranks).
        running, queued, new = r0 / ranks, w0 / ranks, (load - r0 - w0) / ranks
        seated = 0.0 if queued > 0 else min(new, max(0.0, S - running))
        waiting = queued + new - seated
        decoding = min(running, S)
        running += seated
        # The engine's own queue costs a typical prompt each; the requests only we know of cost
        # their recorded prefill when we track it (else a typical prompt each too).
        ours = candidate.pending_prefill_tokens
        ahead = queued * p.typical_prompt_tokens + (
            new * p.typical_prompt_tokens if ours is None else ours / ranks
        )

    seats_needed = max(0.0, running + waiting + 1 - S)
    wait = seats_needed * p.typical_output_tokens * p.step_s(S) / S
    work = ahead + max(uncached, 1)
    chunk = max(1.0, B - decoding)
    step = p.step_s(decoding)
    residual = step / 2 if load > 0 else 0.0
    stepped = residual + wait + math.ceil(work / chunk - 1e-9) * step
    ttft = work / p.prefill_tokens_per_s + stepped
    spent = p.prefill_work_weight * max(uncached, 1) / p.prefill_tokens_per_s
    return Prediction(ttft, uncached, load, saturated, work_tokens=work, step_s=stepped, cost_s=ttft + spent)


def is_saturated(candidate: Candidate, profile: Profile) -> bool:
    """The endpoint has no room for one more request (module docstring, *Saturation*)."""
    signals, ended = candidate.signals, candidate.ended_since_scrape
    limit = profile.queue_limit
    if limit is not None:
        ranks = 1
        scraped = 0
        if signals is not None:
            ranks = signals.data_parallel_size
            scraped = max(0, signals.running or 0) + max(0, signals.waiting or 0) - ended
        if max(candidate.in_flight, scraped) >= ranks * profile.max_num_seqs + limit:
            return True
    kv = profile.kv_cache_limit
    return (
        kv is not None
        and signals is not None
        and ended == 0
        and signals.kv_cache_usage is not None
        and signals.kv_cache_usage >= kv
    )


class PredictedTTFT:
    """Lowest ranking cost (predicted time to first token plus the prefill work spent) first;
    near-ties at random; saturated endpoints last.

    Sheds (429) when every candidate is saturated. Returns the pick's :class:`Prediction` with
    the ranking (what the lease charges, what calibration fits, what ``--decision-headers`` show).
    """

    name = "predicted-ttft"

    def __init__(self, profile_of: Callable[[Endpoint], Profile]) -> None:
        #: An endpoint's profile: its worker set's, the same for every endpoint of the set.
        self.profile_of = profile_of

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        ordered = self.ordered(request, candidates, rng)
        if not ordered:
            return Ranking([])
        best = ordered[0][0]
        return Ranking(
            candidates=[c for _, c in ordered],
            # Saturated candidates rank last, so a saturated best means all of them are.
            shed=best.saturated,
            prediction=best,
        )

    def ordered(
        self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random
    ) -> list[tuple[Prediction, Candidate]]:
        """Every candidate with its prediction, best first: open ones by cost, then saturated ones."""
        # A profile is a worker set's (configured, then calibrated): looked up once per set, not
        # once per endpoint, which in a pool of 64 was ~15% of the decision (cProfile).
        profiles: dict[WorkerSetKey, Profile] = {}
        scored = []
        for c in candidates:
            profile = profiles.get(c.endpoint.worker_set)
            if profile is None:
                profile = profiles[c.endpoint.worker_set] = self.profile_of(c.endpoint)
            scored.append((predict(request, c, profile), c))
        open_ = sorted((s for s in scored if not s[0].saturated), key=lambda s: s[0].cost_s)
        full = sorted((s for s in scored if s[0].saturated), key=lambda s: s[0].cost_s)
        return _shuffle_ties(open_, rng) + _shuffle_ties(full, rng)


def _shuffle_ties(
    ordered: list[tuple[Prediction, Candidate]], rng: random.Random
) -> list[tuple[Prediction, Candidate]]:
    """Shuffle each run of costs within the tie tolerance of the run's first (best) one.

    The tolerance is a share of the best one's predicted TTFT, not of its cost: it stands for the
    prediction's error, and the cost's work term would widen it (two cold pods, one of them busy,
    differ by the busy one's queue whatever the prompt's compute).
    """
    result: list[tuple[Prediction, Candidate]] = []
    start = 0
    while start < len(ordered):
        best = ordered[start][0]
        limit = best.cost_s + max(TIE_RELATIVE * best.ttft_s, TIE_ABSOLUTE_S)
        end = start + 1
        while end < len(ordered) and ordered[end][0].cost_s <= limit:
            end += 1
        group = ordered[start:end]
        rng.shuffle(group)
        result.extend(group)
        start = end
    return result
