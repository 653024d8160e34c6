"""Shared fixtures: real fake-model backends and a real Envoy running a shipped gateway config.

Both are factories so a test decides how many backends it needs and how Envoy is wired; everything
a factory started is stopped at teardown, whatever the test did.

    async def test_x(backends, envoy_gateway):
        pool = await backends(3)
        gw = await envoy_gateway(extproc_address=("127.0.0.1", grpc_port), pool=pool)
        async with aiohttp.ClientSession() as s:
            await s.post(f"{gw.url}/v1/chat/completions", json=...)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ports import free_port
from simulated import StartSim, simulated_engines

from extproc.demo.backends import Backend
from extproc.gateway.config import BodyMode, HeaderSendMode, load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess

StartBackends = Callable[..., Awaitable[list[Backend]]]


@dataclass(frozen=True, slots=True)
class Gateway:
    """A running Envoy gateway from a shipped config, with the ports it was rendered with."""

    envoy: EnvoyProcess
    config: dict[str, Any]
    listen_port: int
    admin_port: int
    log_path: Path

    @property
    def url(self) -> str:
        """Base URL of the gateway listener, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.listen_port}"


StartGateway = Callable[..., Awaitable[Gateway]]


@pytest.fixture
async def backends() -> AsyncIterator[StartBackends]:
    """Factory: ``await backends(n, **Backend_kwargs) -> list[Backend]``, started on free ports.

    Names run ``backend-1``, ``backend-2``, ... across calls within one test.
    """
    started: list[Backend] = []

    async def start(count: int = 1, **kwargs: Any) -> list[Backend]:
        new: list[Backend] = []
        for _ in range(count):
            backend = Backend(f"backend-{len(started) + 1}", **kwargs)
            await backend.start("127.0.0.1", 0)
            started.append(backend)
            new.append(backend)
        return new

    try:
        yield start
    finally:
        for backend in started:
            await backend.stop()


def _endpoint(item: Backend | tuple[str, int]) -> tuple[str, int]:
    if isinstance(item, Backend):
        return (item.host, item.port)
    return (item[0], int(item[1]))


@pytest.fixture
async def envoy_gateway(tmp_path: Path) -> AsyncIterator[StartGateway]:
    """Factory: real Envoy running a shipped config (``envoy/<config>``) on free loopback ports.

    ``await envoy_gateway(*, extproc_address, pool=None, config="gateway.yaml",
    body_mode="FULL_DUPLEX_STREAMED", response_header_mode=None, log_level="warn",
    edit=None) -> Gateway``

    - ``extproc_address``: ``(host, port)`` of the ext_proc gRPC server (need not be up yet);
    - ``pool``: Backends or ``(host, port)`` for cluster ``pool``; None keeps the file's endpoints
      (required for ``gateway-original-dst.yaml``);
    - ``edit``: optional ``callable(config_dict) -> None`` applied after rendering, for tests that
      need a variant (e.g. ``failure_mode_allow: true``).

    Returns once Envoy's admin ``/ready`` is LIVE. Envoy's log is kept in ``tmp_path``.
    """
    running: list[EnvoyProcess] = []

    async def start(
        *,
        extproc_address: tuple[str, int],
        pool: Sequence[Backend | tuple[str, int]] | None = None,
        config: str = "gateway.yaml",
        body_mode: BodyMode = "FULL_DUPLEX_STREAMED",
        response_header_mode: HeaderSendMode | None = None,
        log_level: str = "warn",
        edit: Callable[[dict[str, Any]], None] | None = None,
    ) -> Gateway:
        listen_port, admin_port = free_port(), free_port()
        rendered = render_config(
            load_config(shipped_config(config)),
            listen_port=listen_port,
            admin_port=admin_port,
            extproc_address=extproc_address,
            pool_endpoints=None if pool is None else [_endpoint(p) for p in pool],
            body_mode=body_mode,
            response_header_mode=response_header_mode,
        )
        if edit is not None:
            edit(rendered)
        log_path = tmp_path / f"envoy-{len(running) + 1}.log"
        envoy = EnvoyProcess(rendered, log_path=log_path, log_level=log_level)
        await envoy.start()
        running.append(envoy)
        return Gateway(envoy, rendered, listen_port, admin_port, log_path)

    try:
        yield start
    finally:
        for envoy in running:
            await envoy.stop()


@pytest.fixture
async def sim() -> AsyncIterator[StartSim]:
    """Factory of simulated engines (see :func:`simulated.simulated_engines`), stopped at teardown."""
    async for start in simulated_engines():
        yield start
