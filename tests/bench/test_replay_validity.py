"""A replay arm measured while the machine could not keep up is called invalid, and says why."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# The benchmarks are not an installed package: import them from the repo root (see test_replay_trace).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.replay.report import validity


def arm(lag_ms: float, dropped_s: float, wall_s: float = 120.0) -> dict[str, Any]:
    return {"dispatch_lag_ms_p99": lag_ms, "engine_lag_dropped_s": dropped_s, "wall_s": wall_s}


@pytest.mark.parametrize(
    ("summary", "reason"),
    [
        (arm(5.0, 0.0), None),
        (arm(5.0, 0.4, wall_s=5.0), None),  # one hiccup in a short run
        (arm(5.0, 1.0), None),  # under 1% of the arm
        (arm(60.0, 0.0), "dispatch lag p99 60 ms > 50"),
        (arm(5.0, 3.0), "engines fell 3.0 s behind their model in 120 s"),
    ],
    ids=["kept-up", "one-hiccup", "under-one-percent", "client-late", "engines-behind"],
)
def test_an_arm_is_invalid_when_the_client_or_the_engines_fell_behind(
    summary: dict[str, Any], reason: str | None
) -> None:
    assert validity(summary) == reason


def test_older_results_without_engine_lag_are_judged_on_dispatch_lag() -> None:
    assert validity({"dispatch_lag_ms_p99": 5.0, "wall_s": 100.0}) is None
