"""The running demo: engines, catalog file, router and Envoy, started in order and stopped in reverse."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml, kv_ports_of
from extproc.demo.options import HOST, DemoError, DemoOptions, DemoSet
from extproc.demo.view import (
    EndpointRow,
    EngineLine,
    Intro,
    ModelLine,
    PrefixView,
    Snapshot,
    TrafficStats,
    render_intro,
)
from extproc.errors import ConfigError
from extproc.gateway.config import load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess
from extproc.serve.app import Server
from extproc.settings import PrefixSettings, ServeSettings, SourceSettings, TokenizerSpec
from extproc.sim.fleet import SimFleet
from extproc.sim.server import SimServer
from extproc.telemetry import Metrics
from extproc.tokenize.registry import SHIPPED_TOKENIZER
from extproc.types import EndpointAddress

#: The whole chain must answer within this after Envoy is LIVE, or something is miswired.
_SELF_CHECK_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Engine:
    """One running simulated engine and where it publishes KV events.

    The event endpoints are copied at start because a stopped :class:`SimServer` forgets its ranks,
    and a test wants to check afterwards that those ports were closed too.
    """

    worker_set: DemoSet
    server: SimServer
    kv_events: tuple[str, ...]
    kv_replay: tuple[str, ...]

    @property
    def address(self) -> str:
        return self.server.address

    def kv_ports(self) -> tuple[int, int | None]:
        """Rank 0's (PUB port, replay port): what the catalog declares for this endpoint."""
        return kv_ports_of(self.kv_events[0], self.kv_replay[0] or None)


class Demo:
    """Engines, catalog file, router and Envoy, started in that order and stopped in reverse."""

    def __init__(self, options: DemoOptions) -> None:
        self.options = options
        self.url = f"http://{HOST}:{options.port}"
        self.sets = options.sets()
        self.engines: list[Engine] = []
        self.server: Server | None = None
        self.envoy: EnvoyProcess | None = None
        self.started = time.monotonic()
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Demo:
        try:
            await self._start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start(self) -> None:
        for demo_set in self.sets:
            fleet = SimFleet(demo_set.engine_settings(), replicas=demo_set.engines)
            await self._stack.enter_async_context(fleet)
            self.engines.extend(_engine(demo_set, server) for server in fleet.servers)
        tmpdir = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="extproc-demo-"))
        catalog = Path(tmpdir) / "catalog.yaml"
        catalog.write_text(catalog_yaml(self._worker_sets()), encoding="utf-8")
        await self._start_server(catalog)
        self.envoy = EnvoyProcess(self._envoy_config(), log_path=Path(tmpdir) / "envoy.log")
        # Envoy's own stop runs even if start fails halfway; registering first covers both.
        self._stack.push_async_callback(self.envoy.stop)
        await self.envoy.start()
        await self._self_check()
        self.started = time.monotonic()

    def _worker_sets(self) -> list[LocalWorkerSet]:
        """The catalog: each set with its engines, and where each engine publishes KV events."""
        return [
            LocalWorkerSet(
                name=s.name,
                model=s.upstream,
                aliases=(s.alias,),
                endpoints=[e.address for e in self.engines if e.worker_set == s],
                kv_ports={e.address: e.kv_ports() for e in self.engines if e.worker_set == s},
            )
            for s in self.sets
        ]

    def serve_settings(self, catalog: Path) -> ServeSettings:
        """``serve --source file:CATALOG --tokenizer MODEL=extproc:tiny --chat-template MODEL=T`` for
        every set: the engines' own tokenizer and template, so the router routes precisely."""
        tokenizers = tuple(TokenizerSpec(s.upstream, SHIPPED_TOKENIZER, s.chat_template) for s in self.sets)
        return ServeSettings(
            source=SourceSettings(kind="file", path=catalog),
            listen=f"{HOST}:{self.options.grpc_port}",
            admin_listen=f"{HOST}:0",
            drain_seconds=1.0,
            # The shipped gateway.yaml uses override_host with two retries: let them follow the ranking.
            max_fallbacks=2,
            prefix=PrefixSettings(tokenizers=tokenizers),
        )

    async def _start_server(self, catalog: Path) -> None:
        settings = self.serve_settings(catalog)
        server = Server(settings)
        # stop() is safe on a half-started server, so registering first covers every failure point.
        self._stack.push_async_callback(server.stop)
        try:
            await server.start()
        except (ConfigError, RuntimeError) as exc:
            # The server names its own flag (--listen); the demo's user set --grpc-port.
            raise ConfigError(
                f"the router cannot listen on {HOST}:{self.options.grpc_port} ({exc}); "
                "pick another port with --grpc-port"
            ) from None
        self.server = server

    def _envoy_config(self) -> dict[str, Any]:
        return render_config(
            load_config(shipped_config("gateway.yaml")),
            listen_port=self.options.port,
            admin_port=self.options.admin_port,
            extproc_address=(HOST, self.options.grpc_port),
            pool_endpoints=[(HOST, e.server.port) for e in self.engines],
            body_mode=self.options.body_mode,
        )

    async def _self_check(self) -> None:
        """One ``GET /v1/models`` through Envoy and the router, so the URL we print works."""
        deadline = time.monotonic() + _SELF_CHECK_SECONDS
        last = "no answer"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while time.monotonic() < deadline:
                try:
                    async with session.get(f"{self.url}/v1/models") as resp:
                        if resp.status == 200:
                            return
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.1)
        tail = self.envoy.log_tail() if self.envoy is not None else ""
        raise DemoError(
            f"the gateway at {self.url} did not answer GET /v1/models within {_SELF_CHECK_SECONDS} s "
            f"({last}).\n--- Envoy log ---\n{tail or '(empty)'}"
        )

    def intro(self) -> Intro:
        assert self.server is not None and self.envoy is not None
        return Intro(
            url=self.url,
            envoy_admin_url=self.envoy.admin_url,
            envoy_pid=self.envoy.pid,
            metrics_url=f"http://{HOST}:{self.server.admin_port}/metrics",
            body_mode=self.options.body_mode,
            models=[ModelLine(s.alias, s.upstream, s.engines) for s in self.sets],
            duration=self.options.duration,
            engines=[
                EngineLine(e.worker_set.name, e.address, events, replay or None)
                for e in self.engines
                for events, replay in zip(e.kv_events, e.kv_replay, strict=True)
            ],
        )

    def snapshot(self, traffic: TrafficStats | None) -> Snapshot:
        """What the live view shows now: the engines' own state, the router's in-flight and outcomes."""
        inflight = self.server.load.snapshot() if self.server is not None else {}
        rows = []
        for e in self.engines:
            # In-process reads of each rank's scheduler and cache: what /metrics would report.
            stats = [rank.stats() for rank in e.server.ranks]
            rows.append(
                EndpointRow(
                    worker_set=e.worker_set.name,
                    address=e.address,
                    served=e.server.requests_finished,
                    in_flight=inflight.get(EndpointAddress(e.address), 0),
                    running=sum(r.num_running for r in stats),
                    waiting=sum(r.num_waiting for r in stats),
                    kv_cache_usage=sum(r.kv_cache_usage for r in stats) / len(stats) if stats else 0.0,
                    prefix_queries=sum(r.prefix_cache_queries for r in stats),
                    prefix_hits=sum(r.prefix_cache_hits for r in stats),
                )
            )
        outcomes = request_outcomes(self.server.metrics) if self.server is not None else {}
        return Snapshot(self.url, time.monotonic() - self.started, rows, outcomes, traffic)

    def prefix(self) -> PrefixView:
        """The router's side of prefix routing: how it matched prompts, what its index holds."""
        if self.server is None:
            return PrefixView({}, 0, ())
        state = self.server.prefix.debug_state()["sources"]
        engines = []
        for e in self.engines:
            source = state.get(f"{e.address}/dp0")
            blocks = None if source is None or not source["connected"] else int(source["gpuBlocks"])
            engines.append((e.worker_set.name, blocks, bool(source and source["complete"])))
        counters = self.server.prefix.matcher.counters
        return PrefixView(dict(counters.lookups), counters.tokenize_errors, tuple(engines))

    def intro_text(self) -> str:
        """The rendered intro, with a line saying how the router matches prompts to caches."""
        templates = ", ".join(f"{s.alias} {s.chat_template}" for s in self.sets)
        router = (
            f"Router: routes by cached prefix, tokenizing like the engines ({SHIPPED_TOKENIZER}: {templates})"
        )
        return render_intro(self.intro()).replace("\nTry:\n", f"\n{router}\nTry:\n", 1)


def _engine(demo_set: DemoSet, server: SimServer) -> Engine:
    publishers = [rank.publisher for rank in server.ranks if rank.publisher is not None]
    return Engine(
        worker_set=demo_set,
        server=server,
        kv_events=tuple(p.endpoint for p in publishers),
        kv_replay=tuple(p.replay_endpoint or "" for p in publishers),
    )


def request_outcomes(metrics: Metrics) -> dict[str, int]:
    """``extproc_requests_total`` by outcome, read from the in-process registry (no HTTP scrape)."""
    out: dict[str, int] = {}
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["outcome"]] = int(sample.value)
    return out
