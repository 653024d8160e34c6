"""Profile calibration, measured: the offline replay routed with a profile 3x wrong, with and without
calibration, beside the same replay routed with the engines' true profile.

Each arm plays the same Mooncake conversation rows in virtual time (:mod:`bench.replay.offline`:
the real scheduler, prefix index and ``predicted-ttft`` policy against the simulator's engine cores).
A calibrated arm gets every engine's TTFT histogram totals each simulated second, as serve's
scraper would, and fits its worker set's prefill rate and step cost
(:mod:`extproc.scheduling.calibration`). Reported per arm: the hit rate and TTFT, and the median
absolute percentage error of the pick's predicted TTFT against the engine's, per minute of trace
time. The simulator's engine parameters are the truth the fitted profile is compared with.

Targets (issue 15): from a 3x wrong profile, the median error <= 20% within 2 simulated minutes, and
hit rate and mean TTFT within 5% of the true profile's run.

    .venv/bin/python bench/calibration.py [--requests 3000]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.machine import machine, provenance, record
from bench.replay.arms import TRACE, Arm, Config, true_profile
from bench.replay.offline import OfflineReplay
from bench.replay.run import summarize
from bench.replay.trace import load
from extproc.scheduling.calibration import Calibration
from extproc.scheduling.fit import scaled
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.profiles import Profile
from extproc.sim.engine_core import EngineParams
from extproc.tokenize import shipped_tokenizer

HERE = Path(__file__).resolve().parent
#: Wrong profiles: (name, prefill time scale, step cost scale) against the truth.
WRONG = (
    ("3x optimistic", 1 / 3, 1 / 3),
    ("3x pessimistic", 3.0, 3.0),
    ("3x skewed", 1 / 3, 3.0),
)
#: Seeds of the true profile's runs (the first is the wrong profiles' seed too).
TRUTH_SEEDS = (1, 2, 3)
#: Width of the error timeline's windows, simulated seconds.
WINDOW_S = 60.0
#: Within this long the calibrated arms' median error must be at most TARGET_ERROR.
TARGET_WITHIN_S = 120.0
TARGET_ERROR = 0.20
#: Hit rate and mean TTFT within this fraction of the true profile's run.
TARGET_CLOSE = 0.05


def play(
    name: str, profile: Profile, calibrate: bool, rows: list[Any], cfg: Config, vocab: int
) -> dict[str, Any]:
    """One arm: the offline replay with ``profile``, calibrated or not."""
    replay: list[OfflineReplay] = []
    calibration = Calibration(clock=lambda: replay[0].now) if calibrate else None
    profile_of = (
        (lambda _endpoint: profile) if calibration is None else calibration.profile_of(lambda _e: profile)
    )
    policy = PredictedTTFT(profile_of)
    replay.append(OfflineReplay(Arm(name, policy), rows, cfg, vocab, calibration=calibration))
    raw = replay[0].run()
    arrivals = {r.index: r.arrival_s for r in rows}
    errors: dict[int, list[float]] = {}
    for sent in raw["requests"]:
        predicted, observed = sent["predicted_ttft_s"], sent["ttft_wall_s"]
        if predicted is not None and observed:
            window = int(arrivals[sent["index"]] // WINDOW_S)
            errors.setdefault(window, []).append(abs(predicted - observed) / observed)
    timeline = [
        {"from_s": w * WINDOW_S, "requests": len(errors[w]), "median_error": statistics.median(errors[w])}
        for w in sorted(errors)
    ]
    after = [e for w, values in errors.items() if w * WINDOW_S >= TARGET_WITHIN_S for e in values]
    fitted = None
    if calibration is not None:
        fits = list(calibration.fits.values())
        fitted = fits[0].to_debug() if fits else None
    return {
        "name": name,
        "calibrated": calibrate,
        "profile": asdict(profile),
        "summary": summarize(raw, 1.0),
        "error_timeline": timeline,
        "median_error_after_target_s": statistics.median(after) if after else None,
        "fitted": fitted,
    }


def judge(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Each arm against the true profile's runs (one per seed): the nearest of them, so that a
    difference inside the truth's own seed-to-seed spread is not called calibration's doing."""
    truths = [a["summary"] for a in arms if a["truth"]]
    verdicts = []
    for arm in arms:
        if arm["truth"]:
            continue
        s = arm["summary"]
        hit = min((s["hit_rate"] / t["hit_rate"] - 1 for t in truths), key=abs)
        ttft = min((s["ttft_mean_s"] / t["ttft_mean_s"] - 1 for t in truths), key=abs)
        early = [w for w in arm["error_timeline"] if w["from_s"] < TARGET_WITHIN_S]
        reached = next((w["from_s"] + WINDOW_S for w in early if w["median_error"] <= TARGET_ERROR), None)
        verdicts.append(
            {
                "name": arm["name"],
                "calibrated": arm["calibrated"],
                "hit_rate_vs_truth": hit,
                "ttft_mean_vs_truth": ttft,
                "error_within_target_by_s": reached,
                "passed": (
                    abs(hit) <= TARGET_CLOSE
                    and abs(ttft) <= TARGET_CLOSE
                    and reached is not None
                    and (arm["median_error_after_target_s"] or 1.0) <= TARGET_ERROR
                )
                if arm["calibrated"]
                else None,
            }
        )
    calibrated = [v for v in verdicts if v["calibrated"]]
    return {"verdicts": verdicts, "passed": bool(calibrated) and all(v["passed"] for v in calibrated)}


def report(results: dict[str, Any]) -> str:
    m, cfg = results["machine"], results["config"]
    truth = results["truth"]
    lines = [
        "# Profile calibration in the offline replay",
        "",
        f"{provenance(m)}. "
        f"{cfg['requests']} Mooncake conversation rows (trace time {cfg['trace_s']:.0f} s), {cfg['engines']} "
        f"simulated engines, virtual time, `predicted-ttft` with precise prefix routing; calibrated arms "
        f"read each engine's TTFT totals every {cfg['scrape_s']:g} simulated s.",
        "",
        f"True engine speed: {truth['prefill_tokens_per_s']:.0f} prefill tokens/s, step "
        f"{truth['decode_base_ms']:g} ms + {truth['decode_per_seq_ms']:g} ms per decoding sequence.",
        "",
        f"**{'PASSED' if results['judged']['passed'] else 'FAILED'}.** Targets (issue 15): calibrated "
        f"arms reach a median prediction error <= {TARGET_ERROR:.0%} within {TARGET_WITHIN_S:.0f} "
        f"simulated s (and stay there), and their hit rate and mean TTFT come within "
        f"{TARGET_CLOSE:.0%} of a run with the true profile (the nearest of {len(TRUTH_SEEDS)} seeds: "
        "tie-breaks alone move the figures that much).",
        "",
        "| arm | hit rate | mean TTFT s | p99 TTFT s | vs truth: hit / mean TTFT "
        "| median error: 1st min / 2nd min / after | fitted prefill tok/s, step base ms |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    verdicts = {v["name"]: v for v in results["judged"]["verdicts"]}
    for arm in results["arms"]:
        s = arm["summary"]
        v = verdicts.get(arm["name"])
        versus = "-" if v is None else f"{v['hit_rate_vs_truth']:+.1%} / {v['ttft_mean_vs_truth']:+.1%}"
        timeline = arm["error_timeline"]
        first = [f"{w['median_error']:.0%}" for w in timeline[:2]]
        after = arm["median_error_after_target_s"]
        errors = " / ".join([*first, "-" if after is None else f"{after:.0%}"])
        fitted = arm["fitted"]
        fit = "-" if fitted is None else f"{fitted['prefillTokensPerS']:.0f}, {fitted['decodeBaseMs']:.2f}"
        lines.append(
            f"| {arm['name']} | {s['hit_rate']:.2%} | {s['ttft_mean_s']:.3f} | {s['ttft_p99_s']:.3f} "
            f"| {versus} | {errors} | {fit} |"
        )
    lines += [
        "",
        "Wrong profiles: *optimistic* = prefill 3x faster and steps 3x cheaper than the engines'; "
        "*pessimistic* = both 3x slower; *skewed* = prefill 3x faster, steps 3x costlier. Median error: "
        "|predicted - observed| / observed TTFT of each pick, by the minute of trace time it arrived in.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000, help="contiguous trace rows (3000)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--out", type=Path, default=HERE / "results" / "calibration.json")
    args = p.parse_args()
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}: pass --trace PATH (a Mooncake-format .jsonl)")
    rows = load(args.trace, requests=args.requests)
    engine: dict[str, Any] = {"block_size": 16, "num_gpu_blocks": 24_000, "max_model_len": 131_072}
    cfg = Config(8, 1.0, 512, engine, seed=TRUTH_SEEDS[0])
    vocab = shipped_tokenizer().vocab_size
    truth = true_profile(EngineParams(**engine))
    # The true profile under several seeds: how far the figures move when nothing but tie-breaks
    # change, the yardstick for "within 5%".
    arms = []
    for seed in TRUTH_SEEDS:
        logging.warning("arm true profile, seed %d", seed)
        seeded = Config(cfg.engines, cfg.time_scale, cfg.output_cap, engine, seed=seed)
        arms.append(play(f"true profile, seed {seed}", truth, False, rows, seeded, vocab) | {"truth": True})
    for name, prefill_scale, step_scale in WRONG:
        wrong = scaled(truth, prefill_scale, step_scale)
        for calibrate in (False, True):
            label = f"{name}, {'calibrated' if calibrate else 'as written'}"
            logging.warning("arm %s", label)
            arms.append(play(label, wrong, calibrate, rows, cfg, vocab) | {"truth": False})
    results: dict[str, Any] = {
        "machine": machine(),
        "config": {
            "requests": len(rows),
            "trace_s": rows[-1].arrival_s - rows[0].arrival_s,
            "engines": cfg.engines,
            "engine": engine,
            "scrape_s": 1.0,
        },
        "truth": asdict(truth),
        "arms": arms,
    }
    results["judged"] = judge(arms)
    record(args.out, results, report)
    return 0 if results["judged"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
