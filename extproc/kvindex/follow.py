"""Keep KV-event subscriptions and index sources in step with the catalog.

Every ready endpoint of a worker set with ``spec.kvEvents`` is a source: its PUB port (and replay
port when one resolves) is dialled, and its blocks are indexed at the set's ``kvBlockSize`` in the
namespace of the set's first model (the base model; LoRA adapters' events name their own
namespace). Endpoints that leave, or whose ports change, lose their blocks.

One task applies catalog changes in order (the catalog store notifies synchronously; the task
coalesces bursts of reloads into one sync with the latest catalog).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.addresses import join_host_port
from extproc.catalog.model import Catalog
from extproc.catalog.store import CatalogStore
from extproc.kvindex.events import Source
from extproc.kvindex.index import PrefixIndex
from extproc.kvindex.ingest import IndexIngest
from extproc.kvindex.subscriptions import KVSubscriptions, SubscriptionTarget
from extproc.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SourcePlan:
    """Where to subscribe for one source, and how to index what it sends."""

    target: SubscriptionTarget
    namespace: str
    block_size: int


def plan_sources(catalog: Catalog) -> dict[Source, SourcePlan]:
    """Every source the catalog asks for (pure): one per endpoint and data-parallel rank.

    Rank r of a pod publishes on the KV ports + r, as vLLM offsets them.
    """
    plans: dict[Source, SourcePlan] = {}
    for key in sorted(catalog.worker_sets):
        ws = catalog.worker_sets[key]
        if not ws.models:
            continue
        for endpoint in ws.endpoints:
            pub, replay = endpoint.kv_events_port, endpoint.kv_replay_port
            if pub is None or Source(endpoint.address, 0) in plans:
                continue  # the same pod listed by two sets: the set sorted first keeps it
            ip = endpoint.ip
            namespace = ws.models[0].name
            for rank in range(ws.data_parallel_size):
                target = SubscriptionTarget(
                    pub_address=f"tcp://{join_host_port(ip, pub + rank)}",
                    replay_address=None if replay is None else f"tcp://{join_host_port(ip, replay + rank)}",
                )
                plans[Source(endpoint.address, rank)] = SourcePlan(target, namespace, ws.kv_block_size)
    return plans


class KVEventsFollower:
    """Subscribes to the KV events of every source the current catalog names."""

    def __init__(
        self, store: CatalogStore, index: PrefixIndex, ingest: IndexIngest, subscriptions: KVSubscriptions
    ):
        self._store = store
        self._index = index
        self._ingest = ingest
        self._subscriptions = subscriptions
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe = store.subscribe(lambda _catalog: self._changed.set())
        self.plans: dict[Source, SourcePlan] = {}

    def start(self) -> None:
        self._changed.set()
        self._task = asyncio.create_task(self._run(), name="kv-events-follower")

    async def close(self) -> None:
        self._unsubscribe()
        await cancel_and_wait(self._task)
        self._task = None
        await self._subscriptions.close()

    async def _run(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                await self.sync(self._store.current)
            except Exception:
                # A bug here must not stop later catalogs from being followed.
                log.exception("kv subscriptions sync failed")

    async def sync(self, catalog: Catalog) -> None:
        """Make sources and subscriptions match ``catalog``."""
        plans = plan_sources(catalog)
        for source, plan in plans.items():
            self._index.add_source(source, namespace=plan.namespace, block_size=plan.block_size)
        await self._subscriptions.sync({source: plan.target for source, plan in plans.items()})
        for source in set(self.plans) - set(plans):
            self._index.drop_source(source)
            self._ingest.forget(source)
        added, removed = len(set(plans) - set(self.plans)), len(set(self.plans) - set(plans))
        if added or removed:
            log.info("kv subscriptions sources=%d added=%d removed=%d", len(plans), added, removed)
        self.plans = plans

    def targets(self) -> Mapping[Source, SourcePlan]:
        return self.plans
