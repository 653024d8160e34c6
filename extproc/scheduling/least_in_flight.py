"""``least-in-flight``: fewest of our in-flight requests, ties at random (caches ignored).

Also how the scheduler places requests that name no model (bodiless reads): with no prompt there
is nothing to match and no model to predict for, only load to spread.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc.scheduling.policy import Candidate, Ranking, RequestFacts


class LeastInFlight:
    """Sort key ``(in_flight, random)``."""

    name = "least-in-flight"

    def rank(self, request: RequestFacts, candidates: Sequence[Candidate], rng: random.Random) -> Ranking:
        return Ranking(sorted(candidates, key=lambda c: (c.in_flight, rng.random())))
