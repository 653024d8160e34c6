"""NVIDIA Dynamo's real KV router on the trace our replay plays: a row to compare ours with.

Dynamo's offline mocker replay (``dynamo._core.run_mocker_trace_replay``, PyPI
``ai-dynamo-runtime==1.6.1``, no GPU) plays the same Mooncake rows on 8 mocker workers with the same
KV capacity as our replay's engines (24,000 blocks of 16 tokens each). Round-robin runs on both
simulators as the cross-check: with matched capacity their prefix reuse must agree. Dynamo's
``kv_router`` varies from run to run, so it runs ``--runs`` times and the report gives the range and
compares ours against its best.

Not matched: engine speed. Dynamo's mocker has its own latency model (its TTFTs are ~3x shorter than
our simulator's at these settings) and is not capped at 512 output tokens, so TTFTs are shown but
not compared; hit rates are.

Dynamo is an optional dependency of this bench only; install it into any Python (its own venv is
fine, it needs nothing of ours) and run from the repo root:

    python -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime==1.6.1
    /tmp/dyn/bin/python bench/dynamo_replay.py [--rows 3000] [--runs 3]

Ours comes from recorded runs on the same rows: by default the offline replay
(``bench/results/replay_offline.json``); pass one per seed (``python -m bench.replay --offline
--seed N --out ...``) to show our range too. Writes ``bench/results/dynamo_replay.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from machine import machine, provenance, record

HERE = Path(__file__).resolve().parent
TRACE = HERE.parents[1] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
ENGINE = {"block_size": 16, "num_gpu_blocks": 24_000}
WORKERS = 8
#: Mooncake's hash ids stand for blocks of this many tokens.
TRACE_BLOCK = 512


def dynamo_run(trace: Path, mode: str) -> dict[str, Any]:
    from dynamo._core import run_mocker_trace_replay  # optional: only this bench needs it

    started = time.monotonic()
    result = run_mocker_trace_replay(
        [str(trace)],
        num_workers=WORKERS,
        router_mode=mode,
        trace_block_size=TRACE_BLOCK,
        replay_mode="offline",
        extra_engine_args={"engine": ENGINE},
    )
    summary = result.summary
    return {
        "router_mode": mode,
        "prefix_reuse": summary["prefix_cache_reused_ratio"],
        "ttft_mean_s": summary["mean_ttft_ms"] / 1000,
        "ttft_p99_s": summary["p99_ttft_ms"] / 1000,
        "completed": summary["completed_requests"],
        "wall_s": time.monotonic() - started,
    }


def ours(paths: list[Path], rows: int) -> dict[str, list[float]]:
    """Our hit rates per policy on the same rows, from recorded runs of ours: offline replays
    (``bench.replay --offline``, one per seed) or the vLLM rounds of ``engine_kinds.json``."""
    found: dict[str, list[float]] = {}
    for path in paths:
        if not path.is_file():
            continue
        recorded = json.loads(path.read_text())
        if recorded["trace"]["requests"] != rows or recorded["trace"]["first_row"] != 0:
            continue
        if "arms" in recorded:  # a replay result
            for arm in recorded["arms"]:
                found.setdefault(arm["summary"]["policy"], []).append(arm["summary"]["hit_rate"])
            continue
        for run in recorded["runs"]:
            if run["engine_kind"] == "vllm" and run["valid"]:
                found.setdefault(run["policy"], []).append(run["hit_rate"])
    return found


def report(results: dict[str, Any]) -> str:
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in results["dynamo"]:
        by_mode.setdefault(run["router_mode"], []).append(run)
    lines = [
        "# Routing quality: Dynamo's real KV router on the same trace",
        "",
        f"{provenance(results['machine'])}; ai-dynamo-runtime {results['dynamo_version']}.",
        "",
        f"Trace `{TRACE.name}` rows 0-{results['rows'] - 1}; {WORKERS} workers of "
        f"{ENGINE['num_gpu_blocks']:,} x {ENGINE['block_size']}-token KV blocks on both simulators. Engine "
        "speed is not matched (Dynamo's mocker has its own latency model and no 512-token output cap), "
        "so its TTFTs are shown for reference only; prefix reuse (hit rate) is compared.",
        "",
        "| router | runs | prefix reuse (hit rate) | TTFT mean s (its own engine model) |",
        "|---|--:|--:|--:|",
    ]
    for mode, runs in by_mode.items():
        hits = [r["prefix_reuse"] for r in runs]
        ttft = statistics.fmean(r["ttft_mean_s"] for r in runs)
        span = f"{min(hits):.2%}" if len(runs) == 1 else f"{min(hits):.2%} - {max(hits):.2%}"
        lines.append(f"| Dynamo {mode} | {len(runs)} | {span} | {ttft:.3f} |")
    for policy, hits in results["ours"].items():
        span = f"{min(hits):.2%}" if len(hits) == 1 else f"{min(hits):.2%} - {max(hits):.2%}"
        lines.append(f"| ours: {policy} | {len(hits)} | {span} | (our engine model: `replay_offline.md`) |")
    if results.get("ours_from"):
        lines += ["", f"Ours from: {', '.join(f'`{p}`' for p in results['ours_from'])}."]
    best = max((r["prefix_reuse"] for r in by_mode.get("kv_router", [])), default=None)
    mine = results["ours"].get("ours (predicted-ttft)")
    rr_dyn = [r["prefix_reuse"] for r in by_mode.get("round_robin", [])]
    rr_ours = results["ours"].get("round-robin")
    lines.append("")
    if rr_dyn and rr_ours:
        lines.append(
            f"Cross-check: round-robin reuse {statistics.fmean(rr_dyn):.2%} on Dynamo's mocker against "
            f"{statistics.fmean(rr_ours):.2%} on ours: the two caches agree."
        )
    if best is not None and mine:
        lines.append(
            f"Ours (predicted-ttft, mean {statistics.fmean(mine):.2%}) against Dynamo kv_router's best run "
            f"({best:.2%}): **{statistics.fmean(mine) / best:.2f}x**."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3000, help="first rows of the trace (3000)")
    parser.add_argument("--runs", type=int, default=3, help="kv_router runs (3)")
    parser.add_argument(
        "--ours",
        type=Path,
        nargs="+",
        default=[HERE / "results" / "replay_offline.json"],
        help="our recorded runs on the same rows: offline replays (one per seed) or engine_kinds.json",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "dynamo_replay.json")
    args = parser.parse_args()
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        sys.exit(
            "Dynamo is not installed here: pip install ai-dynamo-runtime==1.6.1 (see this file's docstring)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "rows.jsonl"
        with TRACE.open() as source:
            trace.write_text("".join(line for _, line in zip(range(args.rows), source, strict=False)))
        runs = [dynamo_run(trace, "round_robin")] + [dynamo_run(trace, "kv_router") for _ in range(args.runs)]
    results = {
        "machine": machine(),
        "dynamo_version": version("ai-dynamo-runtime"),
        "rows": args.rows,
        "engine": ENGINE,
        "workers": WORKERS,
        "dynamo": runs,
        "ours": ours(args.ours, args.rows),
        "ours_from": [
            str(p.relative_to(HERE.parent)) if p.is_relative_to(HERE.parent) else str(p) for p in args.ours
        ],
    }
    record(args.out, results, report)


if __name__ == "__main__":
    main()
