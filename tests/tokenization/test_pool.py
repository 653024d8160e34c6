"""Tokenization off the event loop: results come back, the loop keeps running, and both bounds hold."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator

import pytest

from extproc.tokenize import pool as pool_module
from extproc.tokenize.pool import TokenizePool


@contextlib.contextmanager
def pool_and_release(
    *, budget: float, max_pending: int = 256
) -> Iterator[tuple[TokenizePool, threading.Event]]:
    """A one-thread pool, and the event its blocking test calls wait on; both let go at the end,
    whatever the test asserted."""
    pool = TokenizePool(threads=1, max_pending=max_pending, budget=budget)
    release = threading.Event()
    try:
        yield pool, release
    finally:
        release.set()
        pool.close()


async def settle(pool: TokenizePool) -> None:
    """Until every prompt, late ones included, has run."""
    for _ in range(500):
        if pool.pending == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{pool.pending} prompts still pending")


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
    with pool_and_release(max_pending=4, budget=0.05) as (pool, release):
        started = time.monotonic()
        assert await pool.run(lambda: release.wait(5)) is None
        assert time.monotonic() - started < 1.0
        assert pool.fallbacks["budget"] == 1 and pool.pending == 1
        release.set()
        await settle(pool)


async def test_a_full_queue_sends_requests_on_at_once() -> None:
    with pool_and_release(max_pending=2, budget=5.0) as (pool, release):
        waiting = [asyncio.create_task(pool.run(lambda: release.wait(5))) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert pool.pending == 2
        assert await pool.run(lambda: 1) is None  # no third place: not even tried
        assert pool.fallbacks == {"queue_full": 1, "budget": 0}
        release.set()
        assert await asyncio.gather(*waiting) == [True, True]
        assert await pool.run(lambda: 1) == 1  # room again


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


async def test_a_prompt_that_cannot_be_ready_in_time_is_answered_at_once_and_still_runs() -> None:
    """Once the workers' speed is known, a prompt too big for the budget does not make its request
    wait the budget out, and it still runs when a worker is free (it teaches the segment tree)."""
    ran: list[str] = []
    with pool_and_release(budget=2.0) as (pool, release):
        # 2,000 characters in ~100 ms: the pool learns ~50 us per character.
        assert await pool.run(lambda: time.sleep(0.1) or "measured", size=2000) == "measured"
        holding = asyncio.create_task(pool.run(lambda: release.wait(5), size=1))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        # ~5 s of work against a 2 s budget.
        assert await pool.run(lambda: ran.append("big"), size=100_000) is None
        assert time.monotonic() - started < 1.0  # not the budget's 2 s
        assert pool.fallbacks == {"queue_full": 0, "budget": 1}
        assert ran == []  # the only worker is busy with a prompt someone waits for
        release.set()
        assert await holding is True
        await settle(pool)
        assert ran == ["big"]  # run once the worker was free


async def test_a_waiting_prompt_that_would_finish_too_late_is_not_started() -> None:
    """Workers take the oldest prompt that can still be ready in time; one that cannot is answered
    when its turn comes, and the prompt behind it goes first."""
    order: list[str] = []
    with pool_and_release(budget=1.0) as (pool, release):
        await pool.run(lambda: time.sleep(0.1) or "measured", size=2000)  # ~50 us a character
        holding = asyncio.create_task(pool.run(lambda: release.wait(5), size=1))
        await asyncio.sleep(0.05)
        # Each fits a 1 s budget alone (~0.6 s), but not after ~0.6 s of waiting.
        first = asyncio.create_task(pool.run(lambda: order.append("first") or "first", size=12_000))
        await asyncio.sleep(0.6)
        second = asyncio.create_task(pool.run(lambda: order.append("second") or "second", size=100))
        await asyncio.sleep(0.05)
        release.set()
        assert await holding is True
        assert await first is None  # its turn came too late to be ready in time
        assert await second == "second"
        await settle(pool)
        assert order == ["second", "first"]  # the late one ran after, for the tree
        assert pool.fallbacks["budget"] == 1


async def test_a_late_prompt_gives_up_its_place_in_a_full_queue() -> None:
    ran: list[str] = []
    with pool_and_release(max_pending=2, budget=0.05) as (pool, release):
        holding = asyncio.create_task(pool.run(lambda: release.wait(5)))  # runs past its budget
        await asyncio.sleep(0.01)
        assert await pool.run(lambda: ran.append("late")) is None  # waits, then late
        assert pool.pending == 2
        # The queue is full of a running prompt and a late one: the late one makes room.
        newest = asyncio.create_task(pool.run(lambda: ran.append("newest")))
        await asyncio.sleep(0)
        assert pool.dropped == 1 and pool.fallbacks["queue_full"] == 0
        release.set()
        await holding
        await newest
        await settle(pool)
        assert ran == ["newest"]  # the dropped one never ran


def one_off(seed: int) -> bytes:
    """A body no other prompt began like (long enough for its opening to be judged)."""
    return random.Random(seed).randbytes(64 << 10)


async def test_a_late_prompt_runs_only_when_its_opening_recurs() -> None:
    """A one-off prompt past its budget is not tokenized afterwards (it would teach nothing); a
    conversation's next turn, which repeats the history, is."""
    ran: list[str] = []
    with pool_and_release(budget=0.05) as (pool, release):
        first_turn = one_off(1)
        next_turn = first_turn + b" and one more message"
        for name, opening in (("first turn", first_turn), ("one-off", one_off(2)), ("next turn", next_turn)):
            holding = asyncio.create_task(pool.run(lambda: release.wait(5)))  # the only worker: busy
            await asyncio.sleep(0.01)
            assert await pool.run(lambda name=name: ran.append(name), opening=opening) is None
            release.set()
            await holding
            await settle(pool)
            release.clear()
        assert ran == ["next turn"]
        assert pool.skipped == 2 and pool.fallbacks["budget"] == 6  # the three holding ones too


async def test_a_speed_learned_while_cores_were_short_is_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Workers measured slow turn long prompts away at once; once nothing has measured them for a
    while, the next long prompt is tried again, and fits when the cores are free."""
    monkeypatch.setattr(pool_module, "SPEED_STALE_S", 0.3)
    ran: list[int] = []
    with pool_and_release(budget=1.0) as (pool, _):
        # 2,000 characters in ~100 ms: ~50 us a character, so 100,000 cannot make a 1 s budget.
        await pool.run(lambda: time.sleep(0.1), size=2000)
        started = time.monotonic()
        assert await pool.run(lambda: ran.append(1), size=100_000, opening=one_off(1)) is None
        assert time.monotonic() - started < 0.5  # turned away at once, not after the budget
        await settle(pool)
        assert ran == [] and pool.skipped == 1  # a one-off is not tokenized late
        await asyncio.sleep(0.4)
        assert await pool.run(lambda: 2, size=100_000, opening=one_off(2)) == 2  # tried: fast now
        assert await pool.run(lambda: 3, size=100_000, opening=one_off(3)) == 3  # and known to be


async def test_a_stale_speed_is_measured_by_one_prompt_not_every_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once stale, the first long prompt is tried whatever the speed says; those arriving while it
    runs are still judged by the old speed, so one-off prompts on busy cores are not all tokenized."""
    monkeypatch.setattr(pool_module, "SPEED_STALE_S", 0.3)
    pool = TokenizePool(threads=2, budget=1.0)  # a free thread for the second, were it tried
    release = threading.Event()
    try:
        await pool.run(lambda: time.sleep(0.1), size=2000)  # ~50 us a character: 100,000 is too big
        await asyncio.sleep(0.4)
        tried = asyncio.create_task(pool.run(lambda: release.wait(5), size=100_000, opening=one_off(1)))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        assert await pool.run(lambda: "second", size=100_000, opening=one_off(2)) is None
        assert time.monotonic() - started < 0.5  # turned away at once: the first one measures
        release.set()
        assert await tried is True
    finally:
        release.set()
        pool.close()
