"""What a reflector does after a failed list or watch, and how long it waits (pure).

- 410 Gone: the resourceVersion left the server's history; list again at once (then back off
  if the very next attempt fails the same way, so a confused server is not hammered).
- 404 for an optional resource type (Gateway API CRDs absent): not an error; the type counts
  as present with no objects, and is looked for again every ``unavailable_retry`` seconds.
- Anything else (no answer, 401/403, 5xx, a malformed answer): exponential backoff with jitter,
  keeping what is known, and resuming the watch where it stopped when a resourceVersion is known.
- A watch that ended without an error: watch again at once if it worked (delivered something, or
  stayed open a few seconds; proxies often cut watches long before their timeout), and back off
  only if it ended almost at once with nothing, so such a server is not asked in a tight loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from extproc.errors import KubeApiError
from extproc.kube.resources import ResourceType
from extproc.kube.wire import is_gone


@dataclass(slots=True)
class Backoff:
    """Delays that double from ``initial`` up to ``maximum`` seconds, each cut by up to ``jitter``.

    Jitter spreads the reconnects of many replicas after an API-server restart.
    """

    initial: float = 0.5
    maximum: float = 30.0
    #: Fraction of each delay that is random: a delay d becomes uniform in [d * (1 - jitter), d].
    jitter: float = 0.5
    rng: random.Random | None = None
    failures: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {self.initial}, {self.maximum}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {self.jitter}")

    def next(self) -> float:
        """The delay before the next attempt; each call counts one more failure."""
        base = min(self.maximum, self.initial * 2.0 ** min(self.failures, 64))
        self.failures += 1
        draw = (self.rng or random).random()
        return base * (1.0 - self.jitter * draw)

    def reset(self) -> None:
        """After a success: the next failure waits ``initial`` again."""
        self.failures = 0


#: A watch open at least this long worked, even if the cluster was quiet.
WORKING_WATCH_SECONDS = 5.0


def after_watch(backoff: Backoff, *, delivered: int, lasted: float) -> float:
    """Seconds to wait before the next watch, after one that ended without an error.

    ``delivered``: events and bookmarks the watch handed over; ``lasted``: seconds it was open.
    """
    if delivered > 0 or lasted >= WORKING_WATCH_SECONDS:
        backoff.reset()
        return 0.0
    return backoff.next()


@dataclass(frozen=True, slots=True)
class Step:
    """What to do next: relist or resume, after how long, and what to report."""

    relist: bool
    delay: float
    #: False when an optional resource type is not served (404).
    available: bool = True
    #: The error to show in ``last_error``; None when the outcome is normal (absent optional type).
    error: str | None = None


def after_failure(
    error: KubeApiError,
    resource_type: ResourceType,
    backoff: Backoff,
    *,
    can_resume: bool,
    gone_before: bool,
    unavailable_retry: float,
) -> Step:
    """Decide the next step after ``error``.

    ``can_resume``: a resourceVersion is known, so a watch can pick up where it stopped.
    ``gone_before``: the previous failure was a 410 too, with nothing successful in between.
    """
    if is_gone(error):
        delay = backoff.next() if gone_before else 0.0
        return Step(relist=True, delay=delay, error=None if not gone_before else error.message)
    if error.status == 404 and resource_type.optional:
        backoff.reset()
        return Step(relist=True, delay=unavailable_retry, available=False)
    if error.status == 404:
        served = f"{resource_type.api_version} {resource_type.plural}"
        message = f"{error.message} (the API server does not serve {served}: is its CRD installed?)"
        return Step(relist=True, delay=backoff.next(), error=message)
    return Step(relist=not can_resume, delay=backoff.next(), error=error.message)
