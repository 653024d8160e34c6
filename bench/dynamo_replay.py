"""NVIDIA Dynamo's real KV router on the trace our replay plays: a row to compare ours with.

Dynamo's offline mocker replay (``dynamo._core.run_mocker_trace_replay``, PyPI
``ai-dynamo-runtime==1.6.1``, no GPU) plays the same Mooncake rows on 8 mocker workers matched to
the engines of our recorded replay:

- KV capacity, batch limits and model length: the same engine parameters;
- speed: the mocker's external timing model (an NPZ of prefill time by new tokens, and decode
  step time by active KV tokens and context length) is filled from our simulator's step model,
  ``decode_base_s + decode_per_seq_s x decode seqs + prefill tokens / prefill_tokens_per_s``, with
  decode seqs read as active KV tokens / mean context length;
- answers: the trace's output lengths are capped as ours were (``max_tokens``).

Round-robin runs on both simulators as the cross-check: with matched engines their hit rate and
their TTFTs must agree. Dynamo's ``kv_router`` varies from run to run, so it runs ``--runs`` times
and the report gives the range, comparing ours against its best run on each figure.

Dynamo is an optional dependency of this bench only; install it into any Python (its own venv is
fine, it needs nothing of ours but numpy for the timing file) and run from the repo root:

    python -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime==1.6.1 numpy==2.4.6
    /tmp/dyn/bin/python bench/dynamo_replay.py [--runs 3]
    /tmp/dyn/bin/python bench/dynamo_replay.py --ours bench/results/raw/replay_offline_full.json \
        --out bench/results/dynamo_replay_full.json

Ours comes from recorded offline replays (``python -m bench.replay --offline [--seed N] --out ...``):
the rows, the engines and the output cap are read from them (all must agree), by default
``bench/results/raw/replay_offline{,_seed2,_seed3}.json`` (3,000 rows; raw outputs are not
tracked: run those replays first). Writes
``bench/results/dynamo_replay.{json,md}`` unless ``--out`` says otherwise.
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
from replay.rows import TRACE_BLOCK, trace_rows

HERE = Path(__file__).resolve().parent
#: Where the shared traces are: a recorded run's trace is looked up here by name when its recorded
#: path does not exist (another checkout, another machine).
TRACES = HERE.parents[1] / "shared" / "traces"
#: Our engine parameters the mocker takes as they are.
SHARED_ENGINE_ARGS = (
    "block_size",
    "num_gpu_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
)
POLICY = "ours (predicted-ttft)"


class Mismatch(SystemExit):
    """Recorded runs of ours that cannot be compared with one Dynamo run (different rows or engines)."""


def load_ours(paths: list[Path]) -> dict[str, Any]:
    """Our recorded offline replays: their common setup, and per policy one summary per run."""
    setup: dict[str, Any] | None = None
    policies: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        recorded = json.loads(path.read_text())
        if "arms" not in recorded or "offline" not in recorded["config"].get("mode", ""):
            raise Mismatch(f"{path}: not an offline replay result (python -m bench.replay --offline)")
        config = recorded["config"]
        this = {
            "trace": str(trace_file(recorded["trace"]["path"])),
            "rows": recorded["trace"]["requests"],
            "first_row": recorded["trace"]["first_row"],
            "engines": config["engines"],
            "output_cap": config["output_cap"],
            "engine_params": config["engine_params"],
        }
        if setup is None:
            setup = this
            lengths = input_lengths(Path(this["trace"]), this["rows"])  # the same for every run (checked)
            rate = this["engine_params"]["prefill_tokens_per_s"]
        elif this != setup:
            raise Mismatch(f"{path}: rows, engines or output cap differ from {paths[0]}: {this} != {setup}")
        for arm in recorded["arms"]:
            waits = [
                r["ttft_wall_s"] - (lengths[r["index"]] - (r["engine_cached"] or 0)) / rate
                for r in arm["raw"]["requests"]
                if r["ttft_wall_s"] is not None
            ]
            summary = {**arm["summary"], **wait_figures(waits)}
            policies.setdefault(summary["policy"], []).append(summary)
    if setup is None:
        raise Mismatch("no recorded run of ours given (--ours)")
    if setup["first_row"] != 0:
        raise Mismatch("the recorded runs do not start at the trace's first row")
    if setup["engine_params"].get("cpu_offload_blocks"):
        raise Mismatch("the recorded runs have a CPU offload tier; the mocker's is not matched to it")
    return {**setup, "policies": policies}


def trace_file(recorded: str) -> Path:
    """The trace a recorded run played: its recorded path, or the shared trace of that name."""
    path = Path(recorded)
    return path if path.is_file() else TRACES / path.name


def input_lengths(trace: Path, rows: int) -> list[int]:
    return [row["input_length"] for _, row in zip(range(rows), trace_rows(trace), strict=False)]


def percentile(values: list[float], q: float) -> float:
    """Nearest rank, as :func:`bench.replay.run.percentile` takes it (not imported: this runs in
    Dynamo's venv, which lacks the project's dependencies)."""
    ordered = sorted(values)
    return ordered[max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5))) - 1]


def wait_figures(waits: list[float]) -> dict[str, float]:
    """The TTFT beyond each request's own prefill of its uncached tokens (queueing behind other work,
    chunks shared with it, step overheads): the part of TTFT a router moves besides cache hits."""
    return {"wait_mean_s": statistics.fmean(waits), "wait_p99_s": percentile(waits, 99)}


def timing_profile(params: dict[str, Any], path: Path) -> None:
    """Our simulator's step model as the mocker's NPZ timing tables (milliseconds).

    Prefill is linear in new tokens, so two points carry it exactly (the mocker extrapolates).
    Decode is ``base + per_seq x seqs`` with seqs = active KV tokens / context length, capped at
    ``max_num_seqs``: a bilinear grid, fine enough that it stays within 1% of the formula where
    the trace runs.
    """
    import numpy  # the dynamo venv's, not ours

    per_ms = 1000.0 / params["prefill_tokens_per_s"]
    capacity = params["num_gpu_blocks"] * params["block_size"]
    active = numpy.linspace(0.0, float(capacity), 193)
    context = numpy.concatenate(
        [[1.0, 2.0, 4.0, 8.0], numpy.geomspace(16.0, float(params["max_model_len"]), 240)]
    )
    seqs = numpy.minimum(active[:, None] / context[None, :], float(params["max_num_seqs"]))
    numpy.savez(
        path,
        prefill_isl=numpy.array([0.0, 1_000_000.0]),
        prefill_ttft_ms=numpy.array([0.0, 1_000_000.0 * per_ms]),
        decode_active_kv_tokens=active,
        decode_context_length=context,
        decode_itl=1000.0 * (params["decode_base_s"] + params["decode_per_seq_s"] * seqs),
    )


def write_rows(path: Path, trace: Path, rows: int, output_cap: int) -> None:
    """The trace's first ``rows`` rows as Mooncake rows (the mocker's format), answers capped at
    ``output_cap`` tokens as our replay caps them."""
    lines = []
    for _, row in zip(range(rows), trace_rows(trace), strict=False):
        row["output_length"] = max(1, min(row["output_length"], output_cap))
        lines.append(json.dumps(row) + "\n")
    if len(lines) != rows:
        raise Mismatch(f"the trace has {len(lines)} rows, the recorded runs played {rows}")
    path.write_text("".join(lines))


def dynamo_run(trace: Path, mode: str, engine: dict[str, Any], workers: int, rate: float) -> dict[str, Any]:
    from dynamo._core import run_mocker_trace_replay  # optional: only this bench needs it

    started = time.monotonic()
    result = run_mocker_trace_replay(
        [str(trace)],
        num_workers=workers,
        router_mode=mode,
        trace_block_size=TRACE_BLOCK,
        replay_mode="offline",
        extra_engine_args={"engine": engine},
        capture_per_request=True,
    )
    summary = result.summary
    waits = [
        (r["ttft_ms"] - 1000 * (r["input_length"] - r["reused_input_tokens"]) / rate) / 1000
        for r in result.per_request
        if r["ttft_ms"] is not None
    ]
    return {
        "router_mode": mode,
        "hit_rate": summary["prefix_cache_reused_ratio"],
        "ttft_mean_s": summary["mean_ttft_ms"] / 1000,
        "ttft_p50_s": summary["median_ttft_ms"] / 1000,
        "ttft_p99_s": summary["p99_ttft_ms"] / 1000,
        "e2e_p50_s": summary["median_e2e_latency_ms"] / 1000,
        "completed": summary["completed_requests"],
        **wait_figures(waits),
        "wall_s": time.monotonic() - started,
    }


FIGURES = (
    ("hit_rate", "hit rate", "{:.2%}"),
    ("ttft_mean_s", "TTFT mean s", "{:.3f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.3f}"),
    ("wait_mean_s", "wait mean s", "{:.3f}"),
    ("wait_p99_s", "wait p99 s", "{:.3f}"),
)


def _span(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
    values = [r[key] for r in runs]
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low} - {high}"


def verdicts(results: dict[str, Any]) -> list[str]:
    """Ours against Dynamo's kv_router, each figure against its best run; our worst run counts."""
    kv = [r for r in results["dynamo"] if r["router_mode"] == "kv_router"]
    mine = results["ours"]["policies"].get(POLICY, [])
    if not kv or not mine:
        return []
    best_hit = max(r["hit_rate"] for r in kv)
    worst_hit = min(r["hit_rate"] for r in mine)
    if best_hit:
        lines = [
            f"- Hit rate: ours {worst_hit:.2%} (worst of {len(mine)}) against Dynamo's best {best_hit:.2%}: "
            f"**{worst_hit / best_hit:.2f}x** (target >= 1.10x)."
        ]
    else:
        lines = [f"- Hit rate: ours {worst_hit:.2%}, Dynamo's 0 in every run: no prompt shares a prefix."]
    for key, name in (("ttft_mean_s", "mean TTFT"), ("ttft_p99_s", "p99 TTFT"), ("wait_p99_s", "p99 wait")):
        best = min(r[key] for r in kv)
        worst = max(r[key] for r in mine)
        word = "lower" if worst < best else "**not lower**"
        lines.append(
            f"- {name}: ours {worst:.3f} s (worst of {len(mine)}) against Dynamo's best {best:.3f} s: {word}."
        )
    return lines + against_round_robin(results, kv, mine)


def against_round_robin(
    results: dict[str, Any], kv: list[dict[str, Any]], mine: list[dict[str, Any]]
) -> list[str]:
    """Each router's TTFT over its own simulator's round-robin: what the router gains, with the
    simulators' small difference (the step base of prefill-only steps) taken out."""
    dyn_rr = [r for r in results["dynamo"] if r["router_mode"] == "round_robin"]
    our_rr = results["ours"]["policies"].get("round-robin", [])
    if not dyn_rr or not our_rr:
        return []
    parts = []
    for key, name in (("ttft_mean_s", "mean TTFT"), ("ttft_p99_s", "p99 TTFT")):
        theirs = min(r[key] for r in kv) / statistics.fmean(r[key] for r in dyn_rr)
        ours_ = max(r[key] for r in mine) / statistics.fmean(r[key] for r in our_rr)
        parts.append(f"{name} ours {ours_:.3f}, Dynamo's best {theirs:.3f}")
    return ["- Against each simulator's own round-robin (lower is better): " + "; ".join(parts) + "."]


def cross_check(results: dict[str, Any]) -> list[str]:
    """Round-robin on both simulators: with matched engines, every figure should agree."""
    dyn = [r for r in results["dynamo"] if r["router_mode"] == "round_robin"]
    mine = results["ours"]["policies"].get("round-robin", [])
    if not dyn or not mine:
        return []
    parts = []
    for key, name, fmt in FIGURES:
        theirs, ours_ = statistics.fmean(r[key] for r in dyn), statistics.fmean(r[key] for r in mine)
        change = f"{ours_ / theirs - 1:+.1%}" if theirs else ("equal" if not ours_ else "n/a")
        parts.append(f"{name} {fmt.format(theirs)} against {fmt.format(ours_)} ({change})")
    return ["Cross-check, round-robin on Dynamo's mocker against ours: " + "; ".join(parts) + "."]


def report(results: dict[str, Any]) -> str:
    ours = {"trace": "mooncake_conversation_trace.jsonl", **results["ours"]}  # (recorded before it was kept)
    params = ours["engine_params"]
    lines = [
        "# Routing quality: Dynamo's real KV router on the same trace, engines matched",
        "",
        f"{provenance(results['machine'])}; ai-dynamo-runtime {results['dynamo_version']}.",
        "",
        f"Trace `{Path(ours['trace']).name}` rows 0-{ours['rows'] - 1}; {ours['engines']} engines on both "
        "simulators, "
        f"matched: {params['num_gpu_blocks']:,} KV blocks x {params['block_size']} tokens, max_num_seqs "
        f"{params['max_num_seqs']}, max_num_batched_tokens {params['max_num_batched_tokens']}, answers "
        f"capped at {ours['output_cap']} tokens, and the mocker's timing model filled from ours (prefill "
        f"{params['prefill_tokens_per_s']:,.0f} tok/s; decode step {1000 * params['decode_base_s']:g} ms + "
        f"{1000 * params['decode_per_seq_s']:g} ms per sequence). TTFTs are each engine's own, in simulated "
        "seconds, so they compare. *Wait* = TTFT minus the request's own prefill of its uncached "
        "tokens at the engines' rate: queueing behind other work, chunks shared with it and step "
        "overheads, the part of TTFT a router moves besides cache hits. The two step models differ in "
        f"one place: a step with no decode costs the mocker its prefill time only, ours also the "
        f"{1000 * params['decode_base_s']:g} ms step base, so a cold prompt alone on an engine takes "
        "ours that much longer per chunk (66 ms for 90k tokens).",
        "",
        "| router | runs | " + " | ".join(name for _, name, _ in FIGURES) + " |",
        "|---|--:|" + "--:|" * len(FIGURES),
    ]
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in results["dynamo"]:
        by_mode.setdefault(run["router_mode"], []).append(run)
    for mode, runs in by_mode.items():
        cells = " | ".join(_span(runs, key, fmt) for key, _, fmt in FIGURES)
        lines.append(f"| Dynamo {mode} | {len(runs)} | {cells} |")
    for policy, runs in ours["policies"].items():
        cells = " | ".join(_span(runs, key, fmt) for key, _, fmt in FIGURES)
        lines.append(f"| ours: {policy} | {len(runs)} | {cells} |")
    lines += ["", f"Ours from: {', '.join(f'`{p}`' for p in results['ours_from'])}.", ""]
    lines += cross_check(results)
    lines += ["", "Ours against Dynamo's kv_router:", "", *verdicts(results)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="kv_router runs (3)")
    parser.add_argument(
        "--ours",
        type=Path,
        nargs="+",
        default=[HERE / "results" / "raw" / f"replay_offline{s}.json" for s in ("", "_seed2", "_seed3")],
        help="our recorded offline replays of the same rows and engines, one per seed",
    )
    parser.add_argument("--out", type=Path, default=HERE / "results" / "dynamo_replay.json")
    args = parser.parse_args()
    try:
        import dynamo._core  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as exc:
        sys.exit(
            f"{exc.name} is not installed here: pip install ai-dynamo-runtime==1.6.1 numpy "
            "(see this file's docstring)"
        )
    ours = load_ours(args.ours)
    params = ours["engine_params"]
    with tempfile.TemporaryDirectory() as tmp:
        trace, timing = Path(tmp) / "rows.jsonl", Path(tmp) / "timing.npz"
        write_rows(trace, Path(ours["trace"]), ours["rows"], ours["output_cap"])
        timing_profile(params, timing)
        engine = {name: params[name] for name in SHARED_ENGINE_ARGS}
        engine["timing_model"] = {
            "type": "external",
            "provider": "dynamo_profile",
            "config": {"path": str(timing)},
        }
        modes = ["round_robin"] + ["kv_router"] * args.runs
        rate = params["prefill_tokens_per_s"]
        runs = [dynamo_run(trace, mode, engine, ours["engines"], rate) for mode in modes]
    results = {
        "machine": machine(),
        "dynamo_version": version("ai-dynamo-runtime"),
        "engine": engine,
        "dynamo": runs,
        "ours": ours,
        "ours_from": [
            str(p.resolve().relative_to(HERE.parent)) if p.resolve().is_relative_to(HERE.parent) else str(p)
            for p in args.ours
        ],
    }
    record(args.out, results, report)


if __name__ == "__main__":
    main()
