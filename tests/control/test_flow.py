"""Flow control's queue on a real event loop: order by priority, fairness by tokens, shedding, and
that every held request ends exactly once (dispatched, shed or cancelled)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from extproc.control.flow import FlowControl, FlowMetrics
from extproc.errors import Overloaded, Saturated
from extproc.settings import FlowSettings


class Pool:
    """Seats that requests take when dispatched; ``free()`` gives one back and wakes the queue."""

    def __init__(self, seats: int = 0) -> None:
        self.seats = seats
        self.order: list[str] = []
        self.lost: list[str] = []
        self.registry = CollectorRegistry()
        self.flow: FlowControl[str] = FlowControl(
            FlowSettings(max_queue=8, queue_timeout=30),
            FlowMetrics(self.registry),
            on_lost=self.lost.append,
        )

    def attempt(self, name: str) -> Callable[[], str]:
        def take() -> str:
            if self.seats == 0:
                raise Saturated("full")
            self.seats -= 1
            self.order.append(name)
            return name

        return take

    def hold(
        self, name: str, *, priority: int = 0, flow: str = "default", cost: int = 100
    ) -> asyncio.Task[str]:
        return asyncio.create_task(
            self.flow.hold("pool", self.attempt(name), priority=priority, flow=flow, cost=cost, why="full")
        )

    async def free(self, seats: int = 1) -> None:
        self.seats += seats
        self.flow.wake()
        await settle()

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_higher_priority_goes_first_whatever_the_arrival_order() -> None:
    pool = Pool()
    low = [pool.hold(f"low{i}") for i in range(3)]
    await settle()
    high = pool.hold("high", priority=10)
    await settle()
    assert pool.flow.debug_state()["waiting"] == {"pool": {"10": 1, "0": 3}}
    await pool.free()
    assert pool.order == ["high"]
    await pool.free(3)
    assert pool.order == ["high", "low0", "low1", "low2"]
    assert [t.result() for t in low] == ["low0", "low1", "low2"] and high.result() == "high"
    assert pool.metric("extproc_flow_requests_total", outcome="dispatched") == 4
    assert pool.metric("extproc_flow_queue_length", priority="0") == 0


async def test_a_light_flow_is_not_starved_by_a_heavy_one() -> None:
    """Start-time fair queuing: the light tenant's request starts at the current virtual time, ahead
    of the heavy tenant's backlog, though it came last."""
    pool = Pool()
    heavy = [pool.hold(f"heavy{i}", flow="heavy") for i in range(6)]
    await settle()
    await pool.free()  # heavy0 runs
    light = pool.hold("light", flow="light")
    await settle()
    await pool.free(2)
    assert pool.order == ["heavy0", "light", "heavy1"]
    await pool.free(4)
    await asyncio.gather(*heavy, light)
    assert pool.metric("extproc_flow_served_tokens_total", fairness_id="light") == 100
    assert pool.metric("extproc_flow_served_tokens_total", fairness_id="heavy") == 600


async def test_fairness_is_by_tokens_not_requests() -> None:
    """A flow of large requests gets fewer of them through than a flow of small ones."""
    pool = Pool()
    pool.flow.settings = FlowSettings(max_queue=16, queue_timeout=30)
    big = [pool.hold(f"big{i}", flow="big", cost=400) for i in range(4)]
    small = [pool.hold(f"small{i}", flow="small", cost=100) for i in range(8)]
    await settle()
    await pool.free(6)
    # Tags: big 0, 400, ...; small 0, 100, 200, ...: four small ones per big one.
    assert pool.order == ["big0", "small0", "small1", "small2", "small3", "big1"]
    await pool.free(6)
    await asyncio.gather(*big, *small)


async def test_a_request_that_waits_too_long_gets_429_with_retry_after() -> None:
    pool = Pool()
    pool.flow.settings = FlowSettings(max_queue=8, queue_timeout=0.05)
    held = pool.hold("late")
    with pytest.raises(Overloaded) as refused:
        await held
    assert refused.value.code == "timeout" and refused.value.status == 429
    assert refused.value.retry_after == 1
    assert "queue timeout" in refused.value.message
    assert pool.flow.waiting() == 0
    assert pool.metric("extproc_flow_wait_seconds_count", outcome="timeout") == 1


async def test_a_full_queue_pushes_out_its_lowest_newest_for_a_higher_priority() -> None:
    pool = Pool()
    pool.flow.settings = FlowSettings(max_queue=3, queue_timeout=30)
    old, newer = pool.hold("p0-old"), None
    await settle()
    newer = pool.hold("p0-new")
    mid = pool.hold("p5", priority=5)
    await settle()
    # Full: an equal or lower priority is refused at once.
    with pytest.raises(Overloaded) as full:
        await pool.hold("p0-late")
    assert full.value.code == "queue_full"
    high = pool.hold("p10", priority=10)
    await settle()
    with pytest.raises(Overloaded) as pushed:
        await newer
    assert pushed.value.code == "displaced"
    await pool.free(3)
    assert pool.order == ["p10", "p5", "p0-old"]
    assert {await old, await mid, await high} == {"p0-old", "p5", "p10"}


async def test_a_client_that_leaves_leaves_the_queue_at_once() -> None:
    pool = Pool()
    gone = pool.hold("gone")
    stays = pool.hold("stays")
    await settle()
    gone.cancel()
    await settle()
    assert gone.cancelled() and pool.flow.waiting() == 1
    await pool.free()
    assert pool.order == ["stays"] and await stays == "stays"
    assert pool.metric("extproc_flow_requests_total", outcome="cancelled") == 1


async def test_dispatched_as_its_client_left_gives_the_pick_back() -> None:
    """The decision was made (a lease taken) in the same loop turn the client went: nobody will
    answer it, so it is handed to ``on_lost`` (request control releases the lease)."""
    pool = Pool()
    held = pool.hold("racing")
    await settle()
    pool.seats = 1
    pool.flow.wake()
    await asyncio.sleep(0)  # the dispatch runs: the request is decided, its task not yet resumed
    assert pool.order == ["racing"]
    held.cancel()
    await settle()
    assert held.cancelled()
    assert pool.lost == ["racing"]


async def test_an_error_when_its_turn_comes_is_the_requests_answer() -> None:
    """The model vanished while it waited: it gets that error, and the queue goes on."""
    pool = Pool()

    def vanished() -> str:
        raise Overloaded("boom", code="other")

    failing = asyncio.create_task(pool.flow.hold("pool", vanished, priority=1, flow="a", cost=1, why="full"))
    after = pool.hold("after")
    await settle()
    await pool.free()
    with pytest.raises(Overloaded, match="boom"):
        await failing
    assert await after == "after"
