"""What a decision needs to know about a route's endpoints, worked out once per catalog snapshot.

A route's endpoint tuple lives as long as the catalog snapshot that holds it, and every request for
the model reads the same one. What a decision derives from it (addresses by endpoint, which of them
publish KV events at which block size) would otherwise cost O(endpoints) per request: 1,000
endpoints made that a millisecond before anything was scored. :class:`PoolCache` keeps the
derivation per (catalog, endpoint tuple), by identity, so a decision's cost stays with what it
scores (:mod:`extproc.scheduling.candidates`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from extproc.catalog.model import Catalog, Endpoint
from extproc.types import EndpointAddress

#: Pools kept for one catalog snapshot (routes, subset-filtered lists are not cached): a bound
#: against a catalog with more models than any real pool has.
MAX_POOLS = 1024


@dataclass(frozen=True, slots=True)
class Pool:
    """Endpoints a request may go to, with what the decision looks up about them."""

    endpoints: Sequence[Endpoint]
    by_address: Mapping[EndpointAddress, Endpoint]
    addresses: frozenset[EndpointAddress]
    #: Endpoints whose worker set publishes no KV events (matched against our routing history).
    approximate: frozenset[EndpointAddress]
    #: Block size -> endpoints publishing KV events whose worker set keys blocks at that size.
    precise: Mapping[int, frozenset[EndpointAddress]]
    #: Endpoints with several data-parallel ranks (each rank its own KV cache).
    multi_rank: frozenset[EndpointAddress]

    def __len__(self) -> int:
        return len(self.endpoints)


def build_pool(catalog: Catalog, endpoints: Sequence[Endpoint]) -> Pool:
    by_address = {e.address: e for e in endpoints}
    precise: dict[int, set[EndpointAddress]] = {}
    approximate: set[EndpointAddress] = set()
    multi_rank: set[EndpointAddress] = set()
    for endpoint in endpoints:
        ws = catalog.worker_sets.get(endpoint.worker_set)
        if endpoint.kv_events_port is None or ws is None:
            approximate.add(endpoint.address)
            continue
        precise.setdefault(ws.kv_block_size, set()).add(endpoint.address)
        if ws.data_parallel_size > 1:
            multi_rank.add(endpoint.address)
    return Pool(
        endpoints,
        by_address,
        frozenset(by_address),
        frozenset(approximate),
        {size: frozenset(addresses) for size, addresses in precise.items()},
        frozenset(multi_rank),
    )


class PoolCache:
    """:func:`build_pool` once per endpoint tuple of the current catalog snapshot.

    Keyed by identity: a tuple the catalog holds is the same object for every request until the
    next snapshot, which empties the cache. Lists (a subset hint's survivors) are built each time.
    """

    def __init__(self) -> None:
        #: Weak: a replaced catalog is freed where serve frees catalogs, not at the next decision.
        self._catalog: weakref.ref[Catalog] | None = None
        #: id(endpoints) -> (endpoints, pool); holding the tuple keeps its id from being reused.
        self._pools: dict[int, tuple[Sequence[Endpoint], Pool]] = {}

    def get(self, catalog: Catalog, endpoints: Sequence[Endpoint]) -> Pool:
        if type(endpoints) is not tuple:
            return build_pool(catalog, endpoints)
        if self._catalog is None or self._catalog() is not catalog:
            self._catalog = weakref.ref(catalog)
            self._pools = {}
        hit = self._pools.get(id(endpoints))
        if hit is not None and hit[0] is endpoints:
            return hit[1]
        pool = build_pool(catalog, endpoints)
        if len(self._pools) >= MAX_POOLS:
            self._pools.clear()
        self._pools[id(endpoints)] = (endpoints, pool)
        return pool
