"""Owned background tasks: how an owner stops one it started, and how a poller sleeps.

Pollers sleep until their interval passes or something wakes them, and must stay cancellable.
``contextlib.suppress(TimeoutError)`` around ``asyncio.timeout`` / ``wait_for`` looks equivalent,
but on Python 3.11 a cancellation that lands as the timeout fires can surface as TimeoutError, be
suppressed, and leave a poller running forever while ``close()`` awaits it. ``asyncio.wait``
never turns a cancellation into anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Self


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has really finished, so nothing it does outlives us."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def sleep_or_wake(event: asyncio.Event, seconds: float) -> None:
    """Return when ``event`` is set or ``seconds`` have passed; a cancellation always propagates."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=max(seconds, 0.0))
    finally:
        waiter.cancel()


class StartStop:
    """``async with`` for what has ``start()`` and ``stop()``: stopped however the block ends."""

    async def start(self) -> object:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
