"""Parsing vLLM's /metrics page into per-endpoint load signals."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from extproc.engines.metrics_page import MetricsParseError, parse_signals
from extproc.sim.metrics import RankStats, SimMetrics

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def rank(engine: str, running: int, waiting: int, usage: float, queries: int, hits: int) -> RankStats:
    return RankStats(engine, running, waiting, usage, queries, hits, 0, queries, 7)


def sim_page(*ranks: RankStats) -> bytes:
    metrics = SimMetrics(model_name=MODEL, stats=lambda: ranks, cache_config={"block_size": "16"})
    for stats in ranks:  # histograms and counters around ours, as a real page has
        metrics.observe_first_token(stats.engine, ttft=0.02, queue_time=0.001)
        metrics.observe_finished(stats.engine, e2e=0.5, finish_reason="length")
    return generate_latest(metrics.registry)


def test_simulator_page_with_two_dp_ranks() -> None:
    """Counts and counters are summed over ranks, usage is the fullest rank's, ranks are listed."""
    page = sim_page(rank("0", 2, 1, 0.25, 100, 40), rank("1", 3, 0, 0.5, 60, 20))
    signals = parse_signals(page)
    assert (signals.running, signals.waiting, signals.kv_cache_usage) == (5, 1, 0.5)
    assert (signals.prefix_cache_queries, signals.prefix_cache_hits) == (160.0, 60.0)
    assert signals.engines == ("0", "1") and signals.data_parallel_size == 2
    assert signals.model_names == (MODEL,)
    assert signals.old_names == () and signals.bad_lines == 0


def test_a_page_reads_the_same_with_crlf_line_ends_indents_and_our_series_first_or_last() -> None:
    """Where a line starts and ends does not depend on the page's first line, CRLF ends, or
    blanks before a name (all legal to write, none in the engines' own pages)."""
    page = sim_page(rank("0", 2, 1, 0.25, 100, 40), rank("1", 3, 0, 0.5, 60, 20))
    want = parse_signals(page)
    lines = page.decode().splitlines()
    ours = [line for line in lines if line.startswith("vllm:num_requests_running")]
    rest = [line for line in lines if line not in ours]
    for variant in (
        page.replace(b"\n", b"\r\n"),
        "\n".join([*ours, *rest]).encode(),
        "\n".join([*rest, *ours]).encode(),
        "\n".join(f"  {line}" if line in ours else line for line in lines).encode(),
    ):
        assert parse_signals(variant) == want


def test_idle_single_rank_reports_zeros_not_unknown() -> None:
    signals = parse_signals(sim_page(rank("0", 0, 0, 0.0, 0, 0)))
    assert (signals.running, signals.waiting, signals.kv_cache_usage) == (0, 0, 0.0)
    assert signals.prefix_cache_hits == 0.0 and signals.data_parallel_size == 1


OLD_PAGE = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m\"x\\y"} 4.0
vllm:num_requests_running{engine="1",model_name="m\"x\\y"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m\"x\\y"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m\"x\\y"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m\"x\\y"} 0.75
vllm:gpu_cache_usage_perc{engine="1",model_name="m\"x\\y"} 0.125
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m\"x\\y"} 1000.0
vllm:gpu_prefix_cache_queries_created{engine="0",model_name="m\"x\\y"} 1.7e9
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m\"x\\y"} 250.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m\"x\\y"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m\"x\\y"} NaN
"""


def test_vllm_0_10_page_falls_back_to_old_names() -> None:
    """A 0.10-era page (gpu_* names) still gives usage and prefix counters, and says so."""
    signals = parse_signals(OLD_PAGE)
    assert (signals.running, signals.waiting, signals.kv_cache_usage) == (5, 2, 0.75)
    assert (signals.prefix_cache_queries, signals.prefix_cache_hits) == (1000.0, 250.0)
    assert signals.model_names == ('m"x\\y',) and signals.engines == ("0", "1")
    assert set(signals.old_names) == {
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_queries",
        "vllm:gpu_prefix_cache_hits",
    }
    # The TTFT histogram's sum is read (for calibration): a NaN one is left out, and said so.
    assert signals.bad_lines == 1 and "time_to_first_token_seconds_sum is nan" in (
        signals.first_problem or ""
    )
    assert signals.ttft_seconds_sum is None and signals.ttft_count is None


def test_latency_totals_are_summed_over_ranks_for_calibration() -> None:
    page = (
        'vllm:num_requests_running{engine="0"} 1\n'
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 2.5\n'
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 5\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3\n'
        'vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.25\n'
        'vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 40\n'
    )
    signals = parse_signals(page)
    assert (signals.ttft_seconds_sum, signals.ttft_count) == (4.0, 8.0)
    assert (signals.itl_seconds_sum, signals.itl_count) == (0.25, 40.0)
    sglang = parse_signals(
        "sglang:num_running_reqs 2\n"
        'sglang_time_to_first_token_seconds_sum{model_name="m"} 0.5\n'
        'sglang_time_to_first_token_seconds_count{model_name="m"} 2\n'
    )
    assert (sglang.ttft_seconds_sum, sglang.ttft_count) == (0.5, 2.0)
    assert sglang.itl_seconds_sum is None  # a sum without its count is no total


def test_new_names_win_when_both_are_exposed() -> None:
    """vLLM 0.11 shows both (old behind a flag); the new one is the truth."""
    page = OLD_PAGE + 'vllm:kv_cache_usage_perc{engine="0"} 0.5\nvllm:prefix_cache_hits_total 9\n'
    signals = parse_signals(page)
    assert signals.kv_cache_usage == 0.5 and signals.prefix_cache_hits == 9.0
    assert signals.old_names == ("vllm:gpu_prefix_cache_queries",)


def test_bad_lines_of_ours_are_dropped_and_counted() -> None:
    """Garbage elsewhere is ignored; a broken or non-finite sample of ours is left out and reported."""
    page = "\n".join(
        [
            "this is not prometheus at all",
            'vllm:num_requests_running{engine="0"} 3',
            'vllm:num_requests_running{engine="1"} three',
            'vllm:num_requests_waiting{engine="0"} +Inf',
            'vllm:kv_cache_usage_perc{engine="0" 0.2',
            'vllm:kv_cache_usage_perc{engine="1"} 1.5',
            "",
        ]
    )
    signals = parse_signals(page)
    assert signals.running == 3 and signals.waiting is None
    assert signals.kv_cache_usage == 1.0  # a fraction: clamped
    assert signals.bad_lines == 3 and signals.first_problem is not None
    assert signals.first_problem.startswith("line 3:")


@pytest.mark.parametrize(
    "page",
    [b"", b"<html><body>Not Found</body></html>", b"\xff\xfe\x00garbage", b"vllm:num_requests_running{"],
    ids=["empty", "html", "binary", "truncated"],
)
def test_a_page_without_our_series_is_a_clear_error(page: bytes) -> None:
    with pytest.raises(MetricsParseError, match="no vllm:num_requests_running"):
        parse_signals(page)


def test_numeric_ranks_sort_numerically() -> None:
    page = "".join(f'vllm:num_requests_running{{engine="{e}"}} 1\n' for e in ("10", "2", "0", "x"))
    assert parse_signals(page).engines == ("0", "2", "10", "x")


# -- SGLang -------------------------------------------------------------------------------------

SGLANG_MODEL = "Qwen/Qwen3-8B"


def sglang_page(
    ranks: dict[str | None, tuple[int, int, float]] | None = None,
    *,
    copies: tuple[str, ...] = ("0",),
    prompt_tokens: float = 1000.0,
    cached: dict[str, float] | None = None,
) -> bytes:
    """A /metrics page as SGLang 0.5 builds it with prometheus_client.

    Its scheduler gauges carry model_name, engine_type, tp_rank, pp_rank, moe_ep_rank, and dp_rank
    under DP (``ranks``: a dp_rank, or None, -> running, queued, usage), one copy per TP rank in
    ``copies``; the tokenizer manager's prompt and cached-token counters follow.
    """

    registry = CollectorRegistry()
    base = {"model_name": SGLANG_MODEL, "engine_type": "unified", "pp_rank": "0", "moe_ep_rank": "0"}
    per_rank = ranks or {None: (3, 500, 0.42)}
    names = [*base, "tp_rank", *(["dp_rank"] if any(dp is not None for dp in per_rank) else [])]
    running = Gauge("sglang:num_running_reqs", "The number of running requests.", names, registry=registry)
    queued = Gauge("sglang:num_queue_reqs", "Requests in the waiting queue.", names, registry=registry)
    usage = Gauge("sglang:token_usage", "The token usage.", names, registry=registry)
    for dp, (run, wait, use) in per_rank.items():
        for tp in copies:
            labels = {**base, "tp_rank": tp, **({} if dp is None else {"dp_rank": dp})}
            running.labels(**labels).set(run)
            queued.labels(**labels).set(wait)
            usage.labels(**labels).set(use)
    tokenizer_labels = {"model_name": SGLANG_MODEL, "engine_type": "unified"}
    prompts = Counter(
        "sglang:prompt_tokens", "Prefill tokens.", [*tokenizer_labels, "is_streaming"], registry=registry
    )
    prompts.labels(**tokenizer_labels, is_streaming="false").inc(prompt_tokens * 0.25)
    prompts.labels(**tokenizer_labels, is_streaming="true").inc(prompt_tokens * 0.75)
    hit_labels = [*tokenizer_labels, "cache_source"]
    hits = Counter("sglang:cached_tokens", "Cached prompt tokens.", hit_labels, registry=registry)
    for source, count in (cached if cached is not None else {"device": 600.0, "host": 100.0}).items():
        hits.labels(**tokenizer_labels, cache_source=source).inc(count)
    return generate_latest(registry)


def test_sglang_page_gives_the_same_signals_as_vllm_names_would() -> None:
    """A queue of 500 on an SGLang pod is seen (it was invisible: the page has no vllm: series)."""
    signals = parse_signals(sglang_page())
    assert (signals.running, signals.waiting, signals.kv_cache_usage) == (3, 500, 0.42)
    # Prompt tokens over both streaming kinds; only GPU ("device") hits count as prefix hits.
    assert (signals.prefix_cache_queries, signals.prefix_cache_hits) == (1000.0, 600.0)
    assert signals.model_names == (SGLANG_MODEL,) and signals.data_parallel_size == 1


def test_sglang_dp_ranks_are_summed_and_their_tp_copies_counted_once() -> None:
    """With --enable-metrics-for-all-schedulers each TP rank exports the same gauges: once per DP rank."""
    page = sglang_page({"0": (2, 10, 0.3), "1": (4, 0, 0.7)}, copies=("0", "1", "2", "3"))
    signals = parse_signals(page)
    assert (signals.running, signals.waiting, signals.kv_cache_usage) == (6, 10, 0.7)
    assert signals.engines == ("0", "1") and signals.data_parallel_size == 2


def test_sglang_page_under_openmetrics_names_and_before_any_cache_hit() -> None:
    page = sglang_page(cached={}).decode().replace("sglang:", "sglang_").encode()
    signals = parse_signals(page)
    assert (signals.running, signals.waiting) == (3, 500)
    assert (signals.prefix_cache_queries, signals.prefix_cache_hits) == (1000.0, 0.0)


def test_the_page_tells_which_engine_serves() -> None:
    """vLLM's names or SGLang's: the engine kind is read off the page (None when it mixes both)."""
    vllm = 'vllm:num_requests_running{engine="0",model_name="m"} 1\n'
    sglang = 'sglang:num_queue_reqs{engine_type="unified",model_name="m"} 2\n'
    assert parse_signals(vllm).engine_kind == "vllm"
    assert parse_signals(sglang).engine_kind == "sglang"
    assert parse_signals(vllm + sglang).engine_kind is None


@pytest.mark.parametrize(
    "line",
    [
        "vllm:num_requests_running 3",
        'vllm:num_requests_running{engine="0"} 3',
        'vllm:num_requests_running{engine="0",model_name="m"} 3.5 1712345678000',
        'vllm:num_requests_running{ engine = "0" , model_name="m" , } 3',
        'vllm:num_requests_running{model_name="a\\"b\\\\c\\nd"} 1e3',
        'vllm:num_requests_running{engine="0"} +Inf',
        'vllm:num_requests_running{engine="0"} -Inf',
        "vllm:num_requests_running{} 0",
        "vllm:num_requests_running\t7",
        'vllm:num_requests_running{le="+Inf",x="{}"} 2',
        'vllm:num_requests_running {engine="0"} 4',
        'vllm:num_requests_running{a="back\\slash \\x kept"} 5',
        'vllm:num_requests_running{,engine="0"} 6',
        'vllm:num_requests_running{engine="0"}7',
    ],
    ids=[
        *("bare", "label", "timestamp", "blanks", "escapes"),
        *("inf", "minus-inf", "empty-braces", "tab", "braces-in-value"),
        *("blank-before-braces", "unknown-escape", "leading-comma", "no-blank-after-braces"),
    ],
)
def test_a_sample_line_reads_as_prometheus_client_reads_it(line: str) -> None:
    """Our one-line reader agrees with prometheus_client's parser on every valid spelling."""
    from prometheus_client.parser import text_string_to_metric_families

    from extproc.engines.metrics_page import parse_sample

    [family] = text_string_to_metric_families(line + "\n")
    [theirs] = family.samples
    labels, value = parse_sample(line, len("vllm:num_requests_running"))
    assert labels == theirs.labels
    assert value == theirs.value


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('vllm:num_requests_running{engine="0" 3', "expected ',' or '}'"),
        ("vllm:num_requests_running{engine=0} 3", "malformed label"),
        ("vllm:num_requests_running", "expected a value"),
        ("vllm:num_requests_running three", "could not convert"),
        ("vllm:num_requests_running 3 12_000", "could not convert"),
        ('vllm:num_requests_running{a="1",a="2"} 3', "given twice"),
        ("vllm:num_requests_running3 4", "unexpected '3'"),
    ],
    ids=["unclosed", "unquoted", "no-value", "word", "underscore-timestamp", "label-twice", "glued"],
)
def test_a_malformed_sample_line_is_refused_saying_why(line: str, says: str) -> None:
    """Lines prometheus_client refuses are refused here too, with a message naming the fault."""
    from extproc.engines.metrics_page import parse_sample

    with pytest.raises(ValueError, match=re.escape(says)):
        parse_sample(line, len("vllm:num_requests_running"))
