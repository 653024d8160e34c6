"""Requests we sent to each endpoint that have not finished yet.

Counts are our own accounting (engines' scraped queues come later): a :class:`Lease` is taken
when a request is routed and released exactly once when its ext_proc stream ends, however it ends.
Everything runs on the event loop thread, so plain dict updates need no lock.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping

from extproc.types import EndpointAddress


class InFlight:
    """In-flight request counts per endpoint address, and the prefill work we expect them to do.

    A request routed with a predicted prefill (uncached prompt tokens, expected to be done at a
    monotonic time) counts as *prefilling* until then, and as decoding afterwards: the latency
    predictor charges the next request for exactly that work instead of a typical prompt.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._counts: dict[EndpointAddress, int] = {}
        self._prefills: dict[EndpointAddress, dict[int, tuple[int, float]]] = {}
        self._ids = itertools.count()
        self._clock = clock

    def count(self, address: EndpointAddress) -> int:
        return self._counts.get(address, 0)

    def pending_prefill(self, address: EndpointAddress) -> tuple[int, int]:
        """(uncached prompt tokens, requests) routed to ``address`` whose prefill should still run."""
        prefills = self._prefills.get(address)
        if not prefills:
            return 0, 0
        now = self._clock()
        tokens = requests = 0
        for pending, done_at in prefills.values():
            if done_at > now:
                tokens += pending
                requests += 1
        return tokens, requests

    def acquire(
        self, address: EndpointAddress, *, prefill_tokens: int = 0, prefill_seconds: float = 0.0
    ) -> Lease:
        self._counts[address] = self._counts.get(address, 0) + 1
        key = None
        if prefill_tokens > 0 and prefill_seconds > 0:
            key = next(self._ids)
            self._prefills.setdefault(address, {})[key] = (prefill_tokens, self._clock() + prefill_seconds)
        return Lease(self, address, key)

    def _prefill_done(self, address: EndpointAddress, key: int | None) -> None:
        if key is not None:
            prefills = self._prefills.get(address)
            if prefills is not None:
                prefills.pop(key, None)
                if not prefills:
                    del self._prefills[address]

    def _release(self, address: EndpointAddress, key: int | None) -> None:
        left = self._counts.get(address, 0) - 1
        if left > 0:
            self._counts[address] = left
        else:
            # Drop zero entries so endpoints that left the pool do not linger forever.
            self._counts.pop(address, None)
        self._prefill_done(address, key)

    def snapshot(self) -> Mapping[EndpointAddress, int]:
        return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())


class Lease:
    """One request's claim on an endpoint; releasing twice is harmless."""

    __slots__ = ("_key", "_owner", "address", "released")

    def __init__(self, owner: InFlight, address: EndpointAddress, key: int | None = None) -> None:
        self._owner = owner
        self.address = address
        self._key = key
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._owner._release(self.address, self._key)

    def first_token(self) -> None:
        """The response has begun (its headers came back): the prefill is over, whatever was
        predicted; the request still counts, as decoding."""
        if not self.released:
            self._owner._prefill_done(self.address, self._key)
