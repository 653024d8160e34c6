"""How long the event loop keeps decisions waiting: a timer due every few milliseconds, and how late.

Every decision runs on the one event loop, so anything that holds it (a long computation, a
blocking call, a garbage collection) delays every request in flight. The lateness of a periodic
timer measures exactly that wait, and ``extproc_event_loop_lag_seconds`` exports it: a p99 of a
few milliseconds is healthy; tens of milliseconds means something blocks the loop.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

#: Timer period: fine enough to see a 5 ms stall, cheap (about 100 wake-ups a second).
INTERVAL = 0.01


async def watch_loop_lag(histogram: Histogram, *, interval: float = INTERVAL) -> None:
    """Observe the loop's lateness into ``histogram`` every ``interval`` s until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        histogram.observe(max(0.0, loop.time() - due))
