"""The replay in virtual time: the router's decision path and the engine cores in one process.

The online replay (:mod:`bench.replay.run`) plays the trace against engine processes on the wall
clock, so a busy machine changes its figures. Here a discrete-event loop plays it in *model* time:
request arrivals (the trace's own timestamps) and engine step ends are events, taken in time order.

The same parts decide as online: the real :class:`Scheduler` and policy, the real prefix index and
matcher (tokenizer ``extproc:tiny``), fed with each engine step's KV events as the router's ingest
decodes them (handed over decoded by :func:`router_batch`, or with ``wire_events`` encoded as vLLM
sends them and decoded by the ingest itself: the same index either way, ~20% slower); in-flight
leases from each decision to the request's last token, their predicted prefill measured in model
seconds. The engines are the simulator's :class:`EngineCore`, stepped exactly as its
:class:`EngineLoop` steps them (a step starts when the previous one ends while there is work, or
when a request reaches an idle engine), with the outputs its HTTP layer would ask for
(``max_tokens`` filler tokens).

What differs from online, deliberately: KV events reach the index the moment their step ends (ZMQ
takes a few ms online), and nothing waits on sockets or a CPU. Engine signals (``--scrape-interval``)
are not modelled: online runs default to none as well. The one exception is profile calibration
(:mod:`extproc.scheduling.calibration`): given one, the replay hands it each engine's latency
totals and counts every ``scrape_s`` model seconds, as serve's scraper would.

The result has the online arm's shape, so :func:`~bench.replay.run.summarize` and the report take
it as is; times are model seconds (time scale 1), and ``compute_s`` is the CPU the run took.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.replay.arms import MODEL, PATH, Arm, Config, Sent, replay_catalog
from bench.replay.events import router_batch
from bench.replay.routers import Router, build_router, summed
from bench.replay.trace import TraceRequest, prompt_tokens
from extproc.catalog.store import CatalogStore
from extproc.control.load import Lease
from extproc.demo.catalog import LocalWorkerSet
from extproc.openai import read_request
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.engine_signals import EngineSignals
from extproc.settings import PrefixSettings, TokenizerSpec
from extproc.sim.engine_core import EngineCore, EngineParams, RequestOutput, SimRequest, StepResult
from extproc.sim.kv_wire import EventEncoding, HashFormat, encode_batch
from extproc.tokenize.registry import SHIPPED_TOKENIZER
from extproc.types import EndpointAddress

#: The token every simulated answer repeats (the online simulator repeats a filler sentence; what
#: the answer holds only matters to the blocks it fills, which no later prompt shares).
_ANSWER_TOKEN = 42


@dataclass(slots=True)
class _Flight:
    """One request between its decision and its last token."""

    record: Sent
    lease: Lease
    arrival: float
    router: Router


@dataclass(slots=True)
class OfflineEngine:
    """One simulated engine: its core, its KV-event source and its place on the virtual timeline."""

    address: EndpointAddress
    core: EngineCore
    #: Bumped whenever a step is scheduled, so a superseded idle step's end is ignored.
    generation: int = 0
    #: Model time the step in progress ends; None while idle.
    busy_until: float | None = None
    #: The step in progress is an idle wait for a CPU->GPU load (an arrival may end it early).
    waiting_for_load: bool = False
    seq: int = 0
    ttft: list[float] = field(default_factory=list)
    #: The engine's TTFT histogram ``_sum`` (its ``_count`` is ``len(ttft)``).
    ttft_sum: float = 0.0
    #: Its inter-token latency histogram's ``_sum`` and ``_count``.
    itl_sum: float = 0.0
    itl_count: int = 0
    queue: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finished: int = 0


class OfflineReplay:
    """One arm's run: events in model-time order until every request has finished."""

    def __init__(
        self,
        arm: Arm,
        requests: list[TraceRequest],
        cfg: Config,
        vocab: int,
        *,
        calibration: Calibration | None = None,
        scrape_s: float = 1.0,
    ) -> None:
        self.arm = arm
        self.calibration = calibration
        self.scrape_s = scrape_s
        self.requests = requests
        self.output_cap = cfg.output_cap
        self.vocab = vocab
        self.now = 0.0
        params = EngineParams(**cfg.engine)
        addresses = [EndpointAddress(f"127.0.0.1:{20000 + i}") for i in range(cfg.engines)]
        self.engines = {a: OfflineEngine(a, EngineCore(params)) for a in addresses}
        # Declared KV-event ports only make the catalog plan the sources; nothing listens on them.
        kv_ports: dict[str, tuple[int, int | None]] = (
            {} if arm.approximate else {a: (30000 + i, 31000 + i) for i, a in enumerate(self.engines)}
        )
        worker_set = LocalWorkerSet(
            "replay", MODEL, list(self.engines), kv_block_size=params.block_size, kv_ports=kv_ports
        )
        self.store = CatalogStore()
        # Tokenized inline (no thread pool): the prompts are token ids, and nothing must run on
        # another clock than this one.
        settings = PrefixSettings(tokenizers=(TokenizerSpec(MODEL, SHIPPED_TOKENIZER),), tokenize_threads=0)
        self.store.publish(replay_catalog(worker_set))
        #: The router replicas (one unless ``cfg.routers``), requests round robin across them.
        self.routers = [
            build_router(i, arm, cfg, self.store, settings, lambda: self.now, calibration)
            for i in range(max(1, cfg.routers))
        ]
        self.sync_delay_s = cfg.sync_delay_s
        first = self.routers[0]
        self.routing, self.load, self.scheduler, self.control = (
            first.routing,
            first.load,
            first.scheduler,
            first.control,
        )
        self.sources = first.sources
        #: Rows longer than the engines' context: answered 400, as an engine would online.
        self.refused = 0
        self._events: list[tuple[float, int, int, Any]] = []
        self._order = itertools.count()
        self._flights: dict[str, _Flight] = {}
        self.records: list[Sent] = []
        self.wire_events = cfg.wire_events

    # -- the timeline ------------------------------------------------------------------------------

    # At equal times: steps end, arrivals route, scrapes, peer-sync deliveries.
    _ARRIVAL, _STEP_END, _SCRAPE, _SYNC = 1, 0, 2, 3

    def _at(self, when: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (when, kind, next(self._order), payload))

    def run(self) -> dict[str, Any]:
        # Collect young garbage every 100,000 allocations, not 700: a run allocates tens of millions
        # of short-lived objects (blocks, events, keys) and makes little cyclic garbage, and the
        # default thresholds spent ~8% of its CPU in the collector, rescanning survivors.
        thresholds = gc.get_threshold()
        gc.set_threshold(100_000, 50, 100)
        try:
            return self._run()
        finally:
            gc.set_threshold(*thresholds)

    def _run(self) -> dict[str, Any]:
        cpu0 = time.process_time()
        for request in self.requests:
            self._at(request.arrival_s, self._ARRIVAL, request)
        if self.calibration is not None:
            self._at(self.scrape_s, self._SCRAPE, None)
        while self._events:
            when, kind, _, payload = heapq.heappop(self._events)
            self.now = when
            if kind == self._ARRIVAL:
                self._arrive(payload)
            elif kind == self._SCRAPE:
                self._scrape()
            elif kind == self._SYNC:
                load, lease, added = payload
                if added is None:
                    load.prefill_over(lease.key)
                elif added:
                    load.add(lease)
                else:
                    load.remove(lease.key)
            else:
                engine, generation, result = payload
                if generation == engine.generation:
                    self._step_ended(engine, result)
        return {
            "name": self.arm.name,
            "prefix_mode": "approximate" if self.arm.approximate else "precise",
            "wall_s": self.now,
            "router_client_cpu_s": time.process_time() - cpu0,
            "engine_cpu_s": 0.0,
            "prefix_lookups": summed(r.routing.matcher.counters.lookups for r in self.routers),
            "routers": len(self.routers),
            "sync_delay_s": self.sync_delay_s,
            "refused_too_long": self.refused,
            "engines": [self._engine_numbers(e) for e in self.engines.values()],
            "requests": [asdict(r) for r in self.records],
        }

    # -- requests ----------------------------------------------------------------------------------

    def _arrive(self, request: TraceRequest) -> None:
        max_tokens = max(1, min(request.output_length, self.output_cap))
        prompt = prompt_tokens(request, self.vocab)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        started = time.perf_counter()
        router = self.routers[len(self.records) % len(self.routers)]
        decision = router.control.decide(read_request(PATH, body))
        address = decision.pick.address
        record = Sent(request.index, address)
        record.router_cached = decision.prefix.cached_tokens.get(address, 0)
        record.decide_s = time.perf_counter() - started
        self.records.append(record)
        tokens, seconds = decision.prefill
        # The policy's own prediction, unrounded; (0, 0.0) from a policy that predicts nothing.
        record.predicted_ttft_s = seconds or None
        engine = self.engines[address]
        request_id = str(request.index)
        try:
            engine.core.add_request(
                SimRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    output_token_ids=[_ANSWER_TOKEN] * max_tokens,
                    arrival_time=self.now,
                    finish_reason="length",
                )
            )
        except ValueError as exc:  # longer than the context: the engine answers 400 online
            record.error = f"400: {exc}"
            self.refused += 1
            return
        lease = router.control.acquire(address, model=MODEL, prefill_tokens=tokens, prefill_seconds=seconds)
        self._share(router, lease, added=True)
        if self.arm.active is not None:
            self.arm.active.start(request.index, address, request.input_length, record.router_cached)
        self._flights[request_id] = _Flight(record, lease, self.now, router)
        if engine.busy_until is None or engine.waiting_for_load:
            self._step(engine)

    # -- engines -----------------------------------------------------------------------------------

    def _step(self, engine: OfflineEngine) -> None:
        """Start the engine's next step now, as its loop would; idle when there is nothing to run."""
        engine.generation += 1
        engine.waiting_for_load = False
        if not engine.core.has_work:
            engine.busy_until = None
            return
        result = engine.core.step(self.now)
        if result.duration <= 0 and not result.outputs:
            # Nothing could run (every request waits for blocks that only an arrival changes).
            self._publish(engine, result)
            engine.busy_until = None
            return
        engine.busy_until = self.now + result.duration
        engine.waiting_for_load = result.idle
        self._at(engine.busy_until, self._STEP_END, (engine, engine.generation, result))

    def _step_ended(self, engine: OfflineEngine, result: StepResult) -> None:
        engine.itl_sum += result.duration * result.num_decode_seqs
        engine.itl_count += result.num_decode_seqs
        for out in result.outputs:
            self._output(engine, out)
        self._publish(engine, result)
        self._step(engine)

    def _output(self, engine: OfflineEngine, out: RequestOutput) -> None:
        flight = self._flights.get(out.request_id)
        if flight is None:
            return
        record = flight.record
        if out.ttft is not None:
            engine.ttft.append(out.ttft)
            engine.ttft_sum += out.ttft
            engine.queue.append(out.queue_time or 0.0)
            record.ttft_wall_s = self.now - flight.arrival
            record.engine_cached = out.num_cached_tokens
            flight.router.load.prefill_over(flight.lease.key)
            self._share(flight.router, flight.lease, added=None)
            if self.arm.active is not None:
                self.arm.active.first_token(int(out.request_id))
        if out.finished:
            if out.e2e is not None:
                engine.e2e.append(out.e2e)
            engine.finished += 1
            record.e2e_wall_s = self.now - flight.arrival
            record.ok = True
            flight.router.control.release(flight.lease)
            self._share(flight.router, flight.lease, added=False)
            if self.arm.active is not None:
                self.arm.active.finish(int(out.request_id))
            del self._flights[out.request_id]

    def _share(self, router: Router, lease: Lease, *, added: bool | None) -> None:
        """Peer sync, modelled: the other routers count the lease (``added``), stop counting it
        (False) or count it as past its prefill (None) a delay later."""
        if self.sync_delay_s is None or len(self.routers) == 1:
            return
        # A lease is a frozen value and the replay's clock is everyone's: peers count this very one.
        for other in self.routers:
            if other is not router:
                self._at(self.now + self.sync_delay_s, self._SYNC, (other.load, lease, added))

    def _scrape(self) -> None:
        """Every engine's latency totals to the calibration, then the next scrape while work remains."""
        assert self.calibration is not None
        for engine in self.engines.values():
            core = engine.core
            signals = EngineSignals(
                core.num_running,
                core.num_waiting,
                None,
                core.prefix_cache_queries,
                core.prefix_cache_hits,
                ttft_seconds_sum=engine.ttft_sum,
                ttft_count=len(engine.ttft),
                itl_seconds_sum=engine.itl_sum,
                itl_count=engine.itl_count,
            )
            self.calibration.scraped(engine.address, signals)
        if self._events:  # arrivals or steps still to come
            self._at(self.now + self.scrape_s, self._SCRAPE, None)

    def _publish(self, engine: OfflineEngine, result: StepResult) -> None:
        """The step's KV events through the router's ingest, encoded or not (``wire_events``)."""
        if not result.events or engine.address not in self.sources:
            return
        # Every router follows every engine, as every serve replica does.
        if self.wire_events:
            payload = encode_batch(
                result.events, ts=self.now, dp_rank=0, encoding=EventEncoding.MAPS, hash_format=HashFormat.INT
            )
            for router in self.routers:
                router.routing.ingest.on_batch(router.sources[engine.address], engine.seq, payload)
        else:
            for router in self.routers:
                batch = router_batch(result.events, self.now)
                router.routing.ingest.on_decoded(router.sources[engine.address], batch)
        engine.seq += 1

    @staticmethod
    def _engine_numbers(engine: OfflineEngine) -> dict[str, Any]:
        core = engine.core
        return {
            "address": engine.address,
            "prefix_cache_queries": core.prefix_cache_queries,
            "prefix_cache_hits": core.prefix_cache_hits,
            "external_prefix_cache_hits": core.external_prefix_cache_hits,
            "preemptions": core.num_preemptions,
            "prompt_tokens": core.prompt_tokens,
            "requests_finished": engine.finished,
            "lag_dropped_s": 0.0,
            "ttft": engine.ttft,
            "queue": engine.queue,
            "e2e": engine.e2e,
        }
