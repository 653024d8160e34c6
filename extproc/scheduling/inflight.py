"""Requests we sent to each endpoint that have not finished yet.

Counts are our own accounting (engines' scraped queues come later): a :class:`Lease` is taken
when a request is routed and released exactly once when its ext_proc stream ends, however it ends.
Everything runs on the event loop thread, so plain dict updates need no lock.
"""

from __future__ import annotations

from collections.abc import Mapping

from extproc.types import EndpointAddress


class InFlight:
    """In-flight request counts per endpoint address."""

    def __init__(self) -> None:
        self._counts: dict[EndpointAddress, int] = {}

    def count(self, address: EndpointAddress) -> int:
        return self._counts.get(address, 0)

    def acquire(self, address: EndpointAddress) -> Lease:
        self._counts[address] = self._counts.get(address, 0) + 1
        return Lease(self, address)

    def _release(self, address: EndpointAddress) -> None:
        left = self._counts.get(address, 0) - 1
        if left > 0:
            self._counts[address] = left
        else:
            # Drop zero entries so endpoints that left the pool do not linger forever.
            self._counts.pop(address, None)

    def snapshot(self) -> Mapping[EndpointAddress, int]:
        return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())


class Lease:
    """One request's claim on an endpoint; releasing twice is harmless."""

    __slots__ = ("_owner", "address", "released")

    def __init__(self, owner: InFlight, address: EndpointAddress) -> None:
        self._owner = owner
        self.address = address
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._release(self.address)
