"""Choosing among eligible endpoints: most cached prompt tokens, then fewest in flight, random ties.

A pure function of (candidates, load, randomness) so it is tested without a server. The scoring
is replaced by latency prediction in a later step; the shape (an ordered list: the pick, then
fallbacks for Envoy to retry on) stays.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from extproc.catalog.model import Endpoint
from extproc.types import EndpointAddress


def pick_endpoints(
    candidates: Sequence[Endpoint],
    load: Callable[[EndpointAddress], int],
    rng: random.Random,
    *,
    count: int,
    cached: Mapping[EndpointAddress, int] | None = None,
) -> list[Endpoint]:
    """Up to ``count`` endpoints: most cached prompt tokens first, then least load, ties at random.

    ``cached`` is the prefix-cache scoring input (absent endpoints hold 0 tokens); without it the
    order is by load alone.
    """
    if count < 1 or not candidates:
        return []
    held = cached or {}
    if count == 1:
        # The common case on the hot path: one pass, reservoir-style tie breaking.
        best: Endpoint | None = None
        best_key = (0, 0)
        ties = 0
        for endpoint in candidates:
            key = (-held.get(endpoint.address, 0), load(endpoint.address))
            if best is None or key < best_key:
                best, best_key, ties = endpoint, key, 1
            elif key == best_key:
                ties += 1
                if rng.randrange(ties) == 0:
                    best = endpoint
        assert best is not None
        return [best]
    ranked = sorted(candidates, key=lambda e: (-held.get(e.address, 0), load(e.address), rng.random()))
    return ranked[:count]


def filter_subset(candidates: Sequence[Endpoint], subset: frozenset[str]) -> list[Endpoint]:
    """The candidates the data plane allows (GIE subset hint): ``ip:port`` or bare ``ip`` entries."""
    return [e for e in candidates if e.address in subset or e.ip in subset]
