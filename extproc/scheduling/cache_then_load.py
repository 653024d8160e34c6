"""``cache-then-load``: most cached prompt tokens, then fewest in flight, ties at random.

Affinity never yields to load here: a prefix holder keeps winning however busy it gets. Kept as a
simple, predictable baseline (and what ``predicted-ttft`` improves on in ``bench/replay``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.scheduling.policy import Candidate, Ranking, RequestFacts


class CacheThenLoad:
    """Sort key ``(-cached_tokens, in_flight, random)``."""

    name = "cache-then-load"

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        return Ranking(sorted(candidates, key=lambda c: (-c.cached_tokens, c.in_flight, rng.random())))
