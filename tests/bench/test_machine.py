"""The per-thread CPU accounting the stall diagnosis (bench/investigations/stall_cpu.py) reads
serve's cores with."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.machine import thread_cpu_seconds

# A child whose main thread burns 0.3 s of CPU and whose second thread, idle-class, 0.6 s; both
# stay alive until stdin closes.
CHILD = textwrap.dedent(
    """
    import os, sys, threading, time

    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    burned = threading.Event()

    def idle():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        burn(0.6)
        burned.set()
        threading.Event().wait()

    threading.Thread(target=idle, daemon=True).start()
    burn(0.3)
    burned.wait()
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_cores_are_split_into_main_idle_class_and_other_threads() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "ready"
            cores = thread_cpu_seconds(child.pid)
            assert 0.25 <= cores["main"] < 0.5
            assert 0.55 <= cores["idle_class"] < 0.8
            assert cores["other"] < 0.05
        finally:
            child.stdin.close()
            child.wait(10)
