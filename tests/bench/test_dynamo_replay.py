"""The Dynamo comparison's matching: its engines get our step model, and only like runs compare."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The benchmarks are not an installed package (see test_replay_trace); dynamo_replay runs as a script
# from bench/, so its sibling imports need bench/ itself on the path too.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import numpy
import pytest

from bench import dynamo_replay
from bench.dynamo_replay import Mismatch, load_ours, timing_profile

PARAMS: dict[str, Any] = {
    "block_size": 16,
    "num_gpu_blocks": 24000,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "max_model_len": 131072,
    "prefill_tokens_per_s": 16000.0,
    "decode_base_s": 0.006,
    "decode_per_seq_s": 0.00015,
    "cpu_offload_blocks": 0,
}


def _bilinear(xs: numpy.ndarray, ys: numpy.ndarray, table: numpy.ndarray, x: float, y: float) -> float:
    """What the mocker's bilinear interpolator reads off the table (inside the grid)."""
    i = int(numpy.clip(numpy.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    j = int(numpy.clip(numpy.searchsorted(ys, y) - 1, 0, len(ys) - 2))
    tx = (x - xs[i]) / (xs[i + 1] - xs[i])
    ty = (y - ys[j]) / (ys[j + 1] - ys[j])
    low = table[i, j] * (1 - tx) + table[i + 1, j] * tx
    high = table[i, j + 1] * (1 - tx) + table[i + 1, j + 1] * tx
    return float(low * (1 - ty) + high * ty)


def test_the_mockers_timing_tables_reproduce_our_step_model(tmp_path: Path) -> None:
    path = tmp_path / "timing.npz"
    timing_profile(PARAMS, path)
    tables = numpy.load(path)
    # Prefill: linear in new tokens, read by linear interpolation.
    isl, ttft = tables["prefill_isl"], tables["prefill_ttft_ms"]
    for tokens in (512, 8192, 90_000):
        assert numpy.interp(tokens, isl, ttft) == pytest.approx(1000 * tokens / 16000)
    # Decode: base + per-seq x seqs, where the mocker gives active KV tokens and the mean context.
    active, context, itl = (
        tables["decode_active_kv_tokens"],
        tables["decode_context_length"],
        tables["decode_itl"],
    )
    for seqs in (1, 3, 17, 60):
        for ctx in (600, 4_000, 13_000, 100_000):
            if seqs * ctx > PARAMS["num_gpu_blocks"] * PARAMS["block_size"]:
                continue  # more than the pool holds: never asked
            ours = 1000 * (0.006 + 0.00015 * seqs)
            assert _bilinear(active, context, itl, seqs * ctx, ctx) == pytest.approx(ours, rel=0.01)


def _recorded(
    path: Path, trace: Path, *, rows: int = 2, output_cap: int = 512, mode: str = "offline: virtual time"
) -> Path:
    requests = [
        {"index": 0, "ttft_wall_s": 0.5, "engine_cached": 0},
        {"index": 1, "ttft_wall_s": 0.3, "engine_cached": 1600},
    ]
    summary = {"policy": "ours (predicted-ttft)", "hit_rate": 0.1, "ttft_mean_s": 0.4, "ttft_p99_s": 0.5}
    path.write_text(
        json.dumps(
            {
                "trace": {"path": str(trace), "requests": rows, "first_row": 0},
                "config": {"mode": mode, "engines": 8, "output_cap": output_cap, "engine_params": PARAMS},
                "arms": [{"summary": summary, "raw": {"requests": requests}}],
            }
        )
    )
    return path


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": 0, "input_length": n, "output_length": 10, "hash_ids": [1]}) + "\n"
            for n in (4000, 3200)
        )
    )
    return path


def test_our_runs_give_each_requests_wait_beyond_its_own_prefill(tmp_path: Path, trace: Path) -> None:
    ours = load_ours([_recorded(tmp_path / "a.json", trace)])
    (summary,) = ours["policies"]["ours (predicted-ttft)"]
    # 4000 uncached tokens take 0.25 s at 16k tok/s: 0.25 s of the 0.5 s TTFT is waiting; 1600 take 0.1 s.
    assert summary["wait_mean_s"] == pytest.approx((0.25 + 0.2) / 2)
    assert summary["wait_p99_s"] == pytest.approx(0.25)
    assert ours["rows"] == 2 and ours["output_cap"] == 512


def test_runs_of_different_setups_or_modes_do_not_compare(tmp_path: Path, trace: Path) -> None:
    first = _recorded(tmp_path / "a.json", trace)
    with pytest.raises(Mismatch, match="output cap differ"):
        load_ours([first, _recorded(tmp_path / "b.json", trace, output_cap=256)])
    with pytest.raises(Mismatch, match="not an offline replay"):
        load_ours([_recorded(tmp_path / "c.json", trace, mode="online")])
    with pytest.raises(Mismatch, match="no recorded run"):
        load_ours([])


def test_an_azure_trace_reaches_the_mocker_as_mooncake_rows_of_unshared_blocks(tmp_path: Path) -> None:
    """The Azure traces have no prefix information: each prompt gets blocks no other row has, and the
    answers are capped as our replay caps them."""
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,1025,44\n"
        "2023-11-16 18:15:47.1805900,10,900"
    )
    ours = load_ours([_recorded(tmp_path / "a.json", azure)])
    assert ours["policies"]["ours (predicted-ttft)"][0]["wait_mean_s"] == pytest.approx(
        ((0.5 - 1025 / 16000) + (0.3 - (10 - 1600) / 16000)) / 2
    )
    rows = tmp_path / "rows.jsonl"
    dynamo_replay.write_rows(rows, azure, 2, output_cap=512)
    written = [json.loads(line) for line in rows.read_text().splitlines()]
    assert written == [
        {"timestamp": 0.0, "input_length": 1025, "output_length": 44, "hash_ids": [0, 1, 2]},
        {"timestamp": 500.0, "input_length": 10, "output_length": 512, "hash_ids": [3]},
    ]


def test_a_recorded_trace_path_that_is_gone_is_found_among_the_shared_traces() -> None:
    found = dynamo_replay.trace_file("/elsewhere/mooncake_conversation_trace.jsonl")
    assert found == dynamo_replay.TRACES / "mooncake_conversation_trace.jsonl"


def test_a_trace_without_shared_prefixes_compares_latency_only() -> None:
    """Hit rates of 0 on both sides are reported as such (no ratio of zeros), and each router's
    TTFT is also set against its own simulator's round-robin."""
    run = {"hit_rate": 0.0, "wait_mean_s": 0.01, "wait_p99_s": 0.02, "ttft_p50_s": 0.1}
    results = {
        "dynamo": [
            {**run, "router_mode": "round_robin", "ttft_mean_s": 0.2, "ttft_p99_s": 1.0},
            {**run, "router_mode": "kv_router", "ttft_mean_s": 0.18, "ttft_p99_s": 0.8},
        ],
        "ours": {
            "policies": {
                "round-robin": [{**run, "ttft_mean_s": 0.25, "ttft_p99_s": 1.0}],
                "ours (predicted-ttft)": [{**run, "ttft_mean_s": 0.2, "ttft_p99_s": 0.7}],
            }
        },
    }
    assert "hit rate 0.00% against 0.00% (equal)" in dynamo_replay.cross_check(results)[0]
    lines = dynamo_replay.verdicts(results)
    assert lines[0] == "- Hit rate: ours 0.00%, Dynamo's 0 in every run: no prompt shares a prefix."
    assert "mean TTFT: ours 0.200 s (worst of 1) against Dynamo's best 0.180 s: **not lower**" in lines[1]
    assert lines[-1] == (
        "- Against each simulator's own round-robin (lower is better): "
        "mean TTFT ours 0.800, Dynamo's best 0.900; p99 TTFT ours 0.700, Dynamo's best 0.800."
    )
