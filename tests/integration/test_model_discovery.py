"""Model discovery through serve: a worker set that declares no models learns them from its engines."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
from waiting import eventually

from extproc.errors import BadRequest
from extproc.openai import read_request
from extproc.serve.app import Server
from extproc.sim.server import SimServer
from extproc.sim.settings import LoraModule

from .sim_gateway import LLAMA, engine_settings, router_settings, worker_set, write_catalog


async def test_endpoint_mode_routes_discovered_names_adapters_and_aliases(tmp_path: Path) -> None:
    """Names, adapters (only where loaded) and context windows come from /v1/models; aliases from spec."""
    async with contextlib.AsyncExitStack() as stack:
        with_lora = dataclasses.replace(engine_settings(), lora_modules=(LoraModule("sql", "/adapters/sql"),))
        engines = [
            await stack.enter_async_context(SimServer(with_lora)),
            await stack.enter_async_context(SimServer(engine_settings())),
        ]
        ws = dataclasses.replace(
            worker_set(engines),
            discovery_mode="Endpoint",
            discovery_interval="200ms",
            models={LLAMA: ["chat"]},
        )
        catalog = tmp_path / "catalog.yaml"
        write_catalog(catalog, [ws])
        server = Server(router_settings(catalog))
        stack.push_async_callback(server.stop)
        await server.start()

        await eventually(
            lambda: server.store.current.resolve("sql") is not None, what="the adapter discovered"
        )
        catalog_now = server.store.current
        sql = catalog_now.resolve("sql")
        chat = catalog_now.resolve("chat")
        assert sql is not None and chat is not None
        assert [e.address for e in sql.endpoints] == [engines[0].address]
        assert chat.upstream_model == LLAMA and len(chat.endpoints) == 2
        assert catalog_now.context_window(chat.endpoints[0].address, chat.upstream_model) == 4096
        decision = server.control.decide(read_request("/v1/completions", {"model": "sql", "prompt": "q"}))
        assert decision.endpoints[0].address == engines[0].address
        assert sorted(name for name, _ in server.control.models()) == sorted(["chat", LLAMA, "sql"])


async def test_context_window_filter_refuses_what_no_endpoint_can_hold(tmp_path: Path) -> None:
    """With discovered windows, a prompt + max_tokens too large for every endpoint is a 400 naming sizes."""
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(SimServer(engine_settings()))
        ws = dataclasses.replace(worker_set([engine]), discovery_mode="Endpoint", models={LLAMA: ["chat"]})
        catalog = tmp_path / "catalog.yaml"
        write_catalog(catalog, [ws])
        server = Server(router_settings(catalog))
        stack.push_async_callback(server.stop)
        await server.start()
        await eventually(
            lambda: server.store.current.context_window(engine.address, LLAMA) is not None,  # type: ignore[arg-type]
            what="the context window discovered",
        )
        prompt = {"model": "chat", "prompt": "hello there"}
        fits = server.control.decide(read_request("/v1/completions", {**prompt, "max_tokens": 100}))
        assert fits.endpoints[0].address == engine.address
        with pytest.raises(BadRequest, match=r"largest context window .*\(4096\)"):
            server.control.decide(read_request("/v1/completions", {**prompt, "max_tokens": 5000}))
