"""What the scheduler knows of an engine's own view of its load: the signals type.

The engine adapters (:mod:`extproc.engines`) turn whatever an engine exposes into this type; the
scheduler and its policies read only this, so a new engine kind never touches scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.types import EngineKind


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """One endpoint's load at scrape time, summed over its data-parallel ranks.

    A field is None when the page does not expose that series (e.g. an engine too old or too new),
    so callers can tell "zero" from "unknown".
    """

    #: Requests in the model-execution batch, all ranks.
    running: int | None
    #: Requests queued for scheduling, all ranks.
    waiting: int | None
    #: Fraction of KV-cache blocks in use, 0-1, on the fullest rank.
    kv_cache_usage: float | None
    #: Cumulative prompt tokens looked up in the prefix cache (a counter: compare two scrapes).
    prefix_cache_queries: float | None
    #: Cumulative prompt tokens found in the prefix cache (a counter).
    prefix_cache_hits: float | None
    #: Running totals of the engine's time-to-first-token histogram (seconds, requests), all ranks;
    #: None unless the page has both.
    ttft_seconds_sum: float | None = None
    ttft_count: float | None = None
    #: The same for the inter-token latency histogram (one sample per decoded token after the first).
    itl_seconds_sum: float | None = None
    itl_count: float | None = None
    #: Distinct DP ranks (vLLM's ``engine`` label, SGLang's ``dp_rank``), sorted; its length is the
    #: visible DP size.
    engines: tuple[str, ...] = ()
    #: Distinct ``model_name`` label values (served model names).
    model_names: tuple[str, ...] = ()
    #: Metric names read from the pre-0.12 spelling because the new one was missing.
    old_names: tuple[str, ...] = ()
    #: Lines of our series that could not be read, or held NaN/Inf; they were left out.
    bad_lines: int = 0
    #: The first such problem, for people reading state.
    first_problem: str | None = None
    #: Whose metric names the page uses (None if it mixes both).
    engine_kind: EngineKind | None = None

    @property
    def data_parallel_size(self) -> int:
        """DP ranks seen on the page (1 when the engine label is absent)."""
        return max(1, len(self.engines))

    def to_debug(self) -> dict[str, object]:
        entry: dict[str, object] = {
            "engineKind": self.engine_kind,
            "running": self.running,
            "waiting": self.waiting,
            "kvCacheUsage": self.kv_cache_usage,
            "prefixCacheQueries": self.prefix_cache_queries,
            "prefixCacheHits": self.prefix_cache_hits,
            "engines": list(self.engines),
            "modelNames": list(self.model_names),
        }
        if self.old_names:
            entry["oldNames"] = list(self.old_names)
        if self.bad_lines:
            entry["badLines"] = self.bad_lines
            entry["firstProblem"] = self.first_problem
        return entry
