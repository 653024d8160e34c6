"""The engine's asyncio shell: pacing against an injected clock, streams, cancellation, publishing."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from extproc.sim.engine_core import EngineCore, EngineParams, RequestOutput, SimRequest, StepResult
from extproc.sim.engine_loop import MIN_SLEEP_S, EngineLoop, RequestHandle
from extproc.sim.kv_events import KVEvent

BASE, RATE = 0.01, 1000.0


class FakeTime:
    """A monotonic clock that moves only when the loop sleeps (or a test moves it)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay
        await asyncio.sleep(0)


def _core(**overrides: Any) -> EngineCore:
    values: dict[str, Any] = {
        "block_size": 4,
        "num_gpu_blocks": 64,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
        "prefill_tokens_per_s": RATE,
        "decode_base_s": BASE,
        "decode_per_seq_s": 0.001,
    }
    values.update(overrides)
    return EngineCore(EngineParams(**values))


def _req(rid: str, prompt: int = 8, outputs: int = 5) -> SimRequest:
    return SimRequest(rid, [7 + i for i in range(prompt)], [500 + i for i in range(outputs)])


@asynccontextmanager
async def _running(
    core: EngineCore, fake: FakeTime | None = None, *, time_scale: float = 1.0, **kwargs: Any
) -> AsyncIterator[EngineLoop]:
    extra: dict[str, Any] = {"clock": fake.clock, "sleep": fake.sleep} if fake is not None else {}
    loop = EngineLoop(core, time_scale=time_scale, **extra, **kwargs)
    await loop.start()
    try:
        yield loop
    finally:
        await loop.close()


async def _collect(handle: RequestHandle) -> list[RequestOutput]:
    return [out async for out in handle]


async def test_tokens_arrive_in_order_with_model_timings() -> None:
    """The stream yields exactly the output tokens in order, then TTFT and finish are known."""
    fake, core = FakeTime(), _core()
    async with _running(core, fake) as loop:
        handle = loop.submit(_req("a", prompt=8, outputs=5))
        outs = await _collect(handle)
    assert [t for o in outs for t in o.new_token_ids] == [500, 501, 502, 503, 504]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[0].ttft == handle.ttft == pytest.approx(BASE + 8 / RATE)
    assert outs[-1].e2e == pytest.approx(fake.now - 100.0)
    assert (handle.finish, handle.num_cached_tokens) == ("completed", 0)


@pytest.mark.parametrize(
    ("time_scale", "grouped"), [(1.0, False), (0.25, False), (0.01, True)], ids=["real-time", "4x", "100x"]
)
async def test_wall_clock_follows_model_time(time_scale: float, grouped: bool) -> None:
    """Sleeps add up to model time x time_scale; sub-millisecond steps are grouped, never slept for."""
    fake, core = FakeTime(), _core()
    steps: list[StepResult] = []
    async with _running(core, fake, time_scale=time_scale, on_step=steps.append) as loop:
        outs = await _collect(loop.submit(_req("a", prompt=8, outputs=30)))
    model_end = steps[-1].start + steps[-1].duration
    assert steps[0].start == pytest.approx(0.0)
    assert outs[-1].e2e == pytest.approx(model_end)
    assert all(d >= MIN_SLEEP_S for d in fake.sleeps)
    assert abs((fake.now - 100.0) - model_end * time_scale) < MIN_SLEEP_S
    assert (len(fake.sleeps) < len(steps)) is grouped
    assert loop.lag_dropped_s == 0.0  # kept up: nothing given up


async def test_cancelled_consumer_aborts_and_frees_blocks() -> None:
    """A consumer task cancelled mid-stream (client gone) aborts the request and frees its blocks."""
    fake, core = FakeTime(), _core()
    got_one = asyncio.Event()

    async def consume(handle: RequestHandle) -> None:
        async for _ in handle:
            got_one.set()

    async with _running(core, fake) as loop:
        handle = loop.submit(_req("a", outputs=100))
        task = asyncio.create_task(consume(handle))
        await got_one.wait()
        assert core.kv_cache_usage > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert handle.finish == "aborted"
        assert not core.has_work and core.kv_cache_usage == 0.0


async def test_leaving_the_stream_early_aborts() -> None:
    """Breaking out inside ``async with handle`` aborts the request."""
    fake, core = FakeTime(), _core()
    async with _running(core, fake) as loop:
        async with loop.submit(_req("a", outputs=100)) as handle:
            async for _ in handle:
                break
        assert handle.finish == "aborted" and not core.has_work
        handle.cancel()  # harmless twice


async def test_publish_called_once_per_step_with_events() -> None:
    """Each step that produced KV events is published once, with the wall-clock timestamp."""
    fake, core = FakeTime(), _core()
    published: list[tuple[list[KVEvent], float]] = []
    steps: list[StepResult] = []
    kwargs: dict[str, Any] = {"publish": lambda ev, ts: published.append((ev, ts)), "on_step": steps.append}
    async with _running(core, fake, wall_clock=lambda: 1234.5, **kwargs) as loop:
        await asyncio.gather(*(_collect(loop.submit(_req(f"r{i}", prompt=10, outputs=9))) for i in range(3)))
    assert published == [(s.events, 1234.5) for s in steps if s.events]
    assert len(published) >= 3


async def test_close_ends_every_stream() -> None:
    """close() aborts requests in flight, ends their streams and refuses new ones."""
    fake, core = FakeTime(), _core()
    loop = EngineLoop(core, time_scale=1.0, clock=fake.clock, sleep=fake.sleep)
    await loop.start()
    handles = [loop.submit(_req(f"r{i}", outputs=200)) for i in range(3)]
    consumers = [asyncio.create_task(_collect(h)) for h in handles]
    await asyncio.sleep(0)
    await loop.close()
    results = await asyncio.gather(*consumers)
    assert all(not outs or not outs[-1].finished for outs in results)
    assert [h.finish for h in handles] == ["aborted"] * 3
    assert not core.has_work and core.kv_cache_usage == 0.0
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(_req("late"))


async def test_idle_loop_waits_without_sleeping() -> None:
    """With no work the loop parks on an event: no sleeps, no steps; a submit wakes it."""
    fake, core = FakeTime(), _core()
    steps: list[StepResult] = []
    async with _running(core, fake, on_step=steps.append) as loop:
        for _ in range(20):
            await asyncio.sleep(0)
        assert fake.sleeps == [] and steps == []
        fake.now += 5.0
        outs = await _collect(loop.submit(_req("a", outputs=2)))
        assert steps[0].start == pytest.approx(5.0)
        assert outs[0].ttft == pytest.approx(BASE + 8 / RATE)


async def test_arrivals_while_busy_queue_behind_the_step_in_progress() -> None:
    """A request submitted mid-step arrives no later than the next step's start: queue time >= 0."""
    fake, core = FakeTime(), _core()
    async with _running(core, fake) as loop:
        first = loop.submit(_req("a", outputs=20))
        seen = 0
        async for _ in first:
            seen += 1
            if seen == 3:
                fake.now += 0.004  # part way into the next step
                second = loop.submit(_req("b", prompt=4, outputs=2))
        outs = await _collect(second)
    assert outs[0].queue_time is not None and outs[0].queue_time >= 0.0
    assert outs[0].ttft is not None and outs[0].ttft > outs[0].queue_time


async def test_falling_behind_drops_the_debt() -> None:
    """When steps take longer on the wall than in the model, the loop never sleeps and resyncs."""
    fake = FakeTime()

    class SlowCore(EngineCore):
        def step(self, now: float) -> StepResult:
            fake.now += 1.0  # a very slow CPU: each step costs a wall second
            return super().step(now)

    core = SlowCore(_core().params)
    steps: list[StepResult] = []
    async with _running(core, fake, on_step=steps.append, max_lag_s=0.1) as loop:
        outs = await _collect(loop.submit(_req("a", outputs=5)))
    assert fake.sleeps == []
    starts = [s.start for s in steps]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(starts)), starts
    assert outs[-1].e2e is not None and outs[-1].e2e >= 4.0
    assert loop.lag_dropped_s >= 4 * 0.9  # each step's wall second, less the model's own step time


async def test_observer_failures_do_not_stop_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    """A publisher or hook that raises is logged; requests still complete."""

    def boom(*_: object) -> None:
        raise RuntimeError("observer broke")

    fake, core = FakeTime(), _core()
    with caplog.at_level(logging.ERROR, logger="extproc.sim.engine_loop"):
        async with _running(core, fake, publish=boom, on_step=boom, on_output=boom) as loop:
            handle = loop.submit(_req("a", outputs=3))
            await _collect(handle)
    assert handle.finish == "completed"
    assert "observer broke" in caplog.text


async def test_invalid_request_is_refused_at_submit() -> None:
    """submit() raises the core's ValueError and registers nothing."""
    fake, core = FakeTime(), _core()
    async with _running(core, fake) as loop:
        with pytest.raises(ValueError, match="max_model_len"):
            loop.submit(_req("a", prompt=250, outputs=10))
        assert not core.has_work


async def test_real_clock_with_a_tiny_time_scale() -> None:
    """End to end on the real clock at 1000x: every token arrives, in order."""
    core = _core()
    collected: dict[str, list[int]] = {}

    async def run(rid: str, loop: EngineLoop) -> None:
        outs = await _collect(loop.submit(_req(rid, prompt=12, outputs=25)))
        collected[rid] = [t for o in outs for t in o.new_token_ids]

    async with _running(core, time_scale=0.001) as loop:
        await asyncio.wait_for(asyncio.gather(*(run(f"r{i}", loop) for i in range(4))), timeout=10)
    assert collected == {f"r{i}": list(range(500, 525)) for i in range(4)}


def test_time_scale_must_be_positive() -> None:
    """A zero or negative time scale is refused."""
    with pytest.raises(ValueError, match="time_scale"):
        EngineLoop(_core(), time_scale=0.0)
