"""Turn one engine ``/metrics`` page (Prometheus text exposition) into the load signals the router uses.

Two engines' names are read, vLLM's (``vllm:``) and SGLang's (``sglang:``), whichever the page has.
Only a handful of series matter for scheduling (running and waiting requests, KV-cache usage, the
prefix-cache counters), so lines are filtered by metric name before any parsing: an engine exposing
hundreds of histogram buckets costs a string prefix check per line, and a line we cannot read only
matters if it is one of ours. Each kept line is parsed on its own (``name{labels} value
[timestamp]``, escaped label values, NaN and +Inf), so one bad line drops that sample rather than
the whole page. Scraping a fleet parses a thousand pages a second, so both steps stay in C where
they can: one regular expression finds the lines that start with a wanted name (a page of 240
lines holds ~7: the engine's histogram buckets are never split off or looked at), and a kept line
is read with two small ones instead of ``prometheus_client``'s parser, which built metric objects
and validated names at ~20 µs a line. A 28 kB SGLang page: 330 µs with that parser, 125 with a
Python loop over every line, ~55 now (``bench/results/fleet.md``).

Data-parallel ranks: vLLM labels every series with ``engine`` (the rank as a string), SGLang with
``dp_rank`` when it runs several. Counts and counters are summed over ranks; usage is the fullest
rank's (a request lands on one rank; the fullest one is the one that preempts first). SGLang may
export one copy of a scheduler gauge per tensor- or pipeline-parallel rank
(``--enable-metrics-for-all-schedulers``): copies within one DP rank count once (the largest).

vLLM's old names (<= 0.11) are used only when the new name is absent from the page:
``vllm:gpu_cache_usage_perc`` for ``vllm:kv_cache_usage_perc`` and
``vllm:gpu_prefix_cache_{queries,hits}`` for ``vllm:prefix_cache_{queries,hits}``.

SGLang's equivalents (0.5): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage`` (the fullest memory pool's usage), and the counters
``sglang:prompt_tokens_total`` and ``sglang:cached_tokens_total`` (prompt tokens served from the
cache; only ``cache_source="device"``, the GPU, counts as a hit, as vLLM's counter counts).
Under OpenMetrics SGLang's names read ``sglang_...``; both spellings are accepted.

Both engines' ``time_to_first_token_seconds`` and ``inter_token_latency_seconds`` histograms are
read for their ``_sum`` and ``_count`` only (running totals over all ranks), which profile
calibration compares with our predictions (:mod:`extproc.scheduling.calibration`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from extproc.scheduling.engine_signals import EngineSignals
from extproc.types import EngineKind

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_QUERIES_OLD = "vllm:gpu_prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_hits"

SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"
SGLANG_PROMPT_TOKENS = "sglang:prompt_tokens"
SGLANG_CACHED_TOKENS = "sglang:cached_tokens"
#: The time-to-first-token histogram's running totals (both engines use this name), for calibration.
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"
SGLANG_TTFT_SUM = "sglang:time_to_first_token_seconds_sum"
SGLANG_TTFT_COUNT = "sglang:time_to_first_token_seconds_count"
#: ... and the inter-token latency histogram's: every decoding sequence's wait for its next token.
ITL_SUM = "vllm:inter_token_latency_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"
SGLANG_ITL_SUM = "sglang:inter_token_latency_seconds_sum"
SGLANG_ITL_COUNT = "sglang:inter_token_latency_seconds_count"
_HISTOGRAM_TOTALS = (
    *(TTFT_SUM, TTFT_COUNT, SGLANG_TTFT_SUM, SGLANG_TTFT_COUNT),
    *(ITL_SUM, ITL_COUNT, SGLANG_ITL_SUM, SGLANG_ITL_COUNT),
)

_GAUGES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD, SGLANG_RUNNING, SGLANG_WAITING, SGLANG_KV_USAGE)
_COUNTERS = (
    *(PREFIX_QUERIES, PREFIX_QUERIES_OLD, PREFIX_HITS, PREFIX_HITS_OLD),
    *(SGLANG_PROMPT_TOKENS, SGLANG_CACHED_TOKENS),
)

#: Exposed sample name -> the family it belongs to. ``prometheus_client`` exposes counters with a
#: ``_total`` suffix; OpenMetrics-less exporters may not, so both spellings are accepted, and
#: SGLang's ``sglang:`` names may read ``sglang_`` (OpenMetrics has no colons).
_WANTED: dict[str, str] = {name: name for name in _GAUGES}
_WANTED.update({f"{name}_total": name for name in _COUNTERS})
_WANTED.update({name: name for name in _COUNTERS})
_WANTED.update({name: name for name in _HISTOGRAM_TOTALS})
_WANTED.update({name.replace("sglang:", "sglang_"): family for name, family in list(_WANTED.items())})

#: A line (after the newline before it, and blanks) starting with a wanted sample name, whole.
#: The names share a few heads (``vllm:``, ``sglang:``/``sglang_``), factored out so the engine
#: tries one short alternation at each line start instead of ~40 names.
_VLLM_TAILS = sorted((n[len("vllm:") :] for n in _WANTED if n.startswith("vllm:")), key=len, reverse=True)
_SGLANG_TAILS = sorted(
    {n[len("sglang:") :] for n in _WANTED if n.startswith("sglang")}, key=len, reverse=True
)
assert len(_WANTED) == len(_VLLM_TAILS) + 2 * len(_SGLANG_TAILS)
_VLLM_NAMES = "|".join(map(re.escape, _VLLM_TAILS))
_SGLANG_NAMES = "|".join(map(re.escape, _SGLANG_TAILS))
_WANTED_LINE = re.compile(
    rf"\n[ \t]*(?:vllm:(?:{_VLLM_NAMES})|sglang[:_](?:{_SGLANG_NAMES}))(?=[{{ \t\r\n]|$)[^\n]*"
)
#: One ``name="value"`` pair inside braces, then its separator (a comma, or nothing before ``}``).
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"[ \t]*(,?)')
_ESCAPED = re.compile(r"\\(.)")
#: ``{a="x",b="y"} value`` as engines render it (no escapes, blanks or timestamp): the fast path;
#: anything else goes through the lenient reader.
_SIMPLE_SAMPLE = re.compile(
    r'\{((?:[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*",)*[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*")\} (\S+)'
)
_SIMPLE_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"')

#: The label naming a sample's data-parallel rank, per engine.
_RANK_LABELS = ("engine", "dp_rank")
#: Labels telling copies of one rank's series apart (SGLang, one per TP/PP rank when asked).
_COPY_LABELS = ("tp_rank", "pp_rank")


class MetricsParseError(ValueError):
    """The page holds none of the engine series we schedule on (not vLLM or SGLang, or no metrics page)."""


@dataclass(slots=True)
class _Samples:
    #: family -> (DP rank, copy) -> the sum of its samples.
    values: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    engines: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    bad_lines: int = 0
    first_problem: str | None = None

    def problem(self, message: str) -> None:
        self.bad_lines += 1
        if self.first_problem is None:
            self.first_problem = message

    def per_rank(self, family: str) -> list[float] | None:
        """The family's value on each DP rank (copies of one rank count once: the largest)."""
        by_copy = self.values.get(family)
        if by_copy is None:
            return None
        ranks: dict[str, float] = {}
        for (rank, _copy), value in by_copy.items():
            ranks[rank] = max(ranks.get(rank, value), value)
        return list(ranks.values())


def _sample_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " ", "\t"):
        at = line.find(stop)
        if 0 <= at < end:
            end = at
    return line[:end]


def _unescape(match: re.Match[str]) -> str:
    """The exposition format's three escapes; any other backslash stays, as prometheus_client keeps it."""
    char = match.group(1)
    if char == "n":
        return "\n"
    return char if char in '\\"' else match.group(0)


def parse_sample(line: str, name_end: int) -> tuple[dict[str, str], float]:
    """The labels and value of one exposition line (``name{labels} value [timestamp]``) whose name
    ends at ``name_end``; ValueError saying what is malformed.

    As lenient as ``prometheus_client``'s parser where it is lenient (a leading comma in the braces,
    no blank after them, fields between the value and the timestamp), and strict where it is (a
    label named twice, a timestamp that is not a number)."""
    simple = _SIMPLE_SAMPLE.fullmatch(line, name_end)
    if simple is not None:  # the engines' own rendering: one regex, no loop over labels
        pairs = _SIMPLE_PAIR.findall(simple.group(1))
        labels = dict(pairs)
        if len(labels) == len(pairs):
            return labels, _number(simple.group(2))
    labels = {}
    pos = name_end
    while line.startswith((" ", "\t"), pos):
        pos += 1
    if line.startswith("{", pos):
        pos += 1
        while line.startswith((" ", "\t"), pos):
            pos += 1
        if line.startswith(",", pos):
            pos += 1
        while True:
            while line.startswith((" ", "\t"), pos):
                pos += 1
            if line.startswith("}", pos):
                pos += 1
                break
            pair = _LABEL.match(line, pos)
            if pair is None:
                raise ValueError(f"malformed label at column {pos + 1}")
            name, value = pair.group(1), pair.group(2)
            if name in labels:
                raise ValueError(f"label {name!r} given twice")
            labels[name] = _ESCAPED.sub(_unescape, value) if "\\" in value else value
            pos = pair.end()
            if not pair.group(3):  # no comma: the braces must close here
                if not line.startswith("}", pos):
                    raise ValueError(f"expected ',' or '}}' at column {pos + 1}")
                pos += 1
                break
    elif pos == name_end and pos < len(line):
        raise ValueError(f"unexpected {line[pos]!r} after the name")
    fields = line[pos:].split()
    if not fields:
        raise ValueError("expected a value after the name and labels")
    if len(fields) > 1:
        _number(fields[-1])  # the timestamp: unused, but a line with a broken one is broken
    return labels, _number(fields[0])


def _number(text: str) -> float:
    """A sample's value or timestamp: Go's float syntax, which (unlike Python's) has no ``_``."""
    if "_" in text:
        raise ValueError(f"could not convert string to float: {text!r}")
    return float(text)


def _collect(text: str) -> _Samples:
    found = _Samples()
    page = "\n" + text  # the first line has a newline before it too
    for match in _WANTED_LINE.finditer(page):
        line = match.group().strip()
        name = _sample_name(line)
        family = _WANTED[name]
        try:
            labels, value = parse_sample(line, len(name))
        except ValueError as exc:
            found.problem(f"line {_line_number(page, match)}: ValueError: {exc}")
            continue
        if not math.isfinite(value):
            found.problem(f"line {_line_number(page, match)}: {name} is {value}")
            continue
        if family == SGLANG_CACHED_TOKENS and labels.get("cache_source", "device") != "device":
            continue  # a host or storage hit still loads the prefix: not a GPU prefix hit
        rank = next((labels[k] for k in _RANK_LABELS if k in labels), "")
        if rank:
            found.engines.add(rank)
        copy = "/".join(labels.get(k, "") for k in _COPY_LABELS)
        by_copy = found.values.setdefault(family, {})
        by_copy[rank, copy] = by_copy.get((rank, copy), 0.0) + value
        if "model_name" in labels:
            found.models.add(labels["model_name"])
    return found


def _line_number(page: str, match: re.Match[str]) -> int:
    """The 1-based line of ``page`` (the text behind one leading newline) a match starts on."""
    return page.count("\n", 0, match.start() + 1)


def parse_signals(text: str | bytes) -> EngineSignals:
    """Read an exposition page; raises :class:`MetricsParseError` if no scheduling series is on it."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    found = _collect(text)
    old: list[str] = []

    def pick(*names: str, fallback: str | None = None) -> list[float] | None:
        for name in names:
            values = found.per_rank(name)
            if values is not None:
                return values
        if fallback is not None and (values := found.per_rank(fallback)) is not None:
            old.append(fallback)
            return values
        return None

    running, waiting = pick(RUNNING, SGLANG_RUNNING), pick(WAITING, SGLANG_WAITING)
    usage = pick(KV_USAGE, SGLANG_KV_USAGE, fallback=KV_USAGE_OLD)
    queries = pick(PREFIX_QUERIES, SGLANG_PROMPT_TOKENS, fallback=PREFIX_QUERIES_OLD)
    hits = pick(PREFIX_HITS, SGLANG_CACHED_TOKENS, fallback=PREFIX_HITS_OLD)
    if queries is not None and hits is None and SGLANG_PROMPT_TOKENS in found.values:
        hits = [0.0]  # SGLang exports no cached-tokens sample until its first hit
    ttft_sum, ttft_count = pick(TTFT_SUM, SGLANG_TTFT_SUM), pick(TTFT_COUNT, SGLANG_TTFT_COUNT)
    itl_sum, itl_count = pick(ITL_SUM, SGLANG_ITL_SUM), pick(ITL_COUNT, SGLANG_ITL_COUNT)
    if running is None and waiting is None and usage is None:
        detail = f"; first problem: {found.first_problem}" if found.first_problem else ""
        raise MetricsParseError(
            f"no {RUNNING}, {WAITING} or {KV_USAGE} samples on the page (nor SGLang's {SGLANG_RUNNING}, "
            f"{SGLANG_WAITING} or {SGLANG_KV_USAGE}; {len(text)} characters){detail}"
        )
    kinds: set[EngineKind] = {"sglang" if family.startswith("sglang:") else "vllm" for family in found.values}
    return EngineSignals(
        engine_kind=next(iter(kinds)) if len(kinds) == 1 else None,
        running=None if running is None else round(sum(running)),
        waiting=None if waiting is None else round(sum(waiting)),
        # A fraction by definition; clamping keeps one odd sample from skewing a score.
        kv_cache_usage=None if usage is None else min(1.0, max(0.0, max(usage))),
        prefix_cache_queries=None if queries is None else sum(queries),
        prefix_cache_hits=None if hits is None else sum(hits),
        ttft_seconds_sum=None if ttft_sum is None or ttft_count is None else sum(ttft_sum),
        ttft_count=None if ttft_sum is None or ttft_count is None else sum(ttft_count),
        itl_seconds_sum=None if itl_sum is None or itl_count is None else sum(itl_sum),
        itl_count=None if itl_sum is None or itl_count is None else sum(itl_count),
        engines=tuple(sorted(found.engines, key=_engine_order)),
        model_names=tuple(sorted(found.models)),
        old_names=tuple(old),
        bad_lines=found.bad_lines,
        first_problem=found.first_problem,
    )


def _engine_order(engine: str) -> tuple[int, str]:
    """Numeric ranks in numeric order ("2" before "10"), anything else after, by name."""
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)
