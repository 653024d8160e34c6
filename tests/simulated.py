"""Simulated engines for tests: the one factory fixture (``sim``, in the root conftest) and its types.

async def test_x(sim: StartSim) -> None:
    engine = await sim(served_model_names=("m",), engine={"num_gpu_blocks": 32})
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from extproc.sim.engine_core import EngineParams
from extproc.sim.server import SimServer
from extproc.sim.settings import SimSettings

#: A small, fast engine: 16-token blocks, a few dozen of them.
SMALL_ENGINE = EngineParams(num_gpu_blocks=64, max_model_len=512, max_num_batched_tokens=512)

StartSim = Callable[..., Awaitable[SimServer]]


async def simulated_engines() -> AsyncIterator[StartSim]:
    """Factory: ``await sim(**SimSettings fields)`` -> a started SimServer on 127.0.0.1, port 0.

    ``engine=`` may be an EngineParams or a dict of overrides on :data:`SMALL_ENGINE`; time runs at
    1/100 unless ``time_scale`` says otherwise. Everything started is stopped at teardown.
    """
    started: list[SimServer] = []

    async def start(**fields: Any) -> SimServer:
        engine = fields.pop("engine", {})
        if isinstance(engine, dict):
            engine = dataclasses.replace(SMALL_ENGINE, **engine)
        fields.setdefault("time_scale", 0.01)
        fields.setdefault("listen", "127.0.0.1:0")
        server = SimServer(SimSettings(engine=engine, **fields))
        await server.start()
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            await server.stop()


def idle(server: SimServer) -> bool:
    """No request running or waiting on any rank."""
    return all(rank.core.num_running == 0 and rank.core.num_waiting == 0 for rank in server.ranks)
