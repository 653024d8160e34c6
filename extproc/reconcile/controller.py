"""``extproc reconcile``: keep every InferenceWorkerSet's ``status`` true, one writer at a time.

Reflectors mirror InferenceWorkerSets, Services, EndpointSlices and HTTPRoutes; a
:class:`~extproc.reconcile.serve_state.ServeWatcher` reads the local ``serve``; a
:class:`~extproc.reconcile.lease.LeaderElector` holds the Lease. Any change (or the resync
interval) wakes one loop that, while leading, recomputes every set's status
(:func:`~extproc.reconcile.status.compute_status`) and merge-patches ``/status`` of the sets whose
status differs from the stored one. It writes nothing else: never spec, never metadata.

Write outcomes: 404 means the set was deleted meanwhile (fine); 409 / 422 and failures to reach
the API server are logged with the object's name and retried with per-object backoff. A status
just written is used as the previous one until the watch shows it, so a fast second change does
not re-stamp transition times from a stale copy. When the server keeps a status other than the one
sent (its schema prunes a field), the set is not written again until what we compute or what is
stored changes: rewriting every pass would change nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from extproc.addresses import parse_host_port
from extproc.admin import admin_app, start_admin
from extproc.errors import KubeApiError
from extproc.kube.reflector import Reflector
from extproc.kube.resources import ENDPOINT_SLICES, HTTP_ROUTES, SERVICES, WORKER_SETS, ResourceType
from extproc.kube.retry import Backoff
from extproc.reconcile.facts import SetFacts, gather_facts
from extproc.reconcile.kube_api import KubeLeaseStore, patch_status
from extproc.reconcile.lease import LeaderElector
from extproc.reconcile.references import references_by_set
from extproc.reconcile.serve_state import ServeWatcher
from extproc.reconcile.status import RouterSide, compute_status, status_differs, status_patch
from extproc.settings import ReconcileSettings
from extproc.tasks import sleep_or_wake
from extproc.telemetry import LogLimiter

log = logging.getLogger(__name__)

#: Seconds to wait after a change before recomputing, so a burst of events costs one pass.
DEBOUNCE = 0.2
#: Seconds a just-written status stands in for the stored one while the watch catches up.
WRITTEN_TTL = 10.0
_RESOURCES = (WORKER_SETS, SERVICES, ENDPOINT_SLICES, HTTP_ROUTES)


@dataclass(slots=True)
class _Written:
    at: float
    resource_version: str | None
    status: dict[str, Any]


@dataclass(frozen=True, slots=True)
class NoOpWrite:
    """A write the server answered by keeping a status other than the one sent."""

    sent: dict[str, Any]
    kept: Any


def write_is_futile(noop: NoOpWrite | None, stored: Any, computed: dict[str, Any]) -> bool:
    """Whether writing ``computed`` would only repeat a write the server already reduced to what is
    stored (pure)."""
    return noop is not None and computed == noop.sent and stored == noop.kept


class ReconcileMetrics:
    """The sidecar's metrics, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leader = Gauge(
            "extproc_reconcile_leader", "1 while this replica holds the Lease and writes status.",
            registry=self.registry,
        )  # fmt: skip
        self.writes = Counter(
            "extproc_reconcile_status_writes_total",
            "Status patches by result: ok, not_found (set deleted), conflict, invalid, error.",
            ["result"],
            registry=self.registry,
        )
        self.serve_reachable = Gauge(
            "extproc_reconcile_serve_reachable", "1 while the local serve's /debug/worker-sets can be read.",
            registry=self.registry,
        )  # fmt: skip
        self.passes = Counter(
            "extproc_reconcile_passes_total", "Recomputations of every set's status.", registry=self.registry
        )


class Reconciler:
    """The running sidecar: :meth:`run` until ``stop`` is set."""

    def __init__(
        self,
        settings: ReconcileSettings,
        api: Any,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._api = api
        self._now = now
        self._monotonic = monotonic
        self._wake = asyncio.Event()
        namespaces = settings.namespaces
        self.reflectors: dict[ResourceType, Reflector] = {
            rt: Reflector(api, rt, namespaces, self.changed) for rt in _RESOURCES
        }
        self.serve = ServeWatcher(
            settings.serve_admin,
            on_change=self.changed,
            interval=settings.serve_poll_interval,
            timeout=settings.serve_timeout,
        )
        store = KubeLeaseStore(api, namespace=settings.lease_namespace, name=settings.lease_name)
        self.elector = LeaderElector(
            store,
            identity=settings.identity,
            on_change=lambda _leading: self.changed(),
            duration=settings.lease_duration,
            renew_interval=settings.renew_interval,
            retry_interval=settings.retry_interval,
            now=now,
            monotonic=monotonic,
        )
        store.timeout = self.elector.write_timeout
        self.metrics = ReconcileMetrics()
        self.metrics.leader.set_function(lambda: float(self.elector.is_leader))
        self.metrics.serve_reachable.set_function(lambda: float(self.serve.reachable))
        self._written: dict[str, _Written] = {}
        self._noop: dict[str, NoOpWrite] = {}
        #: Sets whose last write the server refused (409/422): backoff and when to try again.
        self._retry: dict[str, tuple[Backoff, float]] = {}
        #: After the API server did not answer a write: when the next pass may write again.
        self._outage = Backoff(1.0, 30.0)
        self._outage_until: float | None = None
        self._log_limiter: LogLimiter[str] = LogLimiter(monotonic, 60.0)
        self.admin_port = 0
        self.last_pass: float | None = None

    def changed(self) -> None:
        """Something we read changed: recompute soon."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        app = admin_app(registry=self.metrics.registry, state=self.debug_state)
        runner, self.admin_port = await start_admin(app, self.settings.admin_listen)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(r.run(), name=f"reflect-{rt.plural}")
                    for rt, r in self.reflectors.items()
                ]
                tasks.append(group.create_task(self.elector.run(), name="lease"))
                tasks.append(group.create_task(self._loop(), name="reconcile"))
                self.serve.start()
                log.info(
                    "reconciling identity=%s namespaces=%s serve=%s admin=%s:%d",
                    self.settings.identity,
                    ",".join(self.settings.namespaces or ("*",)),
                    self.settings.serve_admin,
                    parse_host_port(self.settings.admin_listen, what="--admin-listen")[0],
                    self.admin_port,
                )
                await stop.wait()
                for task in tasks:
                    task.cancel()
        finally:
            await self.elector.release()
            await self.serve.close()
            await runner.cleanup()

    def _synced(self) -> bool:
        """Everything has been read once: before that, a status would report half a picture."""
        return self.serve.polls > 0 and all(r.synced for r in self.reflectors.values())

    async def _loop(self) -> None:
        while True:
            now = self._monotonic()
            # Wake for retries still ahead; one already due was tried (or no longer needed) last pass.
            due = [at for _, at in self._retry.values() if at > now]
            if self._outage_until is not None and self._outage_until > now:
                due.append(self._outage_until)
            delay = min([self.settings.resync_interval, *(at - now for at in due)])
            await sleep_or_wake(self._wake, delay)
            await asyncio.sleep(DEBOUNCE)
            self._wake.clear()
            if not (self.elector.is_leader and self._synced()):
                continue
            try:
                await self.reconcile_once()
            except Exception:
                log.exception("reconcile pass failed")

    async def reconcile_once(self) -> int:
        """Recompute every set and write the changed ones; returns how many were written."""
        sets = self.reflectors[WORKER_SETS].objects.values()
        facts = gather_facts(
            sets,
            self.reflectors[SERVICES].objects.values(),
            self.reflectors[ENDPOINT_SLICES].objects.values(),
        )
        references = references_by_set(self.reflectors[HTTP_ROUTES].objects.values())
        view, error = self.serve.view, self.serve.error
        now = self._now()
        written = 0
        self.metrics.passes.inc()
        self.last_pass = self._monotonic()
        for key in (set(self._written) | set(self._retry) | set(self._noop)) - set(facts):
            self._written.pop(key, None)
            self._retry.pop(key, None)
            self._noop.pop(key, None)
            self._log_limiter.forget(key)
        for key in sorted(facts):
            router = RouterSide(
                reachable=view is not None,
                view=None if view is None else view.sets.get(key),
                error=error,
            )
            previous = self._previous(key, facts[key])
            status = compute_status(
                facts[key], routes=references.get(key, []), router=router, previous=previous, now=now
            )
            if not status_differs(previous, status) or not self._due(key):
                continue
            if write_is_futile(self._noop.get(key), facts[key].obj.get("status"), status):
                continue
            if not self.elector.is_leader:
                break  # leadership ended mid-pass: the new leader writes the rest
            outcome = await self._write(key, facts[key], status)
            if outcome == "unreachable":
                break  # the other writes would fail the same way: the next pass retries them
            written += outcome == "ok"
        return written

    def _previous(self, key: str, facts: SetFacts) -> Any:
        """The stored status, or the one we just wrote if the watch has not shown it yet."""
        stored = facts.obj.get("status")
        sent = self._written.get(key)
        if sent is None:
            return stored
        version = facts.obj.get("metadata", {}).get("resourceVersion")
        if (
            version == sent.resource_version
            or not status_differs(stored, sent.status)
            or self._monotonic() - sent.at > WRITTEN_TTL
        ):
            del self._written[key]
            return stored
        return sent.status

    def _due(self, key: str) -> bool:
        retry = self._retry.get(key)
        return retry is None or retry[1] <= self._monotonic()

    async def _write(self, key: str, facts: SetFacts, status: dict[str, Any]) -> str:
        """Patch one set's status; the outcome (``ok``, ``gone``, ``refused`` or ``unreachable``)."""
        namespace, name = key.split("/", 1)
        try:
            kept = await asyncio.to_thread(
                patch_status,
                self._api,
                namespace,
                name,
                status_patch(status),
                timeout=self.elector.write_timeout,
            )
        except KubeApiError as exc:
            return self._failed(key, exc)
        self.metrics.writes.labels("ok").inc()
        self._retry.pop(key, None)
        self._outage.reset()
        self._outage_until = None
        metadata = kept.get("metadata", {})
        kept_status = kept.get("status")
        if status_differs(kept_status, status):
            self._noop[key] = NoOpWrite(status, kept_status)
            if self._log_limiter.allow(key, "kept"):
                log.warning("status stored differs from what was sent worker_set=%s (CRD schema?)", key)
        else:
            self._noop.pop(key, None)
        self._written[key] = _Written(
            self._monotonic(),
            metadata.get("resourceVersion") if isinstance(metadata, dict) else None,
            status,
        )
        log.info(
            "status written worker_set=%s state=%s generation=%s",
            key,
            status.get("state"),
            facts.obj.get("metadata", {}).get("generation"),
        )
        return "ok"

    def _failed(self, key: str, exc: KubeApiError) -> str:
        if exc.status == 404:
            self.metrics.writes.labels("not_found").inc()
            log.info("worker set deleted before its status was written worker_set=%s", key)
            return "gone"
        if exc.status == 0 or exc.status >= 500:
            self.metrics.writes.labels("error").inc()
            self._outage_until = self._monotonic() + self._outage.next()
            if self._log_limiter.allow("", "unreachable"):
                log.warning("status write failed worker_set=%s error=%s", key, exc.message)
            return "unreachable"
        result = {409: "conflict", 422: "invalid"}.get(exc.status, "error")
        self.metrics.writes.labels(result).inc()
        backoff, _ = self._retry.get(key) or (Backoff(1.0, 60.0), 0.0)
        self._retry[key] = (backoff, self._monotonic() + backoff.next())
        if self._log_limiter.allow(key, result):
            log.warning("status write failed worker_set=%s result=%s error=%s", key, result, exc.message)
        return "refused"

    def debug_state(self) -> dict[str, Any]:
        return {
            "identity": self.settings.identity,
            "leader": self.elector.is_leader,
            "leaseError": self.elector.last_error,
            "serve": {"url": self.serve.url, "reachable": self.serve.reachable, "error": self.serve.error},
            "resources": {rt.name: r.debug_state() for rt, r in self.reflectors.items()},
            "retrying": sorted(self._retry),
            "writesPausedFor": None
            if self._outage_until is None
            else max(round(self._outage_until - self._monotonic(), 3), 0.0),
        }
