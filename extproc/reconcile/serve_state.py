"""What the ``serve`` container beside us knows: its ``/debug/worker-sets`` (the ``workerSetStatus``
section of ``/debug/state``, alone and compact, so a poll does not build and parse the whole state).

:func:`parse_router_view` turns that JSON (built by :mod:`extproc.serve.observed`) into typed
records, tolerantly: a field of the wrong shape is dropped rather than failing the whole set, since
a newer or older ``serve`` may say a little more or less. :class:`ServeWatcher` polls it every
``interval`` seconds; :attr:`ServeWatcher.view` is None while ``serve`` cannot be read (after
``failures_to_unavailable`` failed polls in a row, so one slow answer does not flip every
condition), and ``on_change()`` is called whenever the view changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from extproc.fetch import fetch_bounded
from extproc.tasks import cancel_and_wait
from extproc.telemetry import LogLimiter

log = logging.getLogger(__name__)

#: ``/debug/worker-sets`` lists every set's models: allow large fleets but never buffer without end.
MAX_STATE_BYTES = 64 * 1024 * 1024


class ServeStateError(Exception):
    """``/debug/worker-sets`` answered, but not with JSON we can read."""


@dataclass(frozen=True, slots=True)
class ModelView:
    """One model a worker set serves, as the router routes it."""

    upstream_name: str
    aliases: tuple[str, ...] = ()
    ready_endpoints: int = 0
    #: (min, max) of the serving endpoints' ``max_model_len``; None when no endpoint said.
    context_window: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class SetView:
    """The router's view of one worker set."""

    #: False when the router holds no usable version of the set (it rejected it).
    routed: bool = True
    ready_endpoints: int = 0
    terminating_endpoints: int = 0
    models: tuple[ModelView, ...] = ()
    #: Ready endpoints whose KV-event streams (every data-parallel rank) are connected.
    kv_subscribed: int = 0
    #: Endpoints publishing KV blocks that ``kvBlockSize`` does not divide (their events are
    #: skipped), and the smallest such engine block size.
    kv_mismatched: int = 0
    kv_engine_block_size: int | None = None
    discovery_mode: str = "Static"
    #: Static sets, or Endpoint-mode sets at least one of whose endpoints answered ``/v1/models``.
    discovery_answered: bool = True
    problems: tuple[str, ...] = ()
    #: Messages of the name conflicts this set lost.
    conflicts: tuple[str, ...] = ()
    #: Why the router rejected the object (when it did).
    rejected: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RouterView:
    """Every worker set the router knows, by ``namespace/name``."""

    sets: Mapping[str, SetView] = field(default_factory=dict)


def parse_router_view(document: Any) -> RouterView:
    """Read ``/debug/worker-sets`` (pure). Raises :class:`ServeStateError` only when it is not a JSON
    object of sets."""
    if not isinstance(document, dict):
        raise ServeStateError("/debug/worker-sets is not a JSON object of worker sets")
    sets = {
        key: _set_view(entry)
        for key, entry in document.items()
        if isinstance(key, str) and isinstance(entry, dict)
    }
    return RouterView(sets)


def _set_view(entry: dict[str, Any]) -> SetView:
    endpoints = _dict(entry.get("endpoints"))
    kv = _dict(entry.get("kvEvents"))
    mismatch = _dict(kv.get("blockSizeMismatch"))
    discovery = _dict(entry.get("discovery"))
    models = entry.get("models")
    return SetView(
        routed=entry.get("routed") is not False,
        ready_endpoints=_count(endpoints.get("ready")),
        terminating_endpoints=_count(endpoints.get("terminating")),
        models=tuple(_model_view(m) for m in models if _model_name(m)) if isinstance(models, list) else (),
        kv_subscribed=_count(kv.get("subscribedEndpoints")),
        kv_mismatched=_count(mismatch.get("endpoints")),
        kv_engine_block_size=_count(mismatch.get("engineBlockSize")) or None,
        discovery_mode=str(discovery.get("mode", "Static")),
        discovery_answered=discovery.get("answered") is not False,
        problems=_strings(entry.get("problems")),
        conflicts=_strings(entry.get("conflicts")),
        rejected=_strings(entry.get("rejected")),
    )


def _model_name(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("upstreamName"), str)


def _model_view(entry: dict[str, Any]) -> ModelView:
    window = _dict(entry.get("contextWindow"))
    low, high = window.get("min"), window.get("max")
    return ModelView(
        upstream_name=entry["upstreamName"],
        aliases=_strings(entry.get("aliases")),
        ready_endpoints=_count(entry.get("readyEndpoints")),
        context_window=(_count(low), _count(high)) if _count(low) and _count(high) else None,
    )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


class ServeWatcher:
    """Polls the local ``serve``'s ``/debug/worker-sets``; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        *,
        on_change: Callable[[], None],
        interval: float = 2.0,
        timeout: float = 1.5,
        failures_to_unavailable: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = base_url.rstrip("/") + "/debug/worker-sets"
        self._on_change = on_change
        self._interval = interval
        self._timeout = timeout
        self._failures_to_unavailable = failures_to_unavailable
        self._log_limiter: LogLimiter[str] = LogLimiter(clock, 60.0)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        #: The last view read, None until the first read and while ``serve`` is unavailable.
        self.view: RouterView | None = None
        #: Why the last poll failed (kept while unavailable), for conditions and logs.
        self.error: str | None = None
        #: Polls done, answered or not.
        self.polls = 0

    @property
    def reachable(self) -> bool:
        return self.view is not None

    def start(self) -> None:
        # aiohttp's own timeout, not asyncio.timeout: see extproc.tasks on 3.11 cancellation.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        self._task = asyncio.create_task(self._run(), name="serve-state")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def poll(self) -> bool:
        """Read once; True if the view (or reachability) changed, and after the first poll."""
        first = self.polls == 0
        try:
            body = await self._fetch()
            view = parse_router_view(orjson.loads(body))
        except (TimeoutError, aiohttp.ClientError, ServeStateError, orjson.JSONDecodeError) as exc:
            self.polls += 1
            return self._failed(_describe(exc, self._timeout)) or first
        self.polls += 1
        if self.view is None:
            log.info("serve state readable url=%s worker_sets=%d", self.url, len(view.sets))
        self._failures, self.error = 0, None
        changed = view != self.view
        self.view = view
        return changed or first

    def _failed(self, error: str) -> bool:
        self._failures += 1
        self.error = error
        if self._log_limiter.allow(self.url, error.split(":", 1)[0]):
            log.warning("serve state unreadable url=%s error=%s", self.url, error)
        if self.view is not None and self._failures >= self._failures_to_unavailable:
            self.view = None
            return True
        return False

    async def _fetch(self) -> bytes:
        assert self._session is not None, "start() first"
        return await fetch_bounded(
            self._session,
            self.url,
            accept="application/json",
            max_bytes=MAX_STATE_BYTES,
            error=ServeStateError,
        )

    async def _run(self) -> None:
        while True:
            try:
                if await self.poll():
                    self._on_change()
            except Exception:
                log.exception("serve state poll failed")
            await asyncio.sleep(self._interval)


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, aiohttp.ClientError):
        return f"{type(exc).__name__}: {exc}"
    return str(exc)
