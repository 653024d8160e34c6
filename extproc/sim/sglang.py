"""What an SGLang 0.5.23 server shows that a vLLM one does not: routes, bodies and metric names.

``extproc sim --engine sglang`` keeps the same engine model (scheduler, prefix cache, latencies) and
changes only what a client, a metrics scraper or a KV-event subscriber sees. Facts, from SGLang's
source (``srt/entrypoints/http_server.py``, ``srt/entrypoints/openai/protocol.py``,
``srt/observability/metrics_collector.py``, ``srt/runtime_context.py``), and how the simulator
follows them:

- **Routes**: ``/v1/models`` (cards ``owned_by: sglang``, ``max_model_len`` on the base model, an
  adapter's ``root`` is its path), ``/tokenize`` and ``/v1/tokenize`` (``{tokens, count,
  max_model_len}``; exactly one of ``prompt`` or ``messages``), ``/detokenize`` and
  ``/v1/detokenize`` (``{text}``), ``/health`` and ``/health_generate``, ``/server_info`` (and the
  deprecated ``/get_server_info``) with the ``kv_events`` descriptor routers use to subscribe,
  ``/model_info`` (and ``/get_model_info``), ``/flush_cache`` (GET or POST; 400 while requests run).
- **Errors**: ``{"object": "error", "message", "type", "param", "code"}`` (``ErrorResponse``).
- **cache_salt**: a string, or a list (one per prompt of a batch); ``""`` means no salt.
- **Metrics**: scheduler gauges ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
  ``sglang:token_usage``, ``sglang:cache_hit_rate`` with the scheduler's labels (``engine_type``,
  ``model_name``, ``moe_ep_rank``, ``pp_rank``, ``tp_rank``, and ``dp_rank`` under data
  parallelism), written in sorted order as SGLang's multiprocess collector writes them; the
  tokenizer's counters ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total`` and
  ``sglang:cached_tokens_total`` (``cache_source`` ``device`` / ``host``, present from the first
  hit) and the TTFT / e2e histograms, labelled ``engine_type``, ``model_name``, ``is_streaming``.
  Simplifications: the counters are read from the engine at scrape time (SGLang counts a request
  when it finishes), under ``is_streaming="false"``; histogram buckets are vLLM's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.sim.engine import Engine
from extproc.sim.metrics import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS, BatchHistogram, RankStats
from extproc.sim.requests import SimRequestError

#: The version ``/server_info`` reports: the SGLang release whose surface this follows.
SGLANG_VERSION = "0.5.23"
#: ``engine_type`` of a server that is neither a prefill nor a decode worker.
ENGINE_TYPE = "unified"


def error_json(exc: SimRequestError) -> dict[str, Any]:
    """SGLang's ``ErrorResponse``."""
    return {
        "object": "error",
        "message": exc.message,
        "type": exc.error_type,
        "param": exc.param,
        "code": exc.status,
    }


# -- metrics ------------------------------------------------------------------------------------------


class _SchedulerCollector(Collector):
    """The per-rank gauges and the tokenizer's counters, read from the engine at scrape time."""

    def __init__(
        self, model_name: str, stats: Callable[[], Sequence[RankStats]], max_total_tokens: int
    ) -> None:
        self._model_name = model_name
        self._stats = stats
        self._max_total_tokens = max_total_tokens

    def collect(self) -> Iterable[Metric]:
        ranks = self._stats()
        dp = len(ranks) > 1
        labels = [
            *(["dp_rank"] if dp else []),
            "engine_type",
            "model_name",
            "moe_ep_rank",
            "pp_rank",
            "tp_rank",
        ]
        gauges = {
            name: GaugeMetricFamily(f"sglang:{name}", doc, labels=labels)
            for name, doc in (
                ("num_running_reqs", "The number of running requests."),
                ("num_queue_reqs", "The number of requests in the waiting queue."),
                ("token_usage", "The token usage."),
                ("cache_hit_rate", "The prefix cache hit rate."),
                ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
            )
        }
        for stats in ranks:
            values = [*([stats.engine] if dp else []), ENGINE_TYPE, self._model_name, "0", "0", "0"]
            hit_rate = (
                stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            )
            gauges["num_running_reqs"].add_metric(values, stats.num_running)
            gauges["num_queue_reqs"].add_metric(values, stats.num_waiting)
            gauges["token_usage"].add_metric(values, stats.kv_cache_usage)
            gauges["cache_hit_rate"].add_metric(values, hit_rate)
            gauges["max_total_num_tokens"].add_metric(values, self._max_total_tokens)
        yield from gauges.values()

        request_labels = ["engine_type", "is_streaming", "model_name"]
        base = [ENGINE_TYPE, "false", self._model_name]
        prompt = CounterMetricFamily(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", labels=request_labels
        )
        prompt.add_metric(base, sum(s.prefix_cache_queries for s in ranks))
        generation = CounterMetricFamily(
            "sglang:generation_tokens", "Number of generation tokens processed.", labels=request_labels
        )
        generation.add_metric(base, sum(s.generation_tokens for s in ranks))
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            labels=["cache_source", "engine_type", "model_name"],
        )
        for source, value in (
            ("device", sum(s.prefix_cache_hits for s in ranks)),
            ("host", sum(s.external_prefix_cache_hits for s in ranks)),
        ):
            if value > 0:  # SGLang makes a source's series at its first cached token
                cached.add_metric([source, ENGINE_TYPE, self._model_name], value)
        yield from (prompt, generation, cached)


class SGLangMetrics:
    """The simulator's registry under SGLang's names (the methods of :class:`~.metrics.SimMetrics`)."""

    def __init__(
        self, *, model_name: str, stats: Callable[[], Sequence[RankStats]], max_total_tokens: int
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_SchedulerCollector(model_name, stats, max_total_tokens))
        labels = ["engine_type", "is_streaming", "model_name"]
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.itl = BatchHistogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            ITL_BUCKETS,
        )
        self.registry.register(self.itl)
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )

    def observe_first_token(self, engine: str, *, ttft: float, queue_time: float) -> None:
        self.ttft.labels(ENGINE_TYPE, "false", self.model_name).observe(ttft)
        self.queue_time.labels(ENGINE_TYPE, "false", self.model_name).observe(queue_time)

    def observe_finished(self, engine: str, *, e2e: float, finish_reason: str) -> None:
        self.e2e.labels(ENGINE_TYPE, "false", self.model_name).observe(e2e)

    def observe_decode_step(self, engine: str, *, seconds: float, sequences: int) -> None:
        self.itl.observe((ENGINE_TYPE, "false", self.model_name), seconds, sequences)


# -- HTTP ---------------------------------------------------------------------------------------------


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def server_info(engine: Engine) -> dict[str, Any]:
    """``/server_info``: the resolved server arguments a router reads, and the KV-event descriptor."""
    settings = engine.settings
    kv = settings.kv_events
    publishers = [rank.publisher for rank in engine.ranks]
    descriptor = None
    if kv is not None and publishers and publishers[0] is not None:
        endpoint = publishers[0].endpoint  # tcp://host:port of rank 0; rank r adds r
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        descriptor = {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": int(port),
            "topic": kv.topic,
            "block_size": settings.engine.published_block_size or settings.engine.block_size,
            "dp_size": settings.data_parallel_size,
        }
        replay = publishers[0].replay_endpoint
        if replay:
            descriptor["replay_endpoint_port_base"] = int(replay.rpartition(":")[2])
    return {
        "model_path": settings.model,
        "served_model_name": engine.base_name,
        "tokenizer_path": str(settings.tokenizer) if settings.tokenizer else settings.model,
        "context_length": settings.engine.max_model_len,
        "page_size": settings.engine.block_size,
        "max_running_requests": settings.engine.max_num_seqs,
        "chunked_prefill_size": settings.engine.max_num_batched_tokens,
        "dp_size": settings.data_parallel_size,
        "tp_size": 1,
        "pp_size": 1,
        "enable_lora": bool(settings.lora_modules),
        "max_total_num_tokens": settings.engine.num_gpu_blocks * settings.engine.block_size,
        "kv_events": descriptor,
        "internal_states": [{"dp_rank": rank.index} for rank in engine.ranks],
        "version": SGLANG_VERSION,
        "frontend": "python",
    }


def add_routes(
    app: web.Application,
    engine: Engine,
    tokenize: Callable[[web.Request], Awaitable[tuple[list[int], dict[str, Any]]]],
) -> None:
    """SGLang's own routes; ``tokenize`` reads a /tokenize request into ``(ids, body)``."""

    async def tokenize_route(request: web.Request) -> web.StreamResponse:
        ids, _ = await tokenize(request)
        return _json(
            {"tokens": ids, "count": len(ids), "max_model_len": engine.settings.engine.max_model_len}
        )

    async def detokenize(request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise SimRequestError(400, f"the request body is not valid JSON: {exc}") from None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise SimRequestError(400, "'tokens' must be a list of token ids", param="tokens")
        return _json({"text": engine.tokenizer.decode(tokens)})

    async def models(request: web.Request) -> web.StreamResponse:
        created = int(engine.started_at)
        cards = [
            {
                "id": engine.base_name,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": engine.base_name,
                "parent": None,
                "max_model_len": engine.settings.engine.max_model_len,
            }
        ]
        for name, path in engine.lora_paths.items():
            cards.append(
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "sglang",
                    "root": path,
                    "parent": engine.base_name,
                    "max_model_len": None,
                }
            )
        return _json({"object": "list", "data": cards})

    async def info(request: web.Request) -> web.StreamResponse:
        return _json(server_info(engine))

    async def model_info(request: web.Request) -> web.StreamResponse:
        settings = engine.settings
        return _json(
            {
                "model_path": settings.model,
                "served_model_name": engine.base_name,
                "tokenizer_path": str(settings.tokenizer) if settings.tokenizer else settings.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def health(request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def flush_cache(request: web.Request) -> web.StreamResponse:
        if engine.reset_prefix_cache():
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )

    for path in ("/tokenize", "/v1/tokenize"):
        app.router.add_post(path, tokenize_route)
    for path in ("/detokenize", "/v1/detokenize"):
        app.router.add_post(path, detokenize)
    app.router.add_get("/v1/models", models)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
