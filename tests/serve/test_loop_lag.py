"""The event-loop lag metric sees what holds the loop."""

from __future__ import annotations

import asyncio
import time

from extproc.serve.loop_lag import watch_loop_lag
from extproc.telemetry import Metrics


def _count(metrics: Metrics, le: str) -> float:
    value = metrics.registry.get_sample_value("extproc_event_loop_lag_seconds_bucket", {"le": le})
    assert value is not None
    return value


async def test_a_blocked_loop_shows_as_lag() -> None:
    metrics = Metrics()
    task = asyncio.create_task(watch_loop_lag(metrics.loop_lag, interval=0.005))
    try:
        await asyncio.sleep(0.1)
        assert _count(metrics, "0.025") == _count(metrics, "+Inf") > 0  # an idle loop is on time
        time.sleep(0.06)  # noqa: ASYNC251 (the point: a blocking call on the loop)
        await asyncio.sleep(0.05)
        assert _count(metrics, "+Inf") - _count(metrics, "0.025") == 1
    finally:
        task.cancel()
