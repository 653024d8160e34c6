"""A simulated engine's data-parallel ranks, and one request running on a rank.

Shared by the engine (:mod:`extproc.sim.server`, which builds the ranks) and its HTTP surface
(:mod:`extproc.sim.api`, which submits to them and streams the results).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from extproc.sim.engine_core import EngineCore
from extproc.sim.engine_loop import EngineLoop, RequestHandle
from extproc.sim.kv_publisher import KVEventPublisher
from extproc.sim.metrics import RankStats
from extproc.tokenize import Tokenizer


@dataclass(slots=True)
class Rank:
    """One data-parallel rank: scheduler + cache, its time loop, its publisher."""

    index: int
    core: EngineCore
    loop: EngineLoop
    publisher: KVEventPublisher | None

    def stats(self) -> RankStats:
        c = self.core
        return RankStats(
            engine=str(self.index),
            num_running=c.num_running,
            num_waiting=c.num_waiting,
            kv_cache_usage=c.kv_cache_usage,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            num_preemptions=c.num_preemptions,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            external_prefix_cache_queries=c.external_prefix_cache_queries,
            external_prefix_cache_hits=c.external_prefix_cache_hits,
            cpu_cache_blocks=c.cpu_cache_blocks,
            cpu_cache_capacity=c.params.cpu_offload_blocks,
        )


class Run:
    """One request in flight on a rank, as the HTTP layer consumes it."""

    def __init__(self, request_id: str, handle: RequestHandle, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self._handle = handle
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self.generated = 0
        self.num_cached_tokens = 0

    async def tokens(self) -> AsyncIterator[tuple[str, bool]]:
        """(text, finished) per engine step that produced tokens."""
        async for out in self._handle:
            self.num_cached_tokens = out.num_cached_tokens
            self._ids.extend(out.new_token_ids)
            self.generated += len(out.new_token_ids)
            yield self._tokenizer.decode(list(out.new_token_ids)), out.finished

    @property
    def text(self) -> str:
        return self._tokenizer.decode(self._ids)

    def close(self) -> None:
        """Abort in the engine if it has not finished (a client that went away frees its blocks)."""
        self._handle.cancel()
