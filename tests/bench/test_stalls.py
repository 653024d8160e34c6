"""The stall sampler says when the loop was held, for how long, and by what."""

from __future__ import annotations

import asyncio
import time

from bench.replay.stalls import StallSampler


def hold_the_loop(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # Python code: the sampler's thread gets the GIL in turns
        pass


async def test_a_held_loop_is_one_stall_sampled_in_the_function_holding_it() -> None:
    sampler = StallSampler(threshold=0.05, tick=0.01)
    sampler.start()
    try:
        await asyncio.sleep(0.05)
        hold_the_loop(0.3)
        await asyncio.sleep(0.05)
    finally:
        sampler.stop()
    summary = sampler.summary()
    assert summary["stalls"] == 1
    assert 0.25 < summary["longest_s"] < 1.0
    assert summary["stalled_cpu_s"] > 0.2  # it was running, not waiting for a core
    assert summary["stacks"], "no stack sampled during the stall"
    innermost = summary["stacks"][0]["stack"][0]
    assert "hold_the_loop" in innermost


async def test_a_loop_that_keeps_turning_has_no_stalls() -> None:
    sampler = StallSampler(threshold=0.05, tick=0.01)
    sampler.start()
    try:
        for _ in range(20):
            hold_the_loop(0.005)
            await asyncio.sleep(0.005)
    finally:
        sampler.stop()
    assert sampler.summary()["stalls"] == 0
