"""Endpoints ordered by load, kept up to date as leases and scrapes change: the least-loaded
candidates of a large pool without a sort per request.

An endpoint's level is ``max(requests we have in flight there, running + waiting at its last
scrape)``, the load the latency predictor starts from, capped at :data:`LEVELS` - 1. Each level is
an insertion-ordered dict, so a change moves one endpoint in O(1) and :meth:`LoadOrder.least` walks
the lowest levels and stops after ``k`` members of the asked-for pool. An endpoint that goes back to
its level joins at the end: among equally loaded endpoints the ones not picked lately come first,
which spreads picks without randomness.

Endpoints start at level 0 when first seen (:meth:`LoadOrder.add`) and leave with
:meth:`LoadOrder.keep` (the catalog dropped them). The walk skips endpoints of other pools, so a
process routing many disjoint models pays for the ones it skips; within one pool it costs O(k).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from extproc.types import EndpointAddress

#: Levels kept apart; endpoints at or above the last are alike to the walk (all far busier than
#: the least loaded of any pool worth ordering).
LEVELS = 256


class LoadOrder:
    def __init__(self) -> None:
        self._in_flight: dict[EndpointAddress, int] = {}
        self._queued: dict[EndpointAddress, int] = {}
        self._level: dict[EndpointAddress, int] = {}
        self._levels: list[dict[EndpointAddress, None]] = [{} for _ in range(LEVELS)]
        #: The lowest level that may hold an endpoint (a hint: levels below it are empty).
        self._lowest = 0

    def __len__(self) -> int:
        return len(self._level)

    def add(self, addresses: Iterable[EndpointAddress]) -> None:
        """Order endpoints not yet known, at the load known for them (0 when nothing is)."""
        for address in addresses:
            if address not in self._level:
                self._place(address)

    def keep(self, addresses: Collection[EndpointAddress]) -> None:
        """Forget every endpoint not in ``addresses`` (they left the catalog); order the new ones."""
        for address in [a for a in self._level if a not in addresses]:
            del self._levels[self._level.pop(address)][address]
            self._in_flight.pop(address, None)
            self._queued.pop(address, None)
        self.add(addresses)

    def in_flight(self, address: EndpointAddress, count: int) -> None:
        """Our requests in flight at ``address`` changed."""
        if count:
            self._in_flight[address] = count
        elif self._in_flight.pop(address, None) is None and address not in self._level:
            return  # a request ending at an endpoint that has left: nothing to order
        self._place(address)

    def queued(self, address: EndpointAddress, requests: int) -> None:
        """A scrape found ``requests`` running or waiting at ``address``."""
        self._queued[address] = max(0, requests)
        self._place(address)

    def least(self, k: int, among: Collection[EndpointAddress]) -> list[EndpointAddress]:
        """Up to ``k`` members of ``among`` with the lowest levels, lowest first."""
        found: list[EndpointAddress] = []
        if k <= 0:
            return found
        levels = self._levels
        for level in range(self._lowest, LEVELS):
            bucket = levels[level]
            if not bucket:
                if level == self._lowest:
                    self._lowest += 1
                continue
            for address in bucket:
                if address in among:
                    found.append(address)
                    if len(found) == k:
                        return found
        return found

    def _place(self, address: EndpointAddress) -> None:
        level = min(LEVELS - 1, max(self._in_flight.get(address, 0), self._queued.get(address, 0)))
        old = self._level.get(address)
        if old is not None:
            if old == level:
                return
            del self._levels[old][address]
        self._level[address] = level
        self._levels[level][address] = None
        if level < self._lowest:
            self._lowest = level
