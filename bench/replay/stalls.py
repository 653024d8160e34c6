"""Where an event loop stalls: a thread samples the loop thread's stack while its loop is late.

The online replay's engines fall behind their model in bursts, and a profile of the whole run does
not show what holds the loop then. This samples only during stalls: a heartbeat callback runs every
``tick`` on the loop, and a watcher thread, every ``SAMPLE_EVERY`` seconds, records the loop
thread's stack whenever the heartbeat is older than ``threshold``. A stall inside C code that holds
the GIL cannot be sampled (the watcher needs the GIL itself): such stalls show as few samples
against their length, while ``stalled_cpu_s`` says the process was running meanwhile.
(:func:`faulthandler.dump_traceback_later`, re-armed by the heartbeat, would sample without the GIL,
but the simulated fleet's start-up never finished with it armed; not pursued.)
"""

from __future__ import annotations

import asyncio
import collections
import gc
import sys
import threading
import time
import traceback
from typing import Any

SAMPLE_EVERY = 0.005
#: Frames kept per sampled stack (innermost first).
STACK_DEPTH = 14


class StallSampler:
    """Samples the loop thread's stack while its loop is more than ``threshold`` s late."""

    def __init__(self, threshold: float = 0.05, tick: float = 0.01) -> None:
        self.threshold, self.tick = threshold, tick
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        #: Each stall's length in seconds (heartbeat gaps longer than ``threshold``).
        self.stalls: list[float] = []
        #: The CPU this process used during each stall: about its length when the loop was busy,
        #: about 0 when the process did not run (the machine's other work had the cores).
        self.stall_cpu: list[float] = []
        #: The garbage collector's time during each stall (C code holding the GIL, so unsampled).
        self.stall_gc: list[float] = []
        self._gc_total = 0.0
        self._gc_started = 0.0
        self._gc_at_beat = 0.0
        self._beat = time.monotonic()
        self._cpu = time.process_time()
        self._stop = threading.Event()
        self._loop_thread = 0
        self._task: asyncio.Task[None] | None = None
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling the running loop (call from it)."""
        self._loop_thread = threading.get_ident()
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())
        self._watcher = threading.Thread(target=self._watch, name="stall-sampler", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
        if self._watcher is not None:
            self._watcher.join(1.0)

    def summary(self, top: int = 12) -> dict[str, Any]:
        """Stall count and lengths, and the most sampled stacks (a sample is SAMPLE_EVERY s)."""
        stalls = sorted(self.stalls)
        return {
            "threshold_s": self.threshold,
            "stalls": len(stalls),
            "stalled_s": sum(stalls),
            "stalled_cpu_s": sum(self.stall_cpu),
            "stalled_gc_s": sum(self.stall_gc),
            "longest_s": stalls[-1] if stalls else 0.0,
            "stacks": [
                {"samples": count, "stack": list(stack)} for stack, count in self.stacks.most_common(top)
            ],
        }

    async def _heartbeat(self) -> None:
        while True:
            now, cpu = time.monotonic(), time.process_time()
            gap = now - self._beat
            if gap > self.tick + self.threshold:
                self.stalls.append(gap - self.tick)
                self.stall_cpu.append(cpu - self._cpu)
                self.stall_gc.append(self._gc_total - self._gc_at_beat)
            self._beat, self._cpu, self._gc_at_beat = now, cpu, self._gc_total
            await asyncio.sleep(self.tick)

    def _on_gc(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_total += time.perf_counter() - self._gc_started

    def _watch(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            if time.monotonic() - self._beat <= self.tick + self.threshold:
                continue
            frame = sys._current_frames().get(self._loop_thread)
            if frame is None:
                continue
            summary = traceback.extract_stack(frame)[-STACK_DEPTH:]
            self.stacks[tuple(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(summary))] += 1


def _short(path: str) -> str:
    for marker in ("/extproc/", "/bench/", "/site-packages/", "/lib/python3"):
        at = path.rfind(marker)
        if at >= 0:
            return path[at + 1 :]
    return path
