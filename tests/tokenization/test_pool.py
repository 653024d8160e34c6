"""Tokenization off the event loop: results come back, the loop keeps running, and both bounds hold."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from extproc.tokenize.pool import TokenizePool


async def test_a_call_runs_in_a_worker_thread_while_the_loop_goes_on() -> None:
    pool = TokenizePool(threads=2, budget=5.0)
    loop_thread = threading.get_ident()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    def slow() -> int:
        assert threading.get_ident() != loop_thread
        time.sleep(0.2)  # releases the GIL, as a long encode does
        return 42

    task = asyncio.create_task(ticker())
    try:
        assert await pool.run(slow) == 42
    finally:
        task.cancel()
        pool.close()
    assert ticks >= 10  # the loop ran throughout
    assert (pool.pending, pool.completed, pool.fallbacks) == (0, 1, {"queue_full": 0, "budget": 0})


async def test_past_its_budget_a_request_goes_on_without_the_result() -> None:
    """The caller gets None at the budget; the call still holds its place until it ends."""
    pool = TokenizePool(threads=1, max_pending=4, budget=0.05)
    release = threading.Event()
    try:
        started = time.monotonic()
        assert await pool.run(lambda: release.wait(5)) is None
        assert time.monotonic() - started < 1.0
        assert pool.fallbacks["budget"] == 1 and pool.pending == 1
        release.set()
        for _ in range(200):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.pending == 0
    finally:
        release.set()
        pool.close()


async def test_a_full_queue_sends_requests_on_at_once() -> None:
    pool = TokenizePool(threads=1, max_pending=2, budget=5.0)
    release = threading.Event()
    try:
        waiting = [asyncio.create_task(pool.run(lambda: release.wait(5))) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert pool.pending == 2
        assert await pool.run(lambda: 1) is None  # no third place: not even tried
        assert pool.fallbacks == {"queue_full": 1, "budget": 0}
        release.set()
        assert await asyncio.gather(*waiting) == [True, True]
        assert await pool.run(lambda: 1) == 1  # room again
    finally:
        release.set()
        pool.close()


async def test_a_calls_exception_reaches_the_caller() -> None:
    pool = TokenizePool(threads=1)

    def broken() -> None:
        raise ValueError("template says no")

    try:
        with pytest.raises(ValueError, match="template says no"):
            await pool.run(broken)
        assert pool.pending == 0
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"threads": 0}, "threads"), ({"max_pending": 0}, "max_pending"), ({"budget": 0}, "budget")],
)
def test_bounds_must_be_positive(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TokenizePool(**kwargs)  # type: ignore[arg-type]
