"""Following one InferencePool and the Pods it selects (``serve --source kube --pool-name``).

Two watches: InferencePools in the pool's namespace, and Pods there filtered by the pool's
``matchLabels`` on the API server (``labelSelector``), so a namespace's other Pods cost nothing.
When the selector changes, the Pod watch starts over with the new one; while the pool is absent
there is no Pod watch at all. A selector that cannot be read keeps the Pod watch it had (the
catalog keeps the pool's last valid version too, with a problem saying why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from extproc.kube.client import ApiClient
from extproc.kube.reflector import Reflector, ReflectorOptions
from extproc.kube.resources import INFERENCE_POOLS, PODS
from extproc.kube.wire import RawObject
from extproc.types import WorkerSetKey

logger = logging.getLogger(__name__)


class PoolFollower:
    """The pool's object and its Pods, as the API server has them; ``run()`` as a task."""

    def __init__(
        self,
        api: ApiClient,
        namespace: str,
        name: str,
        on_change: Callable[[], None],
        *,
        options: ReflectorOptions | None = None,
    ) -> None:
        self.namespace, self.name = namespace, name
        self.key = WorkerSetKey(f"{namespace}/{name}")
        self._api = api
        self._on_change = on_change
        self._options = options
        self._wake = asyncio.Event()
        self.pools = Reflector(api, INFERENCE_POOLS, [namespace], self._pool_changed, options=options)
        #: The Pod watch for the current selector; None while the pool is absent.
        self.pods: Reflector | None = None
        self.selector: str | None = None

    @property
    def reflectors(self) -> list[Reflector]:
        return [self.pools] if self.pods is None else [self.pools, self.pods]

    @property
    def pool(self) -> RawObject | None:
        return self.pools.objects.get((self.namespace, self.name))

    @property
    def synced(self) -> bool:
        """The pools are listed, and the Pods of the pool's selector too (when there is a pool)."""
        if not self.pools.synced:
            return False
        wanted = selector_of(self.pool)
        if wanted is None:
            return self.pool is None or (self.pods is not None and self.pods.synced)
        return self.pods is not None and self.selector == wanted and self.pods.synced

    def objects(self) -> list[RawObject]:
        """The pool (when there is one) and the Pods its selector picks."""
        pool = self.pool
        pods = [] if self.pods is None else list(self.pods.objects.values())
        return pods if pool is None else [pool, *pods]

    def inputs(self) -> dict[tuple[str, str, str], object]:
        """What a build reads of these objects (see :func:`extproc.sources.kube.build_inputs`)."""
        inputs: dict[tuple[str, str, str], object] = {}
        pool = self.pool
        if pool is not None:
            meta = pool["metadata"]
            inputs["pool", self.namespace, self.name] = (
                meta.get("generation") or meta["resourceVersion"],
                meta.get("annotations"),
                meta.get("deletionTimestamp"),
            )
        for obj in [] if self.pods is None else self.pods.objects.values():
            inputs["pod", self.namespace, obj["metadata"]["name"]] = obj["metadata"]["resourceVersion"]
        return inputs

    async def run(self) -> None:
        """Follow the pool and, under its current selector, its Pods; runs until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.pools.run(), name="reflect-inferencepools")
            pods_task: asyncio.Task[None] | None = None
            try:
                while True:
                    await self._wake.wait()
                    self._wake.clear()
                    pool = self.pool
                    wanted = selector_of(pool)
                    if pool is not None and wanted is None:
                        continue  # unreadable: keep the Pods of the last good selector
                    if wanted == self.selector and (wanted is None or pods_task is not None):
                        continue
                    if pods_task is not None:
                        pods_task.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await pods_task
                        pods_task = None
                    self.selector, self.pods = wanted, None
                    if wanted is not None:
                        kind = dataclasses.replace(PODS, label_selector=wanted)
                        self.pods = Reflector(
                            self._api, kind, [self.namespace], self._on_change, options=self._options
                        )
                        pods_task = group.create_task(self.pods.run(), name="reflect-pods")
                    logger.info("inferencepool pods pool=%s selector=%s", self.key, wanted or "-")
                    self._on_change()
            finally:
                if pods_task is not None:
                    pods_task.cancel()

    def debug_state(self) -> dict[str, Any]:
        return {
            "pool": self.key,
            "found": self.pool is not None,
            "podSelector": self.selector,
            "resources": {r.resource_type.name: r.debug_state() for r in self.reflectors},
        }

    def _pool_changed(self) -> None:
        self._wake.set()
        self._on_change()


def selector_of(pool: Mapping[str, Any] | None) -> str | None:
    """``spec.selector.matchLabels`` as a ``labelSelector`` (sorted ``k=v`` pairs); None when the
    pool is absent or its selector is not a non-empty map of strings."""
    spec = pool.get("spec") if pool is not None else None
    selector = spec.get("selector") if isinstance(spec, Mapping) else None
    labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(labels, Mapping) or not labels:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) and k and "," not in v for k, v in labels.items()):
        return None
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
