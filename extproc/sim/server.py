"""One simulated engine: tokenizer, served models, data-parallel ranks, HTTP server.

Each rank is what vLLM runs per DP rank: its own scheduler and prefix cache
(:class:`~extproc.sim.engine_core.EngineCore`, driven in time by
:class:`~extproc.sim.engine_loop.EngineLoop`) and its own KV-event publisher on the base ports plus
the rank. One HTTP server fronts all ranks, as ``vllm serve --data-parallel-size N`` does.
"""

from __future__ import annotations

import functools
import itertools
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from aiohttp import web

from extproc.addresses import parse_host_port
from extproc.errors import ConfigError
from extproc.sim.api import build_app
from extproc.sim.engine_core import EngineCore, RequestOutput, SimRequest, StepResult
from extproc.sim.engine_loop import EngineLoop
from extproc.sim.kv_publisher import KVEventPublisher
from extproc.sim.metrics import EngineMetrics, RankStats, SimMetrics
from extproc.sim.ranks import Rank, Run
from extproc.sim.requests import Generation, ServedModel, SimRequestError
from extproc.sim.settings import SimSettings
from extproc.sim.sglang import SGLangMetrics
from extproc.tokenize import (
    ChatTemplate,
    Tokenizer,
    is_template_name,
    shipped_template,
    shipped_tokenizer_dir,
)

log = logging.getLogger(__name__)

#: Text the simulated model "generates", tokenized once and cycled.
_FILLER = (
    "The quick brown fox jumps over the lazy dog while the router keeps every cache warm. "
    "Requests that share a prefix land where their blocks already live, and the queue stays short. "
)


class SimServer:
    """``async with SimServer(settings) as sim:`` serves on ``sim.address`` until the block ends."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        tokenizer_dir = settings.tokenizer or shipped_tokenizer_dir()
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        cache_bytes = settings.tokenize_cache_bytes
        if cache_bytes and not self.tokenizer.enable_segment_cache(cache_bytes):
            log.warning(
                "sim tokenize cache off tokenizer=%s reason=its added tokens do not split text exactly",
                tokenizer_dir,
            )
        self.chat_template = _load_template(settings.chat_template, self.tokenizer)
        self.base_name = settings.base_model_names[0]
        models: dict[str, ServedModel] = {
            name: ServedModel(name, settings.model) for name in settings.base_model_names
        }
        for lora_id, lora in enumerate(settings.lora_modules, start=1):
            models[lora.name] = ServedModel(lora.name, settings.model, lora_name=lora.name, lora_id=lora_id)
        self.models: Mapping[str, ServedModel] = models
        self.lora_paths = {lora.name: lora.path for lora in settings.lora_modules}
        self.metrics: EngineMetrics
        if settings.engine_kind == "sglang":
            engine = settings.engine
            self.metrics = SGLangMetrics(
                model_name=self.base_name,
                stats=self._rank_stats,
                max_total_tokens=engine.num_gpu_blocks * engine.block_size,
            )
        else:
            self.metrics = SimMetrics(
                model_name=self.base_name, stats=self._rank_stats, cache_config=self._cache_config()
            )
        self.ranks: list[Rank] = []
        #: Requests the engine generated to the end (all ranks), for in-process views like the demo's.
        self.requests_finished = 0
        self.started_at = time.time()
        self._filler = self.tokenizer.encode(_FILLER, add_special_tokens=False)
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._host, self._port = parse_host_port(settings.listen, what="--listen")

    # -- lifecycle ----------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        for index in range(self.settings.data_parallel_size):
            self.ranks.append(await self._start_rank(index))
        sock = _bind(self._host, self._port)
        self._port = int(sock.getsockname()[1])
        runner = web.AppRunner(build_app(self), access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        self._runner = runner
        await web.SockSite(runner, sock).start()
        log.info("sim listening address=%s model=%s ranks=%d", self.address, self.base_name, len(self.ranks))

    async def _start_rank(self, index: int) -> Rank:
        core = EngineCore(self.settings.engine)
        publisher: KVEventPublisher | None = None
        kv = self.settings.kv_events
        if kv is not None:
            publisher = KVEventPublisher(kv, host=self._host, dp_rank=index, seed=self.settings.seed + index)
            await publisher.start()
        loop = EngineLoop(
            core,
            time_scale=self.settings.time_scale,
            publish=publisher.publish if publisher is not None else None,
            on_output=functools.partial(self._observe, str(index)),
            on_step=functools.partial(self._observe_step, str(index)),
        )
        await loop.start()
        return Rank(index, core, loop, publisher)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for rank in self.ranks:
            await rank.loop.close()
            if rank.publisher is not None:
                await rank.publisher.close()
        self.ranks.clear()

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    # -- requests -----------------------------------------------------------------------------------

    def next_request_id(self) -> int:
        return next(self._ids)

    def pick_rank(self, header: str | None) -> Rank:
        if header is not None:
            try:
                index = int(header)
            except ValueError:
                raise SimRequestError(
                    400, f"X-data-parallel-rank must be an integer, got {header!r}"
                ) from None
            if not 0 <= index < len(self.ranks):
                raise SimRequestError(
                    400, f"X-data-parallel-rank {index} is out of range (0-{len(self.ranks) - 1})"
                )
            return self.ranks[index]
        return min(self.ranks, key=lambda r: (r.core.num_running + r.core.num_waiting, r.index))

    def submit(self, rank: Rank, gen: Generation, *, request_id: str) -> Run:
        outputs = [self._filler[i % len(self._filler)] for i in range(gen.output_tokens)]
        request = SimRequest(
            request_id=request_id,
            prompt_token_ids=gen.prompt_token_ids,
            output_token_ids=outputs,
            lora_name=gen.model.lora_name,
            lora_id=gen.model.lora_id,
            cache_salt=gen.cache_salt,
            finish_reason=gen.finish_reason,
        )
        return Run(request_id, rank.loop.submit(request), self.tokenizer)

    def _observe_step(self, engine: str, result: StepResult) -> None:
        if result.num_decode_seqs:
            self.metrics.observe_decode_step(
                engine, seconds=result.duration, sequences=result.num_decode_seqs
            )

    def _observe(self, engine: str, out: RequestOutput) -> None:
        if out.ttft is not None:
            self.metrics.observe_first_token(engine, ttft=out.ttft, queue_time=out.queue_time or 0.0)
        if out.finished:
            self.requests_finished += 1
        if out.finished and out.e2e is not None:
            self.metrics.observe_finished(engine, e2e=out.e2e, finish_reason=out.finish_reason or "length")

    # -- operations ---------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> list[int]:
        """Reset every rank's cache; the ranks that refused (blocks in use)."""
        return [rank.index for rank in self.ranks if not rank.core.reset_prefix_cache()]

    def control_kv_events(self, body: Mapping[str, Any]) -> None:
        """``POST /sim/kv_events``: change faults, or restart publishers, on one rank or all."""
        allowed = {"dp_rank", "drop_next", "drop_probability", "delay_seconds", "restart"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise SimRequestError(400, f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        targets = self.ranks
        if body.get("dp_rank") is not None:
            targets = [self.pick_rank(str(body["dp_rank"]))]
        if any(rank.publisher is None for rank in targets):
            raise SimRequestError(400, "KV events are off; start the simulator with --kv-events-port")
        for rank in targets:
            assert rank.publisher is not None
            faults = rank.publisher.faults
            try:
                if "drop_probability" in body:
                    faults = replace(faults, drop_probability=float(body["drop_probability"]))
                if "delay_seconds" in body:
                    faults = replace(faults, delay_seconds=float(body["delay_seconds"]))
                if "drop_next" in body:
                    faults = replace(faults, drop_next=int(body["drop_next"]))
                rank.publisher.set_faults(faults)
            except (TypeError, ValueError) as exc:
                raise SimRequestError(400, f"bad fault setting: {exc}") from None
        if body.get("restart"):
            for rank in targets:
                assert rank.publisher is not None
                rank.publisher.restart()

    def state(self) -> dict[str, Any]:
        """What ``GET /sim/state`` shows: where everything listens and how full each rank is."""
        ranks = []
        for rank in self.ranks:
            entry: dict[str, Any] = {"dp_rank": rank.index, **_stats_json(rank.stats())}
            if rank.publisher is not None:
                entry["kv_events"] = {
                    "endpoint": rank.publisher.endpoint,
                    "replay_endpoint": rank.publisher.replay_endpoint,
                    "next_seq": rank.publisher.next_seq,
                }
            ranks.append(entry)
        return {
            "address": self.address,
            "model": self.settings.model,
            "served_model_names": list(self.settings.base_model_names),
            "lora_modules": list(self.lora_paths),
            "engine_kind": self.settings.engine_kind,
            "block_size": self.settings.engine.block_size,
            "time_scale": self.settings.time_scale,
            "ranks": ranks,
        }

    def _rank_stats(self) -> list[RankStats]:
        return [rank.stats() for rank in self.ranks]

    def _cache_config(self) -> dict[str, str]:
        engine = self.settings.engine
        return {
            "block_size": str(engine.block_size),
            "num_gpu_blocks": str(engine.num_gpu_blocks),
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": engine.prefix_caching_hash_algo,
            "hash_block_size": str(engine.block_size),
            "cache_dtype": "auto",
        }


def _stats_json(stats: RankStats) -> dict[str, Any]:
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "kv_cache_usage": round(stats.kv_cache_usage, 6),
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "external_prefix_cache_queries": stats.external_prefix_cache_queries,
        "external_prefix_cache_hits": stats.external_prefix_cache_hits,
        "cpu_cache_blocks": stats.cpu_cache_blocks,
        "cpu_cache_capacity": stats.cpu_cache_capacity,
    }


def _load_template(spec: str | None, tokenizer: Tokenizer) -> ChatTemplate:
    if spec is None:
        if tokenizer.chat_template is not None:
            return ChatTemplate(tokenizer.chat_template, name="tokenizer_config.json")
        return ChatTemplate.from_file(shipped_template("llama3"))
    if is_template_name(spec):
        return ChatTemplate.from_file(shipped_template(spec))
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--chat-template: {spec!r} is neither a file nor a shipped template (chatml, llama3)"
        )
    return ChatTemplate.from_file(path)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--listen {host}:{port}: cannot listen ({exc.strerror or exc})") from None
    return sock
