"""Pollers' sleep: woken early by their event, or after the interval, and always cancellable."""

from __future__ import annotations

import asyncio

import pytest

from extproc.tasks import sleep_or_wake


async def test_returns_when_woken() -> None:
    """Setting the event ends the sleep long before the interval."""
    event = asyncio.Event()
    task = asyncio.create_task(sleep_or_wake(event, 60))
    await asyncio.sleep(0)
    event.set()
    await asyncio.wait_for(task, 5)


async def test_returns_after_the_interval() -> None:
    """Without a wake-up it returns once the interval passed."""
    await asyncio.wait_for(sleep_or_wake(asyncio.Event(), 0.01), 5)


@pytest.mark.parametrize("interval", [0.0, 0.001, 60.0], ids=["zero", "racing", "long"])
async def test_cancellation_always_propagates(interval: float) -> None:
    """Cancelling a sleeper raises CancelledError in it, even when its interval ends at that moment."""
    for _ in range(50):
        task = asyncio.create_task(sleep_or_wake(asyncio.Event(), interval))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
