"""The one way tests wait for state that another task or process changes.

Tests never sleep for time to pass; they poll a condition and fail with a message naming what
did not happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    check: Callable[[], bool],
    *,
    within: float = 5.0,
    what: str = "condition",
    tick: Callable[[], object] | None = None,
    every: float = 0.005,
) -> None:
    """Poll ``check`` every ``every`` s (calling ``tick`` first, if given) until it holds.

    Fails with an AssertionError naming ``what`` after ``within`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not met within {within:g} s")
        if tick is not None:
            tick()
        await asyncio.sleep(every)


async def until(
    check: Callable[[], Awaitable[T]], *, within: float = 5.0, what: str = "condition", every: float = 0.02
) -> T:
    """``eventually`` for a check that must await (an HTTP call, a process's state): await ``check()``
    every ``every`` s until it returns something truthy, and return that.

    Fails with an AssertionError naming ``what`` and the last value after ``within`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not (value := await check()):
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not met within {within:g} s (last: {value!r})")
        await asyncio.sleep(every)
    return value
