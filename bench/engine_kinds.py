"""Routing quality in front of SGLang engines against vLLM engines: same trace, capacity and policy.

Issue 16's bar: a pool of SGLang engines gets the routing quality of a vLLM pool, within 5% on hit
rate and mean TTFT. This runs :mod:`bench.replay`'s arms (default: ours, ``predicted-ttft``) on a
pool of simulated vLLM engines and on one of ``extproc sim --engine sglang`` engines, alternating
(vllm, sglang, vllm, sglang, ...) so drift in the machine's load falls on both alike. The engines
differ only in what the router sees: metric names, routes and the KV-event encoding (one event per
page, signed first-8-byte hashes); capacity and speed are the same.

Each round also measures its own lag (the client's dispatch lag against the scaled trace clock, and
how far the engines fell behind their model) and the machine's CPU use outside this bench; a round
the replay's :func:`~bench.replay.report.validity` rejects is marked invalid (the machine could not
keep up) and left out of the verdict.
Writes ``bench/results/engine_kinds.{json,md}``.

    python -m bench.engine_kinds [--requests 3000] [--rounds 2] [--only ours]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.machine import machine, machine_busy_seconds, provenance, record
from bench.replay.arms import TRACE, Config, default_arms
from bench.replay.online import run_arm
from bench.replay.report import MAX_DISPATCH_LAG_MS, validity
from bench.replay.run import summarize
from bench.replay.trace import load, summary
from extproc.sim.engine_core import EngineParams
from extproc.tokenize import shipped_tokenizer

REPO = Path(__file__).resolve().parents[1]
KINDS = ("vllm", "sglang")
#: The bar: SGLang within this fraction of vLLM on hit rate and mean TTFT.
TOLERANCE = 0.05

log = logging.getLogger("bench.engine_kinds")


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    requests = load(args.trace, requests=args.requests, start=args.start)
    engine = {"block_size": 16, "num_gpu_blocks": args.gpu_blocks, "max_model_len": 131_072}
    vocab = shipped_tokenizer().vocab_size
    results: dict[str, Any] = {
        "machine": machine(),
        "trace": {"path": str(args.trace), **summary(requests)},
        "config": {
            "engines": args.engines,
            "time_scale": args.time_scale,
            "output_cap": args.output_cap,
            "engine": engine,
            "rounds": args.rounds,
            "max_lag_ms": MAX_DISPATCH_LAG_MS,
        },
        "runs": [],
    }
    for round_ in range(args.rounds):
        for kind in KINDS:
            cfg = Config(args.engines, args.time_scale, args.output_cap, engine, engine_kind=kind)
            for factory in default_arms(EngineParams(**engine)):
                arm = factory()
                if args.only and not any(arm.name.startswith(o) for o in args.only):
                    continue
                busy0, cpu0, wall0 = machine_busy_seconds(), time.process_time(), time.monotonic()
                raw = await run_arm(arm, requests, cfg, vocab)
                wall = time.monotonic() - wall0
                s = summarize(raw, args.time_scale)
                # CPU the rest of the machine used meanwhile: not this process, not the engines' child.
                others = machine_busy_seconds() - busy0 - (time.process_time() - cpu0) - raw["engine_cpu_s"]
                run = {
                    "round": round_,
                    "engine_kind": kind,
                    "policy": arm.name,
                    "hit_rate": s["hit_rate"],
                    "ttft_mean_s": s["ttft_mean_s"],
                    "ttft_p99_s": s["ttft_p99_s"],
                    "preemptions": s["preemptions"],
                    "dispatch_lag_ms_p99": s["dispatch_lag_ms_p99"],
                    "decide_ms_p50": s["decide_ms_p50"],
                    "other_cpu_share": max(0.0, others) / wall / (results["machine"]["cores"] or 1),
                    "wall_s": wall,
                    "engine_lag_dropped_s": s["engine_lag_dropped_s"],
                    "invalid_because": validity(s),
                    "valid": validity(s) is None,
                }
                log.warning("round %d %s %s: %s", round_, kind, arm.name, run)
                results["runs"].append(run)
    results["verdict"] = verdict(results["runs"])
    return results


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per policy: each kind's mean over its valid rounds, and SGLang's ratio to vLLM."""
    out: dict[str, Any] = {}
    for policy in sorted({r["policy"] for r in runs}):
        means: dict[str, dict[str, float]] = {}
        for kind in KINDS:
            valid = [r for r in runs if r["policy"] == policy and r["engine_kind"] == kind and r["valid"]]
            if valid:
                means[kind] = {
                    "hit_rate": statistics.fmean(r["hit_rate"] for r in valid),
                    "ttft_mean_s": statistics.fmean(r["ttft_mean_s"] for r in valid),
                    "rounds": len(valid),
                }
        entry: dict[str, Any] = {"means": means}
        if len(means) == len(KINDS):
            hit = means["sglang"]["hit_rate"] / means["vllm"]["hit_rate"]
            ttft = means["sglang"]["ttft_mean_s"] / means["vllm"]["ttft_mean_s"]
            entry.update(
                hit_ratio=hit,
                ttft_ratio=ttft,
                within=abs(hit - 1) <= TOLERANCE and abs(ttft - 1) <= TOLERANCE,
            )
        out[policy] = entry
    return out


def report(results: dict[str, Any]) -> str:
    c, t = results["config"], results["trace"]
    lines = [
        "# Routing quality: SGLang engines against vLLM engines",
        "",
        provenance(results["machine"]),
        "",
        f"Trace `{Path(t['path']).name}`, {t['requests']} requests from row {t['first_row']}; "
        f"{c['engines']} simulated engines of {c['engine']['num_gpu_blocks']} x 16-token blocks each, "
        f"time scale {c['time_scale']}, max_tokens = min(output, {c['output_cap']}). Both pools run the "
        "same engine model; they differ in what the router reads (metric names, routes, KV-event "
        "encoding). Rounds alternate the kinds. A round is invalid (left out of the verdict) when the "
        f"client's dispatch lag p99 exceeds {c['max_lag_ms']:g} ms or the engines fell behind their "
        "model for more than 1% of the round: the machine could not keep up.",
        "",
        "| round | engines | policy | hit rate | TTFT mean s | TTFT p99 s | preemptions "
        "| dispatch lag p99 ms | other CPU | valid |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["runs"]:
        lines.append(
            f"| {r['round']} | {r['engine_kind']} | {r['policy']} | {r['hit_rate']:.2%} | "
            f"{r['ttft_mean_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['preemptions']} | "
            f"{r['dispatch_lag_ms_p99']:.1f} | {r['other_cpu_share']:.0%} | {'yes' if r['valid'] else 'NO'} |"
        )
    lines += ["", "| policy | vLLM hit / TTFT | SGLang hit / TTFT | SGLang / vLLM: hit, TTFT | within 5% |"]
    lines.append("|---|---:|---:|---:|---|")
    for policy, v in results["verdict"].items():
        m = v["means"]

        def cell(kind: str, m: dict[str, Any] = m) -> str:
            if kind not in m:
                return "no valid round"
            return f"{m[kind]['hit_rate']:.2%} / {m[kind]['ttft_mean_s']:.3f} s ({m[kind]['rounds']} rounds)"

        ratios = f"{v['hit_ratio']:.3f}, {v['ttft_ratio']:.3f}" if "hit_ratio" in v else "-"
        within = {True: "yes", False: "**no**"}.get(v.get("within"), "-")
        lines.append(f"| {policy} | {cell('vllm')} | {cell('sglang')} | {ratios} | {within} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(prog="python -m bench.engine_kinds", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="vllm+sglang pairs (2)")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.12)
    p.add_argument("--output-cap", type=int, default=512)
    p.add_argument("--gpu-blocks", type=int, default=24_000)
    p.add_argument("--only", nargs="*", default=["ours"], help="policies whose names start with these (ours)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/engine_kinds.json")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}: pass --trace PATH (a Mooncake-format .jsonl)")
    results = asyncio.run(amain(args))
    record(args.out, results, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
