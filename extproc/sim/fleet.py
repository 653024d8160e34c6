"""N simulated engines on loopback with distinct ports, from one set of settings.

Python API for tests, benchmarks and the demo::

    async with SimFleet(settings, replicas=4) as fleet:
        fleet.addresses        # ["127.0.0.1:8000", "127.0.0.1:8001", ...]
        fleet.servers[0].state()

Replica ``i`` listens on the base port + ``i`` and publishes KV events on the base KV ports +
``i * data_parallel_size`` (each replica's ranks add their own offset on top, as vLLM does), so a
fleet started from ``--listen 127.0.0.1:8000 --kv-events-port 5557`` is predictable. Port 0 stays
0: every replica and rank then gets a free port of its own (see ``state()``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from types import TracebackType
from typing import Self

from extproc.addresses import parse_host_port
from extproc.errors import ConfigError
from extproc.sim.server import SimServer
from extproc.sim.settings import SimSettings

MAX_REPLICAS = 256


def replica_settings(settings: SimSettings, index: int) -> SimSettings:
    """The settings of replica ``index``: ports shifted, everything else shared."""
    host, port = parse_host_port(settings.listen, what="--listen")
    listen = f"{host}:{port + index}" if port else f"{host}:0"
    kv = settings.kv_events
    if kv is not None:
        stride = index * settings.data_parallel_size
        kv = replace(
            kv,
            port=kv.port + stride if kv.port else 0,
            replay_port=(kv.replay_port + stride if kv.replay_port else 0)
            if kv.replay_port is not None
            else None,
        )
    return replace(settings, listen=listen, kv_events=kv, seed=settings.seed + 1000 * index)


def check_port_layout(settings: SimSettings, replicas: int) -> None:
    """ConfigError when the shifted port ranges of HTTP, KV events and replay would collide."""
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"--replicas must be in 1-{MAX_REPLICAS}, got {replicas}")
    _, port = parse_host_port(settings.listen, what="--listen")
    ranges: dict[str, range] = {}
    if port:
        ranges["--listen"] = range(port, port + replicas)
    kv = settings.kv_events
    width = replicas * settings.data_parallel_size
    if kv is not None and kv.port:
        ranges["--kv-events-port"] = range(kv.port, kv.port + width)
    if kv is not None and kv.replay_port:
        ranges["--kv-replay-port"] = range(kv.replay_port, kv.replay_port + width)
    for flag, taken in ranges.items():
        if taken[-1] > 65535:
            raise ConfigError(f"{flag} {taken[0]} + {len(taken)} ports runs past 65535")
    names = list(ranges)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = ranges[first], ranges[second]
            if a.start < b.stop and b.start < a.stop:
                raise ConfigError(
                    f"{first} ports {a.start}-{a.stop - 1} and {second} ports {b.start}-{b.stop - 1} "
                    f"overlap with {replicas} replica(s); move one of them"
                )


class SimFleet:
    """Starts ``replicas`` :class:`SimServer` s in this process and stops them all on exit."""

    def __init__(self, settings: SimSettings, *, replicas: int) -> None:
        check_port_layout(settings, replicas)
        self.settings = settings
        self.replicas = replicas
        self.servers: list[SimServer] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Self:
        try:
            for index in range(self.replicas):
                server = SimServer(replica_settings(self.settings, index))
                await self._stack.enter_async_context(server)
                self.servers.append(server)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()
        self.servers.clear()

    @property
    def addresses(self) -> list[str]:
        return [server.address for server in self.servers]
