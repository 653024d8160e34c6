"""The load view: every request routed to an endpoint that has not finished, as lease values.

A :class:`Lease` is a value with an owner (this replica, or later a peer), taken when a request is
routed and removed exactly once when it ends, however it ends. The :class:`LoadView` holds the
leases and keeps, per endpoint, what decisions read: how many requests are in flight and the
prefill work we expect them to still do. Anything that learns of load (request control here, peers
later) adds and removes leases; nothing else writes it. Everything runs on the event loop thread,
so plain dict updates need no lock.

Large pools read it in load order too (:mod:`extproc.control.load_order`): the view keeps that
order as leases come and go, and as scrapes report the engines' own queues.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Set
from dataclasses import dataclass

from extproc.control.load_order import LoadOrder
from extproc.types import EndpointAddress

#: Who holds a lease: this replica's id, or a peer's.
Owner = str
#: A lease's identity: unique per owner.
LeaseKey = tuple[Owner, int]


@dataclass(frozen=True, slots=True)
class Lease:
    """One request's claim on an endpoint until the request ends."""

    owner: Owner
    number: int
    endpoint: EndpointAddress
    #: The upstream model ("" for a request without one).
    model: str = ""
    #: Uncached prompt tokens the pick is predicted to compute (0: not predicted).
    prefill_tokens: int = 0
    #: Monotonic time its prefill should be done; the request counts as prefilling until then.
    prefill_until: float = 0.0

    @property
    def key(self) -> LeaseKey:
        return (self.owner, self.number)


class LoadView:
    """Leases per endpoint: in-flight counts and predicted prefill still pending.

    A lease with predicted prefill counts as *prefilling* until its ``prefill_until`` (or until the
    response begins, :meth:`prefill_over`), and as decoding afterwards: the latency predictor
    charges the next request for exactly that work instead of a typical prompt.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._leases: dict[LeaseKey, Lease] = {}
        self._counts: dict[EndpointAddress, int] = {}
        #: Per endpoint: leases still prefilling -> (tokens, until).
        self._prefills: dict[EndpointAddress, dict[LeaseKey, tuple[int, float]]] = {}
        self._order = LoadOrder()
        #: Pools whose endpoints the order knows: id -> the address set (held, so ids stay unique).
        self._ordered: dict[int, Set[EndpointAddress]] = {}
        #: Per scraped endpoint: leases removed since its last scrape (the scrape still counts them).
        self._ended: dict[EndpointAddress, int] = {}
        #: Told of each lease added (peer sync) and removed (peer sync; flow control: a seat may
        #: have freed), after the view changed.
        self.on_add: list[Callable[[Lease], None]] = []
        self.on_release: list[Callable[[Lease], None]] = []
        #: Told of each lease whose prefill ended early (its response began): peer sync.
        self.on_prefill_over: list[Callable[[Lease], None]] = []

    def __contains__(self, key: LeaseKey) -> bool:
        return key in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, lease: Lease) -> None:
        """Count ``lease`` (a second add of the same key is ignored)."""
        if lease.key in self._leases:
            return
        self._leases[lease.key] = lease
        count = self._counts[lease.endpoint] = self._counts.get(lease.endpoint, 0) + 1
        self._order.in_flight(lease.endpoint, count)
        if lease.prefill_tokens > 0 and lease.prefill_until > 0:
            self._prefills.setdefault(lease.endpoint, {})[lease.key] = (
                lease.prefill_tokens,
                lease.prefill_until,
            )
        for listener in self.on_add:
            listener(lease)

    def remove(self, key: LeaseKey) -> Lease | None:
        """Stop counting the lease; the lease, or None when it was not held (removing twice is harmless)."""
        lease = self._leases.pop(key, None)
        if lease is None:
            return None
        left = self._counts.get(lease.endpoint, 0) - 1
        if left > 0:
            self._counts[lease.endpoint] = left
        else:
            # Drop zero entries so endpoints that left the pool do not linger forever.
            self._counts.pop(lease.endpoint, None)
        self._order.in_flight(lease.endpoint, max(0, left))
        self.prefill_over(key, lease.endpoint)
        ended = self._ended.get(lease.endpoint)
        if ended is not None:
            self._ended[lease.endpoint] = ended + 1
        for listener in self.on_release:
            listener(lease)
        return lease

    def prefill_over(self, key: LeaseKey, endpoint: EndpointAddress | None = None) -> None:
        """The lease's response has begun: its prefill is over, whatever was predicted; the
        request still counts, as decoding."""
        if endpoint is None:
            lease = self._leases.get(key)
            if lease is None:
                return
            endpoint = lease.endpoint
        prefills = self._prefills.get(endpoint)
        if prefills is None or prefills.pop(key, None) is None:
            return
        if not prefills:
            del self._prefills[endpoint]
        lease = self._leases.get(key)
        if lease is not None:
            for listener in self.on_prefill_over:
                listener(lease)

    def prefilling(self, key: LeaseKey) -> bool:
        """The lease still counts as prefilling (its response has not begun, its prediction not run out)."""
        lease = self._leases.get(key)
        if lease is None:
            return False
        pending = self._prefills.get(lease.endpoint, {}).get(key)
        return pending is not None and pending[1] > self._clock()

    def count(self, address: EndpointAddress) -> int:
        """Requests in flight at ``address``."""
        return self._counts.get(address, 0)

    def pending_prefill(self, address: EndpointAddress) -> tuple[int, int]:
        """(uncached prompt tokens, requests) routed to ``address`` whose prefill should still run."""
        prefills = self._prefills.get(address)
        if not prefills:
            return 0, 0
        now = self._clock()
        tokens = requests = 0
        for pending, until in prefills.values():
            if until > now:
                tokens += pending
                requests += 1
        return tokens, requests

    def least_loaded(self, k: int, among: Set[EndpointAddress]) -> list[EndpointAddress]:
        """Up to ``k`` endpoints of ``among`` with the least load, least first: ``max(in flight,
        the engine's running + waiting at its last scrape)``. O(k) for one pool's endpoints; the
        first call for an address set orders its endpoints (once per catalog snapshot)."""
        known = self._ordered.get(id(among))
        if known is not among:
            if len(self._ordered) >= 1024:
                self._ordered.clear()
            self._ordered[id(among)] = among
            self._order.add(among)
        return self._order.least(k, among)

    def engine_queue(self, address: EndpointAddress, requests: int) -> None:
        """A scrape of ``address`` found ``requests`` running or waiting (for the load order)."""
        self._order.queued(address, requests)
        self._ended[address] = 0

    def ended_since_scrape(self, address: EndpointAddress) -> int:
        """Requests at ``address`` that ended since its last scrape (0 when never scraped)."""
        return self._ended.get(address, 0)

    def keep_endpoints(self, addresses: Set[EndpointAddress]) -> None:
        """The catalog now has only ``addresses``: the load order forgets the rest (leases stay
        until their requests end)."""
        self._order.keep(addresses)
        self._ordered.clear()
        for gone in self._ended.keys() - addresses:
            del self._ended[gone]

    def snapshot(self, owner: Owner | None = None) -> Mapping[EndpointAddress, int]:
        """In-flight counts per endpoint, now: every lease, or only ``owner``'s."""
        if owner is None:
            return dict(self._counts)
        counts: dict[EndpointAddress, int] = {}
        for lease in self._leases.values():
            if lease.owner == owner:
                counts[lease.endpoint] = counts.get(lease.endpoint, 0) + 1
        return counts

    def leases(self, owner: Owner) -> Iterator[Lease]:
        """``owner``'s leases held now."""
        return (lease for lease in list(self._leases.values()) if lease.owner == owner)

    @property
    def total(self) -> int:
        return len(self._leases)
