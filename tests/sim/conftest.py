"""Fixtures: real simulated engines (HTTP on loopback, real ZMQ), stopped at teardown."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from extproc.sim.engine_core import EngineParams
from extproc.sim.server import SimServer
from extproc.sim.settings import SimSettings

#: A small, fast engine: 16-token blocks, a few dozen of them, 1/100 of real time.
SMALL_ENGINE = EngineParams(num_gpu_blocks=64, max_model_len=512, max_num_batched_tokens=512)

StartSim = Callable[..., Awaitable[SimServer]]


@pytest.fixture
async def sim() -> AsyncIterator[StartSim]:
    """Factory: ``await sim(**SimSettings fields)`` -> a started SimServer on 127.0.0.1 port 0.

    ``engine=`` may be an EngineParams or a dict of overrides on :data:`SMALL_ENGINE`.
    """
    started: list[SimServer] = []

    async def start(**fields: Any) -> SimServer:
        engine = fields.pop("engine", {})
        if isinstance(engine, dict):
            engine = dataclasses.replace(SMALL_ENGINE, **engine)
        fields.setdefault("time_scale", 0.01)
        server = SimServer(SimSettings(listen="127.0.0.1:0", engine=engine, **fields))
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Poll ``condition`` until true; fail the test with a TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 - polls state owned by other tasks
            await asyncio.sleep(0.005)


def idle(server: SimServer) -> bool:
    """No request running or waiting on any rank."""
    return all(rank.core.num_running == 0 and rank.core.num_waiting == 0 for rank in server.ranks)
