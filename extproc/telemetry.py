"""Prometheus metrics and logging setup.

Each server owns its own :class:`CollectorRegistry` (tests run several in one process). Gauges
that describe state (in-flight counts, catalog size) are computed at scrape time from the state
itself, so they can never drift from it.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Seconds; a decision is normally well under a millisecond, so the buckets start at 100 µs.
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


K = TypeVar("K", bound=Hashable)


class LogLimiter(Generic[K]):
    """At most one log line per (subject, kind of problem) every ``interval`` seconds.

    A broken engine or stream repeats its failure every poll or batch; the first occurrence is
    worth a line, the next thousand are counted in metrics instead.
    """

    def __init__(self, clock: Callable[[], float], interval: float = 60.0) -> None:
        self._clock = clock
        self._interval = interval
        #: subject -> kind -> when it was last logged. By subject, so forgetting one is O(1): a
        #: catalog edit can drop thousands of endpoints at once, on the event loop.
        self._last: dict[K, dict[str, float]] = {}

    def allow(self, subject: K, kind: str) -> bool:
        """True (and remembered) when this subject's problem of this kind may be logged now."""
        now = self._clock()
        kinds = self._last.setdefault(subject, {})
        last = kinds.get(kind)
        if last is not None and now - last < self._interval:
            return False
        kinds[kind] = now
        return True

    def forget(self, subject: K) -> None:
        """The subject is gone: drop its entries (memory stays bounded by what is followed)."""
        self._last.pop(subject, None)


class Metrics:
    """The request path's metrics, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "extproc_requests_total",
            "Requests seen by the ext_proc server, by outcome: routed, answered (we replied "
            "ourselves, e.g. GET /v1/models), or the error code (model_not_found, ...).",
            ["outcome"],
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "extproc_decision_duration_seconds",
            "Time from the last request byte reaching us to our routing answer.",
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.body_bytes = Histogram(
            "extproc_request_body_bytes",
            "Size of request bodies we routed or rejected.",
            buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216),
            registry=self.registry,
        )
        self.streams = Gauge(
            "extproc_streams_active", "Open ext_proc streams (one per HTTP request).", registry=self.registry
        )
        self.streams_ended = Counter(
            "extproc_streams_ended",
            "ext_proc streams by kind (routing, accounting, none: no message came) and how they ended: "
            "closed (its exchange was over: Envoy's half-close, Envoy's close after serve had what it "
            "needed, or serve ending it; every accounting stream that took its count ends so), "
            "cancelled (Envoy reset it first: for a routing stream, usually a client that left before "
            "the response's headers).",
            ["kind", "how"],
            registry=self.registry,
        )
        self.buffered_bytes = Gauge(
            "extproc_buffered_body_bytes",
            "Request-body bytes held by streams waiting for their last chunk (see --max-buffered-bytes).",
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "extproc_event_loop_lag_seconds",
            "How late a timer due every 10 ms ran: the wait the event loop imposed on every request.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
        self.malloc_trimmed = Counter(
            "extproc_malloc_trimmed_bytes_total",
            "Resident memory given back to the system by the periodic malloc_trim (--malloc-trim-interval).",
            registry=self.registry,
        )
        self.malloc_trim_seconds = Histogram(
            "extproc_malloc_trim_seconds",
            "How long one malloc_trim took (in a worker thread; it holds glibc's arena locks meanwhile).",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
            registry=self.registry,
        )
        self.gc_pause_seconds = Histogram(
            "extproc_gc_pause_seconds",
            "How long one run of Python's cyclic garbage collector stopped everything, by generation "
            "(2: a full collection, the long ones).",
            ["generation"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
            registry=self.registry,
        )
        self.gc_young_bounded = Counter(
            "extproc_gc_young_bounded_total",
            "Young collections serve ran because the young generation had grown past its bound, which "
            "CPython's own trigger misses under churn (see extproc.serve.memory).",
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "extproc_upstream_failures_total",
            "Routed requests whose pick failed, as Envoy's response attributes tell: connect_failed "
            "(Envoy could not connect to it) or retried_away (Envoy retried on another endpoint). "
            "Either way the endpoint is routed around until its metrics answer again.",
            ["kind"],
            registry=self.registry,
        )
        self.model_rewrites = Counter(
            "extproc_model_rewrites_total",
            "Requests whose body model was rewritten from an alias to the upstream name.",
            registry=self.registry,
        )
        self.source_reloads = Counter(
            "extproc_catalog_reloads_total",
            "Catalog source reloads, by result (ok, failed).",
            ["result"],
            registry=self.registry,
        )


#: Characters that could end or forge a log line, or hide what follows.
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029]")


def clip(text: str, limit: int = 200) -> str:
    """Client-supplied text made safe for one log line: control characters escaped, length bounded."""
    if len(text) > limit:
        text = f"{text[:limit]}...({len(text) - limit} more characters)"
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def configure_logging(level: str) -> None:
    """key=value logs on stderr; the level name comes from ``--log-level``."""
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
