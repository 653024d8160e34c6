"""The scheduling seam: what a policy sees about a request and each candidate, and what it returns.

Producers (prefix lookup, engine signals, in-flight accounting) fill one :class:`Candidate` per
eligible endpoint and one :class:`RequestFacts` per request; a :class:`Policy` is a pure function
of those (plus seeded randomness for ties) returning a :class:`Ranking`: the candidates best first,
and whether the request should be shed. The scheduler takes the first as the pick and the next
ones as Envoy's fallbacks. Policies are named in :mod:`extproc.scheduling.registry`; benchmarks
run several over the same producers, side by side.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from extproc.catalog.model import Endpoint
from extproc.scheduling.engine_signals import EngineSignals


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a policy may know about the request."""

    #: The upstream model (or LoRA adapter) name.
    model: str
    #: Prompt length in tokens: exact when tokenized, else estimated (~4 characters a token); None if unknown.
    prompt_tokens: int | None
    #: ``max_tokens`` / ``max_completion_tokens`` when the client gave it.
    max_tokens: int | None


@dataclass(frozen=True, slots=True)
class Candidate:
    """One eligible endpoint and everything known about its state right now."""

    endpoint: Endpoint
    #: Requests we routed there that have not finished (our own accounting, always fresh).
    in_flight: int
    #: Leading prompt tokens it holds in its KV cache (precise or approximate; 0 if unknown).
    cached_tokens: int
    #: The engine's last scraped signals, None when unknown or stale.
    signals: EngineSignals | None = None
    #: Of ``in_flight``: uncached prompt tokens and requests we expect to be still prefilling
    #: (None: not tracked; the rest of our in-flight requests are decoding).
    pending_prefill_tokens: int | None = None
    pending_prefills: int = 0
    #: Prompt tokens right after ``cached_tokens`` held on an offload tier (CPU, storage).
    lower_tier_tokens: int = 0
    #: Of our requests there, how many ended since ``signals`` were scraped: the engine's counts
    #: are that much too high now (saturation reads them net of it, so a seat that frees is seen
    #: at once, not a scrape later).
    ended_since_scrape: int = 0


class Prediction(NamedTuple):
    """One candidate's predicted time to first token and what it came from (a predicting policy's
    typed note on its pick; the protocol layer turns it into response headers, calibration into
    fits).

    A named tuple, not a frozen dataclass: one is made per candidate per decision, and a frozen
    dataclass's ``__init__`` (``object.__setattr__`` per field) took 1.0 µs against 0.4.
    """

    #: Predicted seconds from now to the first token.
    ttft_s: float
    #: Prompt tokens the candidate would compute for this request (``prompt - cached``, >= 0).
    uncached_tokens: int
    #: ``max(in_flight, running + waiting)``: requests the endpoint holds, all ranks.
    load: int
    #: The endpoint has no room: its queue is at its profile's ``queue_limit``, or its KV cache at
    #: ``kv_cache_limit`` (:func:`~extproc.scheduling.predictor.is_saturated`).
    saturated: bool
    #: Prefill tokens the prediction charges (``ahead + max(uncached, 1)``): ``ttft_s`` holds
    #: ``work_tokens / prefill_tokens_per_s`` seconds of compute, the rest is step costs and waits
    #: proportional to the profile's step cost. Calibration fits both parts.
    work_tokens: float = 0.0
    #: The part of ``ttft_s`` that scales with the step cost (``decode_base_ms``, ``decode_per_seq_ms``).
    step_s: float = 0.0
    #: What ranking compares: ``ttft_s`` plus the weighted prefill compute the pick spends (module
    #: docstring of :mod:`extproc.scheduling.predictor`, *Ranking cost*).
    cost_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Ranking:
    """A policy's answer: every candidate, best first, and what the scheduler should know of the pick."""

    candidates: list[Candidate]
    #: Every candidate is saturated: the scheduler answers 429 instead of routing.
    shed: bool = False
    #: The pick's prediction, from a policy that predicts (None otherwise). Its uncached tokens and
    #: TTFT are the lease's predicted prefill, so the next predictions charge that endpoint for the
    #: work until it should be done.
    prediction: Prediction | None = None


class Policy(Protocol):
    """Ranks candidates. Pure: no I/O, no clocks; ``rng`` only for ties."""

    @property
    def name(self) -> str: ...

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        """All candidates, best first (the scheduler cuts the list to pick + fallbacks)."""
        ...
