"""A whole gateway for end-to-end tests: real Envoy -> our ext_proc server -> fake model servers.

``routed_gateway(...)`` starts three backends for ``llama`` (alias ``chat``), one for ``qwen``, a
worker set whose only pod is not ready, the ext_proc server in-process on free ports reading the
catalog from a real file, and real Envoy from a shipped config in the requested body mode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

from extproc.demo.backends import Backend
from extproc.demo.catalog import LocalWorkerSet, catalog_yaml
from extproc.serve.app import Server
from extproc.settings import ServeSettings, SourceSettings

LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"
QWEN = "Qwen/Qwen2-7B-Instruct"


def worker_sets(
    llama: list[Backend], qwen: Backend, *, llama_aliases: tuple[str, ...] = ("chat",)
) -> list[LocalWorkerSet]:
    """The catalog the tests start with (``llama_aliases`` lets a test change it live)."""
    return [
        LocalWorkerSet("llama", LLAMA, [b.address for b in llama], aliases=llama_aliases),
        LocalWorkerSet("qwen", QWEN, [qwen.address], aliases=["qwen"]),
        # A model that exists but has no ready pod: its requests must get 503.
        LocalWorkerSet("cold", "cold-model", [], not_ready=["127.0.0.1:9"]),
    ]


def write_catalog(path: Path, sets: list[LocalWorkerSet]) -> None:
    """Replace the file atomically, as a ConfigMap update or an editor would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(catalog_yaml(sets))
    tmp.replace(path)


@dataclass
class Routed:
    url: str
    server: Server
    llama: list[Backend]
    qwen: Backend
    catalog_path: Path
    gateway: Any


RoutedFactory = Callable[..., Awaitable[Routed]]


@pytest.fixture
async def routed_gateway(
    backends: Callable[..., Awaitable[list[Backend]]],
    envoy_gateway: Callable[..., Awaitable[Any]],
    tmp_path: Path,
) -> AsyncIterator[RoutedFactory]:
    servers: list[Server] = []

    async def start(
        *,
        body_mode: str = "FULL_DUPLEX_STREAMED",
        config: str = "gateway.yaml",
        max_body_bytes: int = 16 * 1024 * 1024,
        max_fallbacks: int = 2,
        edit: Callable[[dict[str, Any], list[Backend]], None] | None = None,
        **backend_options: Any,
    ) -> Routed:
        llama = await backends(3, models=[LLAMA], strict_models=True, **backend_options)
        [qwen] = await backends(1, models=[QWEN], strict_models=True, **backend_options)
        catalog_path = tmp_path / "catalog.yaml"
        write_catalog(catalog_path, worker_sets(llama, qwen))
        settings = ServeSettings(
            source=SourceSettings.parse(f"file:{catalog_path}", poll_interval=0.05),
            listen=f"127.0.0.1:{free_port()}",
            admin_listen="127.0.0.1:0",
            max_body_bytes=max_body_bytes,
            max_fallbacks=max_fallbacks,
            seed=1,
            drain_seconds=0.5,
        )
        server = Server(settings)
        await server.start()
        servers.append(server)
        pool = None if config == "gateway-original-dst.yaml" else [*llama, qwen]
        gateway = await envoy_gateway(
            extproc_address=("127.0.0.1", server.grpc_port),
            pool=pool,
            config=config,
            body_mode=body_mode,
            edit=None if edit is None else lambda rendered: edit(rendered, llama),
        )
        return Routed(gateway.url, server, llama, qwen, catalog_path, gateway)

    try:
        yield start
    finally:
        for server in servers:
            await server.stop()
