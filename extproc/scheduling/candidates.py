"""Which endpoints of a large pool a decision scores: a bounded set, so its cost does not grow with
the pool.

Scoring predicts a time to first token per endpoint (~8 µs each in Python): 1,000 endpoints cost
more than the rest of the request path together. The endpoints that can win are few: the ones
holding the longest prefix of the prompt (a cache hit saves the most), and the least loaded ones
(the shortest wait); a few random ones besides, so that no endpoint starves behind a stale order
and a new one gets tried. :func:`choose` unites the three; a pool no larger than their sum is
scored whole, exactly as before.

Shedding follows: a request is refused (429) when every scored endpoint is saturated, and the
least loaded are among them, so a pool sheds only when its least-loaded endpoints are full.

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
    for address in _top_holders(cached, limits.prefix_holders, rng):
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


def _top_holders(cached: Mapping[EndpointAddress, int], k: int, rng: random.Random) -> list[EndpointAddress]:
    """The ``k`` endpoints holding the most cached tokens; those tied at the cut drawn at random.

    A prefix many endpoints hold (a system prompt) ties them all: a fixed tie-break would score the
    same few for every request and, with the rest scored only when least loaded, send those few
    up to twice their share (seen in the replay at 32 engines).
    """
    if len(cached) <= k:
        return list(cached)
    if k <= 0:
        return []
    top = heapq.nlargest(k, cached.items(), key=itemgetter(1))
    cut = top[-1][1]
    above = [address for address, tokens in top if tokens > cut]
    tied = [address for address, tokens in cached.items() if tokens == cut]
    return above + rng.sample(tied, k - len(above))
