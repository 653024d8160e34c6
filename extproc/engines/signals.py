"""Turn one vLLM ``/metrics`` page (Prometheus text exposition) into the load signals the router uses.

Only a handful of series matter for scheduling (running and waiting requests, KV-cache usage, the
prefix-cache counters), so lines are filtered by metric name before any parsing: an engine exposing
hundreds of histogram buckets costs a string prefix check per line, and a line we cannot read only
matters if it is one of ours. Each kept line is parsed by ``prometheus_client`` (it accepts vLLM's
``vllm:`` names, escaped label values, NaN and +Inf), one line at a time, so one bad line drops that
sample rather than the whole page.

vLLM labels every series with ``model_name`` and ``engine`` (the data-parallel rank as a string). A pod
with DP ranks exposes one sample per rank: counts and counters are summed over ranks, usage is the
fullest rank's (a request lands on one rank; the fullest one is the one that preempts first).

Old names (vLLM <= 0.11) are used only when the new name is absent from the page:
``vllm:gpu_cache_usage_perc`` for ``vllm:kv_cache_usage_perc`` and
``vllm:gpu_prefix_cache_{queries,hits}`` for ``vllm:prefix_cache_{queries,hits}``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from extproc.scheduling.signals import EngineSignals

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_QUERIES_OLD = "vllm:gpu_prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_hits"

_GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)
_COUNTERS = (PREFIX_QUERIES, PREFIX_QUERIES_OLD, PREFIX_HITS, PREFIX_HITS_OLD)

#: Exposed sample name -> the family it belongs to. ``prometheus_client`` exposes counters with a
#: ``_total`` suffix; OpenMetrics-less exporters may not, so both spellings are accepted.
_WANTED: dict[str, str] = {name: name for name in _GAUGES}
_WANTED.update({f"{name}_total": name for name in _COUNTERS})
_WANTED.update({name: name for name in _COUNTERS})


class MetricsParseError(ValueError):
    """The page holds none of the engine series we schedule on (not vLLM, or not a metrics page)."""


@dataclass(slots=True)
class _Samples:
    values: dict[str, list[float]] = field(default_factory=dict)
    engines: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    bad_lines: int = 0
    first_problem: str | None = None

    def problem(self, message: str) -> None:
        self.bad_lines += 1
        if self.first_problem is None:
            self.first_problem = message


def _sample_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " ", "\t"):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end]


def _collect(lines: Iterable[str]) -> _Samples:
    found = _Samples()
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        family = _WANTED.get(_sample_name(line))
        if family is None:
            continue  # someone else's series, histogram buckets, garbage: not ours to judge
        try:
            samples = [s for f in text_string_to_metric_families(line + "\n") for s in f.samples]
        except Exception as exc:  # the parser raises ValueError, IndexError, ... on malformed lines
            found.problem(f"line {number}: {type(exc).__name__}: {exc}")
            continue
        for sample in samples:
            if not math.isfinite(sample.value):
                found.problem(f"line {number}: {sample.name} is {sample.value}")
                continue
            found.values.setdefault(family, []).append(sample.value)
            if "engine" in sample.labels:
                found.engines.add(sample.labels["engine"])
            if "model_name" in sample.labels:
                found.models.add(sample.labels["model_name"])
    return found


def parse_signals(text: str | bytes) -> EngineSignals:
    """Read an exposition page; raises :class:`MetricsParseError` if no scheduling series is on it."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    found = _collect(text.splitlines())
    old: list[str] = []

    def pick(new: str, previous: str | None = None) -> list[float] | None:
        if new in found.values:
            return found.values[new]
        if previous is not None and previous in found.values:
            old.append(previous)
            return found.values[previous]
        return None

    running, waiting = pick(RUNNING), pick(WAITING)
    usage = pick(KV_USAGE, KV_USAGE_OLD)
    queries = pick(PREFIX_QUERIES, PREFIX_QUERIES_OLD)
    hits = pick(PREFIX_HITS, PREFIX_HITS_OLD)
    if running is None and waiting is None and usage is None:
        detail = f"; first problem: {found.first_problem}" if found.first_problem else ""
        raise MetricsParseError(
            f"no {RUNNING}, {WAITING} or {KV_USAGE} samples on the page ({len(text)} characters){detail}"
        )
    return EngineSignals(
        running=None if running is None else round(sum(running)),
        waiting=None if waiting is None else round(sum(waiting)),
        # A fraction by definition; clamping keeps one odd sample from skewing a score.
        kv_cache_usage=None if usage is None else min(1.0, max(0.0, max(usage))),
        prefix_cache_queries=None if queries is None else sum(queries),
        prefix_cache_hits=None if hits is None else sum(hits),
        engines=tuple(sorted(found.engines, key=_engine_order)),
        model_names=tuple(sorted(found.models)),
        old_names=tuple(old),
        bad_lines=found.bad_lines,
        first_problem=found.first_problem,
    )


def _engine_order(engine: str) -> tuple[int, str]:
    """Numeric ranks in numeric order ("2" before "10"), anything else after, by name."""
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)
