"""Mirror one resource type of the API server in memory: list, then watch, for ever.

A :class:`Reflector` follows one :class:`~extproc.kube.resources.ResourceType` in all namespaces
or in a list of them (one list + watch per namespace, each with its own resourceVersion). It
lists with pagination, watches from the list's resourceVersion with bookmarks and a server-side
timeout, resumes each new watch where the last one stopped, lists again on 410 Gone or after an
event too large to read (replacing what it knew at once), and backs off with jitter on other
errors while keeping the last known objects, so that whoever reads them keeps working while the
API server is away.

Threads: the ``kubernetes`` client blocks, so each list or watch request runs in a short-lived
daemon thread (:mod:`extproc.kube.transfer`) that only does I/O and decoding and hands every
event to the event loop with ``call_soon_threadsafe``; the cache (:mod:`extproc.kube.cache`)
changes on the loop only, and ``on_change`` is called there after each change. Cancelling
:meth:`run` shuts the open response's socket, so a blocked read ends at once and no thread
outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s_client

from extproc.errors import KubeApiError
from extproc.kube.cache import ObjectCache, ObjectKey
from extproc.kube.resources import ResourceType
from extproc.kube.retry import Backoff, after_failure, after_watch
from extproc.kube.transfer import Delivery, in_thread, list_all, watch
from extproc.kube.wire import Oversized, RawObject

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReflectorOptions:
    """Timings and bounds; seconds and bytes."""

    #: Server-side length of one watch (``timeoutSeconds``); each lasts between this and twice
    #: this, at random, as client-go does, so that replicas do not all watch again at once. 300 s.
    watch_timeout: float = 300.0
    #: Objects per list page (``limit``). Default 250.
    page_size: int = 250
    #: A watch event larger than this is skipped with an error logged, and the watch ends so that a
    #: list (whose pages have their own cap) shows what it hid: a lost DELETED would leave the
    #: object in the cache for ever. etcd refuses objects over 1.5 MiB, so 4 MiB leaves room for JSON.
    max_event_bytes: int = 4 * 1024 * 1024
    #: A list page larger than this fails the list (and is retried with backoff). Default 256 MiB.
    max_page_bytes: int = 256 * 1024 * 1024
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    #: How often an optional resource type that is not served (404) is looked for again. 60 s.
    unavailable_retry: float = 60.0
    connect_timeout: float = 5.0
    #: Longest wait for bytes of a list answer. A watch waits its timeout plus ``read_margin``.
    list_read_timeout: float = 60.0
    read_margin: float = 15.0
    #: On cancel, how long to wait for a request that has not answered yet to give up its thread.
    stop_grace: float = 2.0

    def __post_init__(self) -> None:
        if self.watch_timeout < 1:
            raise ValueError(f"watch_timeout must be at least 1 s, got {self.watch_timeout}")
        if self.page_size < 1 or self.max_event_bytes < 1 or self.max_page_bytes < 1:
            raise ValueError("page_size, max_event_bytes and max_page_bytes must be positive")


@dataclass(slots=True)
class _Scope:
    """One namespace (None: all namespaces) followed by one list + watch."""

    namespace: str | None
    backoff: Backoff
    cache: ObjectCache = field(default_factory=ObjectCache)
    synced: bool = False
    available: bool = True
    last_error: str | None = None
    needs_list: bool = True
    gone_before: bool = False
    #: Events and bookmarks the current watch has handed over.
    delivered: int = 0

    @property
    def label(self) -> str:
        return self.namespace if self.namespace is not None else "*"


class Reflector:
    """Follows one resource type; read ``objects`` on the event loop, run ``run()`` as a task.

    Counters for tests and ``/debug/state``: ``lists`` (complete lists, initial ones included),
    ``watches`` (watch requests the server accepted), ``events`` (changes applied), ``oversized``
    (events skipped for size), ``errors`` (failed lists or watches).
    """

    def __init__(
        self,
        api_client: k8s_client.ApiClient,
        resource_type: ResourceType,
        namespaces: Sequence[str] | None,
        on_change: Callable[[], None],
        *,
        options: ReflectorOptions | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.api_client = api_client
        self.resource_type = resource_type
        self.on_change = on_change
        self.options = options or ReflectorOptions()
        self._rng = rng or random.Random()
        if namespaces is not None and not namespaces:
            raise ValueError("namespaces: give at least one, or None for all namespaces")
        scopes: list[str | None] = [None] if namespaces is None else [*sorted(set(namespaces))]
        opts = self.options
        self._scopes = [
            _Scope(ns, Backoff(opts.backoff_initial, opts.backoff_max, rng=self._rng)) for ns in scopes
        ]
        self.lists = self.watches = self.events = self.oversized = self.errors = 0

    @property
    def objects(self) -> Mapping[ObjectKey, RawObject]:
        """(namespace, name) -> the object as ``kubectl get -o json`` shows it. Read-only."""
        if len(self._scopes) == 1:
            return self._scopes[0].cache.objects
        # Scopes are distinct namespaces, so their keys never collide.
        return ChainMap(*(scope.cache.objects for scope in self._scopes))

    @property
    def synced(self) -> bool:
        """Every namespace has been listed once (an unavailable optional type counts: it has none)."""
        return all(scope.synced for scope in self._scopes)

    @property
    def available(self) -> bool:
        """False while the API server does not serve this (optional) resource type."""
        return all(scope.available for scope in self._scopes)

    @property
    def last_error(self) -> str | None:
        """What currently keeps a namespace from being current, or None."""
        return next((s.last_error for s in self._scopes if s.last_error is not None), None)

    def debug_state(self) -> dict[str, Any]:
        """For ``/debug/state``: sync state, counts and the resourceVersion per namespace."""
        return {
            "resource": self.resource_type.name,
            "synced": self.synced,
            "available": self.available,
            "lastError": self.last_error,
            "objects": sum(len(scope.cache.objects) for scope in self._scopes),
            "resourceVersion": {scope.label: scope.cache.resource_version for scope in self._scopes},
            "lists": self.lists,
            "watches": self.watches,
            "events": self.events,
            "oversized": self.oversized,
            "errors": self.errors,
        }

    async def run(self) -> None:
        """List and watch every namespace until cancelled."""
        if len(self._scopes) == 1:
            await self._follow(self._scopes[0])
            return
        async with asyncio.TaskGroup() as group:
            for scope in self._scopes:
                group.create_task(
                    self._follow(scope), name=f"reflect-{self.resource_type.plural}-{scope.label}"
                )

    async def _follow(self, scope: _Scope) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if scope.needs_list:
                    await self._list(scope)
                started = loop.time()
                scope.delivered = 0
                await self._watch(scope)
                delay = after_watch(scope.backoff, delivered=scope.delivered, lasted=loop.time() - started)
                if delay > 0:
                    await asyncio.sleep(delay)
            except KubeApiError as exc:
                await self._after(scope, exc)
            except Exception as exc:
                # A bug here must not stop following the cluster: report it, then retry like an error.
                log.exception("kube reflector failed (bug) resource=%s", self.resource_type.name)
                await self._after(scope, KubeApiError(0, f"internal error: {exc!r}"))

    async def _after(self, scope: _Scope, error: KubeApiError) -> None:
        step = after_failure(
            error,
            self.resource_type,
            scope.backoff,
            can_resume=bool(scope.cache.resource_version),
            gone_before=scope.gone_before,
            unavailable_retry=self.options.unavailable_retry,
        )
        scope.gone_before = error.status == 410
        scope.needs_list = scope.needs_list or step.relist
        where = f"resource={self.resource_type.name} namespace={scope.label}"
        if not step.available:
            if scope.available or not scope.synced:
                log.info("kube resource not served; looking again every %.0fs %s", step.delay, where)
            scope.available, scope.synced = False, True
            scope.last_error = None
            if scope.cache.clear():
                self.on_change()
        elif step.error is None:
            log.info("kube resourceVersion expired, listing again %s error=%r", where, error.message)
        else:
            self.errors += 1
            if step.error != scope.last_error:
                log.warning("kube list/watch failed, retrying with backoff %s error=%r", where, step.error)
            scope.last_error = step.error
        if step.delay > 0:
            await asyncio.sleep(step.delay)

    async def _list(self, scope: _Scope) -> None:
        opts = self.options
        items, version = await in_thread(
            lambda call: list_all(
                self.api_client,
                self.resource_type,
                scope.namespace,
                call,
                page_size=opts.page_size,
                max_page_bytes=opts.max_page_bytes,
                timeout=(opts.connect_timeout, opts.list_read_timeout),
            ),
            name=self._thread_name(scope),
            stop_grace=opts.stop_grace,
        )
        changed = scope.cache.replace(items, version)
        first = not scope.synced
        scope.synced, scope.available, scope.needs_list, scope.gone_before = True, True, False, False
        self.lists += 1
        self._recovered(scope)
        log.info(
            "kube list resource=%s namespace=%s objects=%d resourceVersion=%s",
            self.resource_type.name,
            scope.label,
            len(items),
            version,
        )
        if changed or first:
            self.on_change()

    async def _watch(self, scope: _Scope) -> None:
        """One watch from the cache's resourceVersion, for ``watch_timeout`` to twice that."""
        opts = self.options
        version = scope.cache.resource_version
        seconds = int(opts.watch_timeout * (1.0 + self._rng.random()))
        loop = asyncio.get_running_loop()

        def deliver(item: Delivery) -> None:
            loop.call_soon_threadsafe(self._deliver, scope, item)

        await in_thread(
            lambda call: watch(
                self.api_client,
                self.resource_type,
                scope.namespace,
                call,
                deliver,
                version=version,
                seconds=seconds,
                max_event_bytes=opts.max_event_bytes,
                timeout=(opts.connect_timeout, seconds + opts.read_margin),
            ),
            name=self._thread_name(scope),
            stop_grace=opts.stop_grace,
        )

    def _thread_name(self, scope: _Scope) -> str:
        return f"kube-{self.resource_type.plural}-{scope.label}"

    def _deliver(self, scope: _Scope, item: Delivery) -> None:
        """On the loop: None = the watch was accepted; else an event or a skipped oversized one."""
        if item is None:
            self.watches += 1
            scope.gone_before = False
            self._recovered(scope)
            return
        scope.delivered += 1
        if isinstance(item, Oversized):
            self.oversized += 1
            scope.needs_list = True  # the watch ends here; a list shows what the event held
            log.error(
                "kube watch event skipped, listing again: %d bytes is over the %d-byte cap "
                "resource=%s namespace=%s",
                item.size,
                self.options.max_event_bytes,
                self.resource_type.name,
                scope.label,
            )
        elif scope.cache.apply(item):
            self.events += 1
            self.on_change()

    def _recovered(self, scope: _Scope) -> None:
        if scope.last_error is not None:
            log.info(
                "kube list/watch working again resource=%s namespace=%s previous_error=%r",
                self.resource_type.name,
                scope.label,
                scope.last_error,
            )
            scope.last_error = None
