"""Which endpoints of a large pool a decision scores: a bounded set, so its cost does not grow with
the pool.

Scoring predicts a time to first token per endpoint (~8 µs each in Python): 1,000 endpoints cost
more than the rest of the request path together. The endpoints that can win are few: the ones
holding the longest prefix of the prompt (a cache hit saves the most), and the least loaded ones
(the shortest wait); a few random ones besides, so that no endpoint starves behind a stale order
and a new one gets tried. :func:`choose` unites the three; a pool no larger than their sum is
scored whole, exactly as before.

``bench/replay`` runs the bounded set against scoring every endpoint, side by side
(``bench/results/candidates.md``).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from operator import itemgetter

from extproc.catalog.model import Endpoint
from extproc.scheduling.pool import Pool
from extproc.settings import CandidateSettings
from extproc.types import EndpointAddress


def choose(
    pool: Pool,
    cached: Mapping[EndpointAddress, int],
    least_loaded: Sequence[EndpointAddress],
    limits: CandidateSettings,
    rng: random.Random,
) -> list[Endpoint]:
    """The endpoints to score: the ``limits.prefix_holders`` holding the most cached tokens, the
    ``least_loaded`` given, and ``limits.random`` drawn from the pool, each once."""
    by_address = pool.by_address
    chosen: dict[EndpointAddress, Endpoint] = {}
    holders = cached.items()
    if len(cached) > limits.prefix_holders:
        holders = heapq.nlargest(limits.prefix_holders, holders, key=itemgetter(1))  # type: ignore[assignment]
    for address, _tokens in holders:
        endpoint = by_address.get(address)
        if endpoint is not None:
            chosen[address] = endpoint
    for address in least_loaded:
        chosen.setdefault(address, by_address[address])
    endpoints = pool.endpoints
    for _ in range(limits.random):
        endpoint = endpoints[rng.randrange(len(endpoints))]
        chosen.setdefault(endpoint.address, endpoint)
    return list(chosen.values())
