"""The catalog from the cluster: InferenceWorkerSets, Services and EndpointSlices as the API server has them.

Three :class:`~extproc.kube.reflector.Reflector` s mirror the objects (all namespaces, or a list);
every change marks the catalog stale, and a burst of changes (a rollout moves many endpoints at
once) is built and published once, ``debounce`` seconds after its first change. The build is
:func:`~extproc.sources.objects.compile_objects`, the same step the file source takes, so the same
objects give the same catalog from either source. Nothing is published until every resource type
has been listed once (readiness then means "we have the cluster's state"); after that, an API
server that goes away changes nothing, and routing continues on the last catalog.

A change wakes the build only if it touches what the catalog is read from (:func:`build_inputs`):
a worker set's spec (its ``generation``), labels, annotations, creation or deletion, and the
Services and EndpointSlices some worker set refers to. Status writes (the reconciler's) and the
cluster's other Services cost a comparison, not a build; their objects stay cached, so a worker
set that refers to them later sees them at once. A build parses again only the objects whose
resourceVersion moved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from extproc.catalog.model import Catalog
from extproc.catalog.resources import SERVICE_NAME_LABEL
from extproc.kube.client import ApiClient, KubeSettings, api_client
from extproc.kube.reflector import Reflector, ReflectorOptions
from extproc.kube.resources import (
    ENDPOINT_SLICES,
    INFERENCE_OBJECTIVES,
    LEGACY_INFERENCE_OBJECTIVES,
    SERVICES,
    WORKER_SETS,
)
from extproc.kube.wire import RawObject
from extproc.settings import SourceSettings
from extproc.sources.file import ReloadOutcome
from extproc.sources.objects import Known, ObjectKey, Parsed, ProblemLog, VersionKey, compile_objects
from extproc.sources.pool import PoolFollower

logger = logging.getLogger(__name__)

#: What the catalog is built from (InferenceObjectives only where the cluster has their CRD).
RESOURCE_TYPES = (WORKER_SETS, SERVICES, ENDPOINT_SLICES, INFERENCE_OBJECTIVES, LEGACY_INFERENCE_OBJECTIVES)


class KubeSource:
    """Follows the cluster (``watch``) and publishes a catalog whenever what routing needs changes.

    ``builds`` counts catalogs built, ``published`` those that differed from the last one, and
    ``on_reload`` receives ``"ok"`` / ``"unchanged"`` / ``"failed"`` per build, as from the file
    source. Credentials are loaded on construction, so a bad kubeconfig fails ``serve`` at once.
    """

    def __init__(
        self,
        settings: SourceSettings,
        *,
        on_reload: Callable[[ReloadOutcome], None] | None = None,
        api: ApiClient | None = None,
        options: ReflectorOptions | None = None,
        debounce: float = 0.05,
    ) -> None:
        self.namespaces = settings.namespaces
        self.debounce = debounce
        self._on_reload = on_reload
        self._owns_client = api is None
        self.api = api if api is not None else api_client(KubeSettings(kubeconfig=settings.kubeconfig))
        self.reflectors = [
            Reflector(self.api, kind, settings.namespaces, self._changed, options=options)
            for kind in RESOURCE_TYPES
        ]
        #: The InferencePool of ``--pool-name`` and its Pods; None: worker sets only.
        self.pool: PoolFollower | None = None
        if settings.pool_name is not None:
            self.pool = PoolFollower(
                self.api, settings.pool_namespace, settings.pool_name, self._changed, options=options
            )
        self.builds = self.published = self.builds_failed = 0
        #: Changes that left what the catalog is read from as it was (no build).
        self.skipped = 0
        #: Catalogs that ``publish`` raised on (a bug); watching goes on.
        self.publish_failed = 0
        #: A build that failed (a bug); the previous catalog stays in use.
        self.build_error: str | None = None
        self._stale = asyncio.Event()
        self._valid: dict[ObjectKey, Known] = {}
        self._parsed: dict[VersionKey, Parsed] = {}
        self._inputs: dict[tuple[str, str, str], object] | None = None
        self._catalog: Catalog | None = None
        self._problems = ProblemLog(logger, "source=kube")

    @property
    def synced(self) -> bool:
        """Every resource type has been listed at least once."""
        return all(r.synced for r in self.reflectors) and (self.pool is None or self.pool.synced)

    @property
    def last_error(self) -> str | None:
        """What currently keeps the source from being current (API errors first), or None."""
        reflectors = self.reflectors if self.pool is None else [*self.reflectors, *self.pool.reflectors]
        return next((r.last_error for r in reflectors if r.last_error), None) or self.build_error

    async def watch(self, publish: Callable[[Catalog], None]) -> None:
        """Follow the cluster and publish each new catalog; runs until cancelled."""
        try:
            async with asyncio.TaskGroup() as group:
                for reflector in self.reflectors:
                    group.create_task(reflector.run(), name=f"reflect-{reflector.resource_type.plural}")
                if self.pool is not None:
                    group.create_task(self.pool.run(), name="inferencepool")
                group.create_task(self._publish_changes(publish), name="kube-catalog")
        finally:
            if self._owns_client:
                self.api.close()  # type: ignore[no-untyped-call]

    def debug_state(self) -> dict[str, Any]:
        """For ``/debug/state``: per resource type, synced, last error, objects and resourceVersion."""
        return {
            "kind": "kube",
            "namespaces": None if self.namespaces is None else list(self.namespaces),
            "synced": self.synced,
            "lastError": self.last_error,
            "builds": self.builds,
            "published": self.published,
            "skipped": self.skipped,
            "publishFailed": self.publish_failed,
            "resources": {r.resource_type.name: r.debug_state() for r in self.reflectors},
            "inferencePool": None if self.pool is None else self.pool.debug_state(),
        }

    def _changed(self) -> None:
        self._stale.set()

    async def _publish_changes(self, publish: Callable[[Catalog], None]) -> None:
        while True:
            await self._stale.wait()
            await asyncio.sleep(self.debounce)  # let the rest of a burst arrive
            self._stale.clear()
            if not self.synced:
                continue
            catalog = self._build()
            if catalog is None:
                continue
            try:
                publish(catalog)
            except Exception:
                # A bug in whoever takes the catalog must not end the watch (and with it every
                # later update) while serve stays ready: report it and keep following the cluster.
                self.publish_failed += 1
                logger.exception(
                    "publishing the catalog failed (bug) source=kube worker_sets=%d failures=%d",
                    len(catalog.worker_sets),
                    self.publish_failed,
                )

    def _build(self) -> Catalog | None:
        """The catalog of the objects now known; None if it equals the last one or the build failed."""
        worker_sets, services, slices, objectives, legacy = (r.objects for r in self.reflectors)
        objects = [obj for reflector in self.reflectors for obj in reflector.objects.values()]
        pool = self.pool
        try:
            inputs = build_inputs(
                worker_sets.values(),
                services.values(),
                slices.values(),
                [*objectives.values(), *legacy.values()],
            )
            if pool is not None:
                objects += pool.objects()
                inputs.update(pool.inputs())
            if inputs == self._inputs:
                self.skipped += 1
                return None
            picks_for = None if pool is None else pool.key
            compiled = compile_objects(objects, self._valid, self._parsed, picks_for=picks_for)
        except Exception as exc:
            # A validation gap is a bug, but it must not stop routing: keep the current catalog.
            logger.exception("catalog build failed (bug) source=kube")
            self.builds_failed += 1
            self.build_error = f"internal error while building the catalog: {exc!r}"
            self._notify("failed")
            return None
        self.builds += 1
        self.build_error = None
        self._valid, self._parsed, self._inputs = compiled.valid, compiled.parsed, inputs
        if compiled.catalog == self._catalog:
            self._notify("unchanged")
            return None
        self._catalog = compiled.catalog
        self.published += 1
        count = self._problems.report(compiled.catalog)
        logger.info(
            "catalog built source=kube objects=%d worker_sets=%d routes=%d problems=%d",
            len(objects),
            len(compiled.catalog.worker_sets),
            len(compiled.catalog.routes),
            count,
        )
        self._notify("ok")
        return compiled.catalog

    def _notify(self, outcome: ReloadOutcome) -> None:
        if self._on_reload is not None:
            self._on_reload(outcome)


def build_inputs(
    worker_sets: Iterable[RawObject],
    services: Iterable[RawObject],
    slices: Iterable[RawObject],
    objectives: Iterable[RawObject] = (),
) -> dict[tuple[str, str, str], object]:
    """What a build reads, per object: equal inputs give an equal catalog, so no build is needed.

    A worker set or an InferenceObjective counts by ``generation`` (the API server moves it on
    spec changes, not on status writes) and the metadata the parser reads; a Service or
    EndpointSlice by its resourceVersion, and only if some worker set in its namespace refers to it.
    """
    inputs: dict[tuple[str, str, str], object] = {}
    referenced: set[tuple[str, str]] = set()
    for obj in worker_sets:
        meta = obj["metadata"]
        namespace, name = meta.get("namespace", ""), meta["name"]
        inputs["ws", namespace, name] = (
            meta.get("generation") or meta["resourceVersion"],
            meta.get("labels"),
            meta.get("annotations"),
            meta.get("creationTimestamp"),
            meta.get("deletionTimestamp"),
        )
        spec = obj.get("spec")
        ref = spec.get("serviceRef") if isinstance(spec, Mapping) else None
        if isinstance(ref, Mapping) and isinstance(ref.get("name"), str):
            referenced.add((namespace, ref["name"]))
    for obj in objectives:
        meta = obj["metadata"]
        inputs[obj.get("apiVersion", "objective"), meta.get("namespace", ""), meta["name"]] = (
            meta.get("generation") or meta["resourceVersion"],
            meta.get("deletionTimestamp"),
        )
    for kind, objects in (("svc", services), ("slice", slices)):
        for obj in objects:
            meta = obj["metadata"]
            namespace = meta.get("namespace", "")
            service = meta["name"] if kind == "svc" else _service_label(meta)
            if (namespace, service) in referenced:
                inputs[kind, namespace, meta["name"]] = meta["resourceVersion"]
    return inputs


def _service_label(meta: Mapping[str, Any]) -> object:
    labels = meta.get("labels")
    return labels.get(SERVICE_NAME_LABEL) if isinstance(labels, Mapping) else None
