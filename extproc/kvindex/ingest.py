"""Subscriber -> decoder -> index: the sink every KV-event subscription feeds.

Runs on the event loop, called by one subscriber task per source (the single writer of that
source's state). A payload that does not decode is counted and logged at most once a minute per
source; it never ends the stream. Batches for sources the index no longer knows (an endpoint left
while its subscriber was stopping) are counted and dropped.

Large settling rounds run in a worker thread (:mod:`extproc.kvindex.rounds`), so the loop keeps
routing meanwhile; what the subscribers deliver during a round is held there, in order, and handled
after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from extproc.kvindex.decode import KVDecodeError, decode_batch
from extproc.kvindex.events import DecodedBatch, Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.rounds import OffLoopRounds
from extproc.telemetry import LogLimiter

log = logging.getLogger(__name__)

#: Seconds between two logs of the same problem for one source.
LOG_INTERVAL = 60.0
#: A settling round on the event loop longer than this is logged (requests wait for it).
SLOW_SETTLE_S = 0.1


@dataclass(slots=True)
class IngestCounters:
    batches: int = 0
    decode_errors: int = 0
    unknown_source: int = 0
    resets: int = 0


@dataclass(slots=True)
class SourceHealth:
    """What the subscriber last said about a source's stream (for /debug/state and metrics)."""

    complete: bool | None = None
    reason: str = ""
    last_reset: str = ""


@dataclass(slots=True)
class IndexIngest:
    """The :class:`~extproc.kvindex.subscriber.KVEventSink` that applies batches to a PrefixIndex."""

    index: PrefixIndex
    clock: Callable[[], float] = time.monotonic
    counters: IngestCounters = field(default_factory=IngestCounters)
    #: Settling rounds longer than this many seconds are logged.
    slow_settle_s: float = SLOW_SETTLE_S
    health: dict[Source, SourceHealth] = field(default_factory=dict)
    #: Settling rounds in a thread, and what arrives meanwhile (:mod:`extproc.kvindex.rounds`).
    rounds: OffLoopRounds = field(init=False)
    _log_limiter: LogLimiter[Source] = field(init=False)

    def __post_init__(self) -> None:
        self._log_limiter = LogLimiter(self.clock, LOG_INTERVAL)
        self.rounds = OffLoopRounds(self.index)

    def on_batch(self, source: Source, seq: int, payload: bytes) -> None:
        self._now_or_held(len(payload), self._batch, source, seq, payload)

    def on_decoded(self, source: Source, batch: DecodedBatch) -> None:
        """Apply a batch already in domain events (what :meth:`on_batch` does after decoding)."""
        self._now_or_held(64 * len(batch.events), self._decoded, source, batch)

    def on_reset(self, source: Source, reason: str) -> None:
        self._now_or_held(0, self._reset, source, reason)

    def on_completeness(self, source: Source, complete: bool, reason: str) -> None:
        self._now_or_held(0, self._completeness, source, complete, reason)

    def _now_or_held(self, size: int, handle: Callable[..., None], *args: object) -> None:
        """``handle(*args)`` now, or after a settling round and what arrived before (``size`` bytes)."""
        if self.rounds.busy:
            self.rounds.hold(partial(handle, *args), size)
        else:
            handle(*args)

    def _batch(self, source: Source, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVDecodeError as exc:
            self.counters.decode_errors += 1
            self._log_sometimes(
                source, "decode", "kv batch not decoded source=%s seq=%d error=%s", source, seq, exc
            )
            return
        self._decoded(source, batch)

    def _decoded(self, source: Source, batch: DecodedBatch) -> None:
        try:
            result = self.index.apply(source, batch)
        except KeyError:
            self.counters.unknown_source += 1
            return
        self.counters.batches += 1
        self.rounds.maybe_start()
        if result.settle_seconds > self.slow_settle_s:
            self._log_sometimes(
                source,
                "settle",
                "kv index settling round held the event loop %.0f ms (blocks=%d); it grows with the "
                "blocks held: lower --kv-index-memory-mib if requests cannot wait that long",
                result.settle_seconds * 1000,
                self.index.blocks(),
            )
        if result.mismatched and (sizes := self.index.block_size_mismatch(source)) is not None:
            declared, engine = sizes
            self._log_sometimes(
                source,
                "block-size",
                "kv events skipped: the engine's blocks hold %d tokens, not a multiple of the worker "
                "set's kvBlockSize %d; set spec.kvBlockSize to the engine's block size (SGLang's "
                "default page size is 1) source=%s",
                engine,
                declared,
                source,
            )

    def _reset(self, source: Source, reason: str) -> None:
        self.counters.resets += 1
        self.health.setdefault(source, SourceHealth()).last_reset = reason
        if self._log_limiter.allow(source, "reset"):
            log.info("kv source reset source=%s reason=%s", source, reason)
        if source in self.index.sources():
            self.index.clear_source(source)

    def _completeness(self, source: Source, complete: bool, reason: str) -> None:
        health = self.health.setdefault(source, SourceHealth())
        health.complete, health.reason = complete, reason
        if source in self.index.sources():
            self.index.set_complete(source, complete)
        if not complete:
            self._log_sometimes(
                source, "incomplete", "kv source incomplete source=%s reason=%s", source, reason
            )

    def close(self) -> None:
        """Stop the round thread (the process is ending)."""
        self.rounds.close()

    def forget(self, source: Source) -> None:
        """The source left the catalog: drop what we kept about it."""
        self.health.pop(source, None)
        self._log_limiter.forget(source)

    def _log_sometimes(self, source: Source, kind: str, message: str, *args: object) -> None:
        if self._log_limiter.allow(source, kind):
            log.warning(message, *args)
