"""The soak's verdict: a run that shared the machine after its warm-up proves nothing, and the CPU
time of the soak's own processes is told apart from everyone else's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The benchmarks are not an installed package: import them from the repo root and bench/ (the soak
# imports its sibling modules by name, as it runs as a script).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench.machine import process_stat, tree_cpu_seconds
from bench.soak import MAX_TAKEN_CORES, judge

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def a_run(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "samples": samples,
        "invalid": [],
        "tally": {"errors": 0},
        "in_flight_at_end": 0,
    }


def flat(count: int, **extra: float) -> list[dict[str, Any]]:
    """``count`` samples 10 s apart with flat RSS and in-flight counts."""
    return [{"at_s": 10.0 * i, "rss_mb": 100.0, "in_flight": 10.0, **extra} for i in range(count)]


def test_a_quiet_flat_run_passes() -> None:
    result = judge(a_run(flat(60, stolen_cores=0.02, others_cores=0.05)), warmup=100)
    assert result["passed"], result["invalid"]
    assert result["rss_slope_mb_per_h_after_warmup"] == 0


def test_a_run_whose_machine_was_shared_after_the_warmup_is_invalid() -> None:
    samples = flat(60, stolen_cores=0.02, others_cores=0.05)
    samples[40]["others_cores"] = 0.9  # a type checker ran beside it
    result = judge(a_run(samples), warmup=100)
    assert not result["passed"]
    assert result["invalid"] == [
        f"the machine was shared: in 1 samples after the warm-up the hypervisor and other processes "
        f"took over {MAX_TAKEN_CORES:g} cores (0.92 at 400 s)"
    ]


def test_sharing_during_the_warmup_or_an_older_runs_steal_alone_is_judged_too() -> None:
    """Warm-up samples do not count; samples recorded before the other processes were measured are
    judged by the hypervisor's steal alone."""
    warm = flat(60, stolen_cores=0.0, others_cores=0.0)
    warm[5]["others_cores"] = 1.5
    assert judge(a_run(warm), warmup=100)["passed"]
    older = flat(60, stolen_cores=0.0)
    older[30]["stolen_cores"] = 0.45
    assert judge(a_run(older), warmup=100)["invalid"][0].startswith("the machine was shared")


def test_judging_again_does_not_repeat_the_reason() -> None:
    samples = flat(60, stolen_cores=0.5)
    result = judge(a_run(samples), warmup=100)
    assert len(judge(result, warmup=100)["invalid"]) == 1


def test_the_run_is_this_process_and_what_it_started_and_nothing_else() -> None:
    """A child's CPU time counts as the run's, also once it has ended; the CPU time of a process
    that is not below this one does not."""
    me = os.getpid()
    before = tree_cpu_seconds(me)
    subprocess.run([sys.executable, "-c", BURN.format(seconds=0.5)], check=True)
    assert tree_cpu_seconds(me) - before >= 0.45
    # A shell starts it in the background and exits: orphaned, it is no longer below this process.
    started = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c '{BURN.format(seconds=0.5)}' >/dev/null 2>&1 & echo $!"],
        check=True,
        capture_output=True,
        text=True,
    )
    stranger = int(started.stdout)
    before = tree_cpu_seconds(me)
    deadline = time.monotonic() + 30
    while running(stranger) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tree_cpu_seconds(me) - before < 0.2


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (a container's init may reap it late)."""
    try:
        return process_stat(pid)[0] != "Z"
    except OSError:
        return False
