"""``/metrics`` with vLLM's names and labels (``model_name``, ``engine``), one registry per server.

Gauges and counters that describe engine state are read from the engines at scrape time (they
cannot drift from it); latencies are observed as requests produce them. Time metrics are in
*simulated* seconds, i.e. what the engine model says a real GPU would take, whatever
``--time-scale`` is, so they compare with real vLLM numbers.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

#: vLLM's ``vllm:time_to_first_token_seconds`` buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's request-latency buckets (e2e, queue time).
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


#: vLLM's ``vllm:inter_token_latency_seconds`` buckets.
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class BatchHistogram(Collector):
    """A histogram that takes many equal observations at once: one engine step gives every decoding
    sequence the same inter-token latency, and observing them one by one would cost the simulator
    a call per token."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self._name, self._documentation = name, documentation
        self._labelnames = list(labelnames)
        self._bounds = list(buckets)
        #: label values -> (count per bucket, not cumulative; the +Inf bucket last), sum.
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = ([0] * (len(self._bounds) + 1), [0.0])
        series[0][bisect.bisect_left(self._bounds, value)] += count
        series[1][0] += value * count

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for labels, (counts, total) in sorted(self._series.items()):
            cumulative = list(itertools.accumulate(counts))
            bounds = [*(repr(float(b)) for b in self._bounds), "+Inf"]
            family.add_metric(list(labels), list(zip(bounds, cumulative, strict=True)), total[0])
        yield family


@dataclass(frozen=True, slots=True)
class RankStats:
    """One data-parallel rank's state at scrape time."""

    engine: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    #: The CPU offload tier's part of prefix lookups, in tokens (0 without a tier).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    #: Blocks the CPU tier holds, and its capacity (0 without a tier): ``/sim/state`` only.
    cpu_cache_blocks: int = 0
    cpu_cache_capacity: int = 0


class EngineMetrics(Protocol):
    """What the server feeds and the HTTP surface exposes, whichever engine's names it uses."""

    @property
    def registry(self) -> CollectorRegistry: ...
    def observe_first_token(self, engine: str, *, ttft: float, queue_time: float) -> None: ...
    def observe_finished(self, engine: str, *, e2e: float, finish_reason: str) -> None: ...
    def observe_decode_step(self, engine: str, *, seconds: float, sequences: int) -> None: ...


_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily
#: vLLM's per-engine state families, named and described as vLLM does: the :class:`RankStats`
#: field each engine's sample comes from, the family's type, name and help.
_STATE_FAMILIES: tuple[tuple[str, type[GaugeMetricFamily | CounterMetricFamily], str, str], ...] = (
    ("num_running", _GAUGE, "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("num_waiting", _GAUGE, "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage", _GAUGE, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    (
        "prefix_cache_queries",
        _COUNTER,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    (
        "prefix_cache_hits",
        _COUNTER,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
    ),
    # vLLM registers these whether or not a KV connector is configured (0 without one).
    (
        "external_prefix_cache_queries",
        _COUNTER,
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
        "queried tokens.",
    ),
    (
        "external_prefix_cache_hits",
        _COUNTER,
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
        "cached tokens.",
    ),
    ("num_preemptions", _COUNTER, "vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    ("prompt_tokens", _COUNTER, "vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", _COUNTER, "vllm:generation_tokens", "Number of generation tokens processed."),
)


class _EngineStateCollector(Collector):
    def __init__(
        self, model_name: str, stats: Callable[[], Sequence[RankStats]], cache_config: Mapping[str, str]
    ):
        self._model_name = model_name
        self._stats = stats
        self._cache_config = dict(cache_config)

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "engine"]
        families = [(kind(name, doc, labels=labels), field) for field, kind, name, doc in _STATE_FAMILIES]
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*sorted(self._cache_config), "engine"],
        )
        for rank in self._stats():
            values = [self._model_name, rank.engine]
            for family, field in families:
                family.add_metric(values, getattr(rank, field))
            info.add_metric([self._cache_config[k] for k in sorted(self._cache_config)] + [rank.engine], 1.0)
        for family, _ in families:
            yield family
        yield info


class SimMetrics:
    """The simulator's registry: engine state at scrape time, request latencies as observed."""

    def __init__(
        self,
        *,
        model_name: str,
        stats: Callable[[], Sequence[RankStats]],
        cache_config: Mapping[str, str],
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineStateCollector(model_name, stats, cache_config))
        labels = ["model_name", "engine"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.itl = BatchHistogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            ITL_BUCKETS,
        )
        self.registry.register(self.itl)
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )

    def observe_first_token(self, engine: str, *, ttft: float, queue_time: float) -> None:
        self.ttft.labels(self.model_name, engine).observe(ttft)
        self.queue_time.labels(self.model_name, engine).observe(queue_time)

    def observe_finished(self, engine: str, *, e2e: float, finish_reason: str) -> None:
        self.e2e.labels(self.model_name, engine).observe(e2e)
        self.success.labels(self.model_name, engine, finish_reason).inc()

    def observe_decode_step(self, engine: str, *, seconds: float, sequences: int) -> None:
        """A step that gave ``sequences`` decoding requests their next token after ``seconds``."""
        self.itl.observe((self.model_name, engine), seconds, sequences)
