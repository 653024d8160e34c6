"""Choosing among eligible endpoints: fewest in-flight requests first, random among ties.

A pure function of (candidates, load, randomness) so it is tested without a server. The scoring
is replaced by latency prediction in a later step; the shape (an ordered list: the pick, then
fallbacks for Envoy to retry on) stays.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from extproc.catalog.model import Endpoint
from extproc.types import EndpointAddress


def pick_endpoints(
    candidates: Sequence[Endpoint],
    load: Callable[[EndpointAddress], int],
    rng: random.Random,
    *,
    count: int,
) -> list[Endpoint]:
    """Up to ``count`` endpoints ordered by ascending load, ties in random order."""
    if count < 1 or not candidates:
        return []
    if count == 1:
        # The common case on the hot path: one pass, reservoir-style tie breaking.
        best: Endpoint | None = None
        best_load = 0
        ties = 0
        for endpoint in candidates:
            current = load(endpoint.address)
            if best is None or current < best_load:
                best, best_load, ties = endpoint, current, 1
            elif current == best_load:
                ties += 1
                if rng.randrange(ties) == 0:
                    best = endpoint
        assert best is not None
        return [best]
    ranked = sorted(candidates, key=lambda e: (load(e.address), rng.random()))
    return ranked[:count]


def filter_subset(candidates: Sequence[Endpoint], subset: frozenset[str]) -> list[Endpoint]:
    """The candidates the data plane allows (GIE subset hint): ``ip:port`` or bare ``ip`` entries."""
    return [e for e in candidates if e.address in subset or e.ip in subset]
