"""Handing a routed request's in-flight lease from its routing stream to its accounting stream.

Behind the shipped Envoy configs each request has two ext_proc streams: the routing stream, which
ends with the response headers (so a picker going away mid-response cuts nothing), and an
accounting stream in observability mode, which ends with the response. The lease taken at the
decision should be counted once and last until the response ends, so the routing stream *offers*
it under a token its answer carries, and the accounting stream *claims* it with that token.

The two streams reach the picker independently: the accounting stream's first message can arrive
after the routing stream has ended, or (a response of a millisecond or two) never. Once this
process has seen any accounting stream (the gateway runs one), an unclaimed lease is therefore
kept for a grace period after its routing stream ends instead of being released at once; gateways
without an accounting filter release at once as before.
An accounting stream that finds no offer (it reached another replica, or came after the grace)
takes a lease of its own on the request's destination. When the token is this process's own, its
routing stream has ended, so the response has begun and the prefill is over: that lease counts the
request as decoding, never charging its prefill a second time (which would make the endpoint that
holds the prompt look busiest exactly when its follow-ups arrive).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from extproc.control.load import Lease

#: Seconds an unclaimed lease waits for its accounting stream after the routing stream ended. The
#: accounting stream's first message is sent when the request passes its filter, long before the
#: routing stream ends at the response headers, so a claim this late is rare; what usually ends up
#: here is a request whose accounting stream Envoy closed before its message got through (a
#: response within a few milliseconds, rare with the shipped ``deferred_close_timeout: 0.02s``):
#: short keeps that count from outliving the request by much.
GRACE_SECONDS = 0.5


class LeaseHandover:
    """Offers by token; ``release`` ends a lease nobody claimed; ``clock`` is monotonic seconds
    (injected in tests)."""

    def __init__(
        self,
        release: Callable[[Lease], None],
        *,
        owner: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        grace: float = GRACE_SECONDS,
    ) -> None:
        self._release = release
        self._clock = clock
        self._grace = grace
        #: Offers whose routing stream is still open.
        self._open: dict[str, Lease] = {}
        #: Unclaimed offers whose routing stream ended, with their deadline, oldest first (the grace
        #: is constant, so insertion order is deadline order: expiring is a pop from the front).
        self._waiting: OrderedDict[str, tuple[Lease, float]] = OrderedDict()
        #: Unique to this process (its leases' owner), so a token never matches an offer of another
        #: replica; a token is ``OWNER-NUMBER`` of the lease, so a peer can name the lease it holds.
        self._prefix = owner or secrets.token_hex(4)
        #: An accounting stream has reached this process: the gateway runs one.
        self.accounting_seen = False
        #: Leases no accounting stream claimed within the grace (it reached another replica).
        self.expired = 0
        #: Accounting streams that came with one of our tokens after its routing stream had ended.
        self.late = 0

    def __len__(self) -> int:
        return len(self._open) + len(self._waiting)

    def debug_state(self) -> dict[str, object]:
        return {
            "accountingSeen": self.accounting_seen,
            "offered": len(self._open),
            "waiting": len(self._waiting),
            "expiredUnclaimed": self.expired,
            "lateClaims": self.late,
        }

    def offer(self, lease: Lease) -> str:
        """Offer a routed request's lease; the token goes into the routing answer."""
        self._expire()
        token = f"{self._prefix}-{lease.number}"
        self._open[token] = lease
        return token

    def lent(self, number: int) -> Lease | None:
        """A peer's accounting stream holds our lease ``number`` (its routing stream was ours): it
        is no longer offered here, nor released at its routing stream's end; the peer ends it."""
        return self._take(f"{self._prefix}-{number}")

    def routing_ended(self, token: str) -> None:
        """The routing stream ended: release an unclaimed lease now, or after the grace period."""
        lease = self._open.pop(token, None)
        if lease is None:
            return  # claimed: the accounting stream releases it
        if self.accounting_seen:
            self._waiting[token] = (lease, self._clock() + self._grace)
            with contextlib.suppress(RuntimeError):  # no event loop: expiry waits for the next call
                # Expire it even if no further request comes to do so.
                # (A little late: the loop's timers may fire a hair before the clock reaches it.)
                asyncio.get_running_loop().call_later(self._grace + 0.01, self._expire)
        else:
            self._release(lease)
        self._expire()

    def claim(self, token: str) -> Lease | None:
        """An accounting stream's claim: the offered lease (now its to release), else None."""
        self.accounting_seen = True
        self._expire()
        if not token:
            return None
        lease = self._take(token)
        if lease is None and self.issued_here(token):
            self.late += 1
        return lease

    def _take(self, token: str) -> Lease | None:
        """The lease offered under ``token``, open or waiting out its grace, no longer offered."""
        lease = self._open.pop(token, None)
        if lease is None and token in self._waiting:
            lease = self._waiting.pop(token)[0]
        return lease

    def issued_here(self, token: str) -> bool:
        """``token`` is one this process offered (whether or not it is still offered)."""
        return token.startswith(self._prefix + "-")

    def _expire(self) -> None:
        """Release unclaimed leases past their grace."""
        now = self._clock()
        while self._waiting:
            token, (lease, deadline) = next(iter(self._waiting.items()))
            if deadline > now:
                return
            del self._waiting[token]
            self.expired += 1
            self._release(lease)
