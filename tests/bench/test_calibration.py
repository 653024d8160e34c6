"""Profile calibration in the offline replay: the simulator's engine speeds are the ground truth."""

from __future__ import annotations

import sys
from pathlib import Path

# The benchmarks are not an installed package: import them from the repo root (see test_replay_trace).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from bench.calibration import play
from bench.replay.arms import Config, true_profile
from bench.replay.trace import TraceRequest
from extproc.scheduling.fit import scaled
from extproc.sim.engine_core import EngineParams

VOCAB = 5000
ENGINE = {"block_size": 16, "num_gpu_blocks": 4000, "max_model_len": 16384}


def conversations(count: int = 16, turns: int = 24) -> list[TraceRequest]:
    """``count`` conversations, a turn every 0.25 s: each repeats its history's blocks and adds
    some, with answers of 40 tokens (decode time between the prefills)."""
    rows = []
    for turn in range(turns):
        for c in range(count):
            ids = tuple(1000 * c + b for b in range(turn + 1 + c % 3))
            index = len(rows)
            rows.append(TraceRequest(index, index * 0.25, 512 * len(ids) - 100, 40, ids))
    return rows


@pytest.mark.parametrize(("prefill_scale", "step_scale"), [(1 / 3, 1 / 3), (3.0, 3.0), (1 / 3, 3.0)])
def test_a_wrong_profile_is_fitted_to_the_engines_true_speeds(
    prefill_scale: float, step_scale: float
) -> None:
    truth = true_profile(EngineParams(**ENGINE))
    cfg = Config(engines=4, time_scale=1.0, output_cap=64, engine=ENGINE, seed=3)
    wrong = scaled(truth, prefill_scale, step_scale)
    arm = play("wrong, calibrated", wrong, True, conversations(), cfg, VOCAB)
    fitted = arm["fitted"]
    assert fitted is not None
    assert fitted["prefillTokensPerS"] == pytest.approx(truth.prefill_tokens_per_s, rel=0.15), fitted
    assert fitted["decodeBaseMs"] == pytest.approx(truth.decode_base_ms, rel=0.25), fitted
    # Predictions made once calibrated are close; the wrong profile's, as written, are not.
    late = arm["error_timeline"][-1]["median_error"]
    assert late < 0.2, arm["error_timeline"]
    uncalibrated = play("wrong, as written", wrong, False, conversations(), cfg, VOCAB)
    assert uncalibrated["error_timeline"][-1]["median_error"] > 2 * late
