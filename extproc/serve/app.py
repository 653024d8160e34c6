"""Wiring for ``extproc serve``: source -> catalog store -> request control -> gRPC + admin servers.

:class:`Server` starts and stops everything and owns every background task, so tests and the
demo run the real thing in-process; :func:`serve` is the CLI's blocking entry point.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import sys
import time
from typing import Any

from extproc import __version__
from extproc.addresses import parse_host_port
from extproc.admin import AdminRunner, admin_app, start_admin
from extproc.catalog.discovered import apply_discovery
from extproc.catalog.model import Catalog
from extproc.catalog.store import CatalogStore, take_apart
from extproc.control.flow import FlowMetrics
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl
from extproc.engines.discovery import ModelDiscovery
from extproc.engines.scraper import EngineScraper
from extproc.kube.client import ApiClient
from extproc.peers.curve import read_key
from extproc.protocol.budget import BodyBudget
from extproc.protocol.listener import ExtProcListener
from extproc.protocol.stream import StreamOptions
from extproc.scheduling.calibration import Calibration, fitted_profiles
from extproc.scheduling.engine_signals import EngineSignals
from extproc.scheduling.hooks import calibrate, remember_affinity
from extproc.scheduling.policy import Policy
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.profiles import DEFAULT_PROFILE, ProfileStore, profile_lookup, render_profiles
from extproc.scheduling.registry import DEFAULT_POLICY, build_policy
from extproc.scheduling.scheduler import DecisionHook, Scheduler
from extproc.serve.collectors import CalibrationCollector, CatalogCollector, UnknownProfileCollector
from extproc.serve.loop_lag import watch_loop_lag
from extproc.serve.memory import GcWatch, bound_young_generation, freeze_startup_heap, trim_forever
from extproc.serve.observed import observe_worker_sets
from extproc.serve.peering import Peering
from extproc.serve.prefix_routing import PrefixRouting
from extproc.settings import ServeSettings
from extproc.sources.file import FileSource, ReloadOutcome
from extproc.sources.kube import KubeSource
from extproc.tasks import StartStop, cancel_and_wait
from extproc.telemetry import Metrics
from extproc.types import EndpointAddress, WorkerSetKey

log = logging.getLogger(__name__)

#: The GIL switch interval while prompts are tokenized in threads (seconds; Python's default: 0.005).
TOKENIZING_SWITCH_INTERVAL = 0.0002


class Server(StartStop):
    """A running ``serve``: call :meth:`start`, then :meth:`stop` (or use ``async with``)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.store = CatalogStore()
        self.load = LoadView()
        self.metrics = Metrics()
        self.source: FileSource | KubeSource = (
            KubeSource(settings.source, on_reload=self._count_reload)
            if settings.source.kind == "kube"
            else FileSource(settings.source, on_reload=self._count_reload)
        )
        self.prefix = PrefixRouting(settings.prefix, self.store)
        self.calibration = Calibration()
        self.scraper = EngineScraper(
            self.store,
            interval=settings.scrape_interval or 1.0,
            on_unreachable=self.prefix.endpoint_gone,
            on_signals=self._scraped,
        )
        #: What the source declares; the store holds it with what model discovery learned applied.
        self._declared = Catalog()
        self.discovery = ModelDiscovery(declared=lambda: self._declared, on_change=self._republish)
        self.profiles = ProfileStore(settings.profiles)
        self.profiles.load()
        scraping = settings.scrape_interval > 0
        policy = self._policy(settings.policy or DEFAULT_POLICY)
        hooks: list[DecisionHook] = [remember_affinity(self.prefix.matcher)]
        if self._calibrating:
            hooks.append(calibrate(self.calibration))
        self.scheduler = Scheduler(
            self.load,
            policy,
            max_fallbacks=settings.max_fallbacks,
            rng=random.Random(settings.seed),
            prefix=self.prefix.matcher,
            signals=self.scraper.usable if scraping else None,
            reachable=self.scraper.reachable if scraping else None,
            hooks=hooks,
            candidates=settings.candidates,
        )
        self.store.subscribe(self._prune_load_order)
        self.control = RequestControl(
            catalog=lambda: self.store.current,
            scheduler=self.scheduler,
            load=self.load,
            # Without scrapes nothing would notice the endpoint come back: it is not routed around.
            on_unreachable=self.scraper.connection_failed if scraping else None,
            on_retried_away=self.scraper.retried_away if scraping else None,
            flow=settings.flow,
            flow_metrics=FlowMetrics(self.metrics.registry),
        )
        # Room may appear with a scrape or a new catalog (a lease's end wakes the queues itself).
        self.store.subscribe(lambda _catalog: self.control.flow.wake())
        self.budget = BodyBudget(settings.max_buffered_bytes)
        self.stream_options = StreamOptions(settings.max_body_bytes, self.budget, settings.decision_headers)
        # This replica's own requests: peers' leases count in decisions, not in its in-flight gauge.
        self.metrics.registry.register(
            CatalogCollector(lambda: self.store.current, lambda: self.load.snapshot(self.control.owner))
        )
        self.peering = (
            None
            if settings.peer_listen is None
            else Peering(
                settings.peer_listen,
                settings.peers,
                self.control,
                self.metrics.registry,
                service=self._peer_service(),
                approx=self.prefix.approx,
                worker=settings.peer_worker,
                fanout=settings.peer_fanout,
                curve=None if settings.peer_key_file is None else read_key(settings.peer_key_file),
            )
        )
        self.metrics.buffered_bytes.set_function(lambda: self.budget.held)
        self.metrics.registry.register(self.prefix.collector())
        self.grpc_port = 0
        self.admin_port = 0
        self._grpc: ExtProcListener | None = None
        self._admin: AdminRunner | None = None
        self._watch: asyncio.Task[None] | None = None
        self._profile_poll: asyncio.Task[None] | None = None
        self._loop_lag: asyncio.Task[None] | None = None
        self._trim: asyncio.Task[None] | None = None
        self._young: asyncio.Task[None] | None = None
        self._gc_watch: GcWatch | None = None
        self._froze_heap = False
        #: The GIL switch interval before start changed it (restored by stop).
        self._switch_interval: float | None = None
        self._started = time.time()
        #: Set by :meth:`drain`: health answers NOT_SERVING while streams are still served.
        self.draining = False
        #: Threads freeing replaced catalogs (held so their tasks are not collected mid-way).
        self._releasing: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Load the catalog (failing loudly if a file cannot be read), then open both ports.

        The cluster source publishes once it has listed everything; until then serve is not ready.
        """
        if isinstance(self.source, FileSource):
            self._declared = await asyncio.to_thread(self.source.load)
            self._republish()
        try:
            if self.peering is not None:
                self.peering.start()
            await self._start_grpc()
            await self._start_admin()
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.create_task(self.source.watch(self._publish), name="catalog-source")
        self._loop_lag = asyncio.create_task(watch_loop_lag(self.metrics.loop_lag), name="loop-lag")
        self._gc_watch = GcWatch(self.metrics.gc_pause_seconds)
        self._gc_watch.install()
        self._young = asyncio.create_task(
            bound_young_generation(self.metrics.gc_young_bounded), name="gc-young"
        )
        if self.settings.malloc_trim_interval > 0:
            self._trim = asyncio.create_task(
                trim_forever(
                    self.settings.malloc_trim_interval,
                    self.metrics.malloc_trimmed,
                    self.metrics.malloc_trim_seconds,
                ),
                name="malloc-trim",
            )
        pool = self.prefix.tokenize_pool
        if pool is not None and not pool.in_processes:
            # A tokenizing thread rendering a template holds the GIL for up to the switch interval
            # (5 ms by default) before the loop gets it back; every decision waits that long.
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(TOKENIZING_SWITCH_INTERVAL)
        self.prefix.start()
        self.discovery.start()
        if self.settings.scrape_interval > 0:
            self.scraper.start()
        if self.settings.profiles is not None:
            self._profile_poll = asyncio.create_task(self._poll_profiles(), name="profiles")
        log.debug("startup heap frozen objects=%d", freeze_startup_heap())
        self._froze_heap = True
        catalog = self.store.current
        log.info(
            "serving grpc=%s:%d admin=%s:%d worker_sets=%d models=%d",
            parse_host_port(self.settings.listen, what="--listen")[0],
            self.grpc_port,
            parse_host_port(self.settings.admin_listen, what="--admin-listen")[0],
            self.admin_port,
            len(catalog.worker_sets),
            len(catalog.routes),
        )

    def _peer_service(self) -> tuple[ApiClient, str] | None:
        """The API client and ``--peer-service`` to find peers with (the catalog's client)."""
        service = self.settings.peer_service
        if service is None or not isinstance(self.source, KubeSource):
            return None
        return self.source.api, service

    @property
    def _calibrating(self) -> bool:
        return self.settings.calibrate and self.settings.scrape_interval > 0

    def _policy(self, name: str) -> Policy:
        profile_of = profile_lookup(self.profiles, lambda: self.store.current)
        if self._calibrating:
            profile_of = self.calibration.profile_of(profile_of)
        policy = build_policy(name, profile_of=profile_of)
        if isinstance(policy, PredictedTTFT):
            if self._calibrating:
                self.metrics.registry.register(CalibrationCollector(self.calibration))
            # Only a policy that reads profiles can be misled by a worker set naming an unknown one.
            self.metrics.registry.register(
                UnknownProfileCollector(lambda: self.store.current, lambda p: self.profiles.resolve(p)[1])
            )
        return policy

    def _scraped(self, address: EndpointAddress, signals: EngineSignals) -> None:
        self.calibration.scraped(address, signals)
        self.load.engine_queue(address, (signals.running or 0) + (signals.waiting or 0))
        self.control.flow.wake()

    def _prune_load_order(self, catalog: Catalog) -> None:
        self.load.keep_endpoints({e.address for ws in catalog.worker_sets.values() for e in ws.endpoints})

    def _republish(self) -> None:
        """Publish the declared catalog with the models endpoints report (Endpoint discovery mode)."""
        retired = [self.store.current]
        self.store.publish(apply_discovery(self._declared, self.discovery.results()))
        self._release(retired)

    def _release(self, retired: list[Catalog]) -> None:
        """Free replaced catalogs in a worker thread: a large one takes tens of ms to free."""
        task = asyncio.create_task(asyncio.to_thread(take_apart, retired), name="catalog-release")
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _poll_profiles(self) -> None:
        """Hot reload: an edit of the profiles file takes effect within a second."""
        while True:
            await asyncio.sleep(1.0)
            if await asyncio.to_thread(self.profiles.poll):
                log.info("profiles reloaded names=%s", ",".join(sorted(self.profiles.profiles)))

    def _count_reload(self, outcome: ReloadOutcome) -> None:
        if outcome != "unchanged":
            self.metrics.source_reloads.labels(outcome).inc()

    def _publish(self, catalog: Catalog) -> None:
        retired = [self._declared]
        self._declared = catalog
        self._republish()
        self._release(retired)
        self.discovery.refresh()
        log.info(
            "catalog reloaded worker_sets=%d models=%d problems=%d conflicts=%d",
            len(catalog.worker_sets),
            len(catalog.routes),
            len(catalog.problems),
            len(catalog.conflicts),
        )

    async def _start_grpc(self) -> None:
        self._grpc = await ExtProcListener.start(
            reuse_port=self.settings.reuse_port,
            listen=self.settings.listen,
            router=self.control,
            metrics=self.metrics,
            options=self.stream_options,
            ready=self.ready,
        )
        self.grpc_port = self._grpc.port

    async def _start_admin(self) -> None:
        app = admin_app(
            registry=self.metrics.registry,
            state=self.debug_state,
            ready=self.ready,
            worker_sets=self.worker_sets_state,
            profiles=self.fitted_profiles,
        )
        self._admin, self.admin_port = await start_admin(app, self.settings.admin_listen)

    def worker_sets_state(self) -> dict[str, Any]:
        """What ``/debug/worker-sets`` shows (the reconciler's input): each set as the router sees it."""
        return observe_worker_sets(
            self.store.current,
            self.prefix.subscriptions.stats(),
            profile_known=lambda name: self.profiles.resolve(name)[1],
            block_size_mismatch=self.prefix.index.block_size_mismatch,
            engine_problems=self.scraper.kind_problems() if self.settings.scrape_interval > 0 else None,
        )

    def fitted_profiles(self) -> str:
        """What ``/debug/profiles`` shows: the calibrated profiles as a ``--profiles`` file."""
        catalog = self.store.current

        def profile_name(key: WorkerSetKey) -> str:
            worker_set = catalog.worker_sets.get(key)
            return worker_set.profile if worker_set is not None and worker_set.profile else DEFAULT_PROFILE

        profiles, comments = fitted_profiles(self.calibration.fits, profile_name)
        if not profiles:
            return "# nothing calibrated yet (needs predicted-ttft, --calibrate, scraping and traffic)\n"
        return render_profiles(profiles, comments)

    def debug_state(self) -> dict[str, Any]:
        """What ``/debug/state`` shows: the catalog, in-flight counts, and who we are."""
        return {
            "version": __version__,
            "startedAt": self._started,
            "source": self.source.debug_state(),
            "catalogGeneration": self.store.generation,
            "catalog": self.store.current.to_debug(),
            "inflight": dict(sorted(self.load.snapshot(self.control.owner).items())),
            "peers": [] if self.peering is None else self.peering.debug_state(),
            "leaseHandover": self.control.handover.debug_state(),
            "flowControl": self.control.flow.debug_state(),
            "prefix": self.prefix.debug_state(),
            "policy": self.scheduler.policy.name,
            "modelDiscovery": self.discovery.debug_state(),
            "profiles": {
                "file": None if self.settings.profiles is None else str(self.settings.profiles),
                "error": self.profiles.error,
                "profiles": {name: p.to_debug() for name, p in sorted(self.profiles.profiles.items())},
                "calibrated": self.calibration.debug_state(),
            },
            "engines": self.scraper.debug_state() if self.settings.scrape_interval > 0 else {},
            "workerSetStatus": self.worker_sets_state(),
        }

    def ready(self) -> bool:
        """Ready for new streams: the catalog has loaded and no drain has begun."""
        return self.store.loaded and not self.draining

    async def drain(self) -> None:
        """The first step of a graceful stop (SIGTERM): report NOT_SERVING at once, but keep serving
        new streams for ``drain_seconds`` while gateways' health checks and Kubernetes move traffic to
        other replicas; refusing them at once would turn each into a 500 at the gateway."""
        self.draining = True
        log.info(
            "draining seconds=%g (health NOT_SERVING, new streams still served)", self.settings.drain_seconds
        )
        await asyncio.sleep(self.settings.drain_seconds)

    async def stop(self) -> None:
        """Stop taking streams, let open ones finish for ``drain_seconds``, then close."""
        for task in (self._watch, self._profile_poll, self._loop_lag, self._trim, self._young):
            await cancel_and_wait(task)
        if self.peering is not None:
            await self.peering.stop()
        if self._gc_watch is not None:
            self._gc_watch.uninstall()
        if self._froze_heap:  # for a serve run inside another program (tests): leave its heap as found
            gc.unfreeze()
            self._froze_heap = False
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        if self._grpc is not None:
            await self._grpc.stop(grace=self.settings.drain_seconds)
        if self._admin is not None:
            await self._admin.cleanup()
        await self.prefix.close()
        await self.scraper.close()
        await self.discovery.close()


async def serve(settings: ServeSettings, *, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set, then drain and stop (a second signal exits at once, see the CLI)."""
    async with Server(settings) as server:
        await stop.wait()
        await server.drain()
