"""The scheduling seam: what a policy sees about a request and each candidate, and how it ranks them.

Producers (prefix lookup, engine signals, in-flight accounting) fill one :class:`Candidate` per
eligible endpoint and one :class:`RequestFacts` per request; a :class:`Policy` is a pure function
of those (plus seeded randomness for ties) returning the candidates best first. The scheduler takes
the first as the pick and the next ones as Envoy's fallbacks. Benchmarks run several policies over
the same producers, side by side.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from extproc.catalog.model import Endpoint
from extproc.engines.signals import EngineSignals


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


class Policy(Protocol):
    """Ranks candidates, best first. Pure: no I/O, no clocks; ``rng`` only for ties."""

    name: str

    def rank(
        self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random
    ) -> list[Candidate]:
        """All candidates, best first (the scheduler cuts the list to pick + fallbacks)."""
        ...


class CacheThenLoad:
    """Most cached prompt tokens, then fewest in flight, ties at random (affinity never yields)."""

    name = "cache-then-load"

    def rank(
        self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random
    ) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (-c.cached_tokens, c.in_flight, rng.random()))


class LeastInFlight:
    """Fewest of our in-flight requests, ties at random (ignores caches)."""

    name = "least-in-flight"

    def rank(
        self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random
    ) -> list[Candidate]:
        return sorted(candidates, key=lambda c: (c.in_flight, rng.random()))
