"""SGLang engines behind the router, alone and beside vLLM ones: real Envoy -> router -> simulated engines.

The engines are ``extproc sim --engine sglang``: SGLang 0.5.23's metric names, routes and KV-event
encoding (coalesced pages, signed first-8-byte hashes) over the same engine model. Every claim
is checked with the engines' own counters (who served, how many prompt tokens came from cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from waiting import eventually

from extproc.serve.app import Server
from extproc.sim.server import SimServer
from extproc.types import EngineKind

from .sim_gateway import (
    CHAT,
    LLAMA,
    chat,
    engine_settings,
    finished,
    long_text,
    router_settings,
    sync_sources,
    tokens,
    worker_set,
    write_catalog,
)

Pool = tuple[str, Server, list[SimServer], aiohttp.ClientSession]
StartPool = Callable[[Sequence[EngineKind]], Awaitable[Pool]]


@pytest.fixture
async def pool(envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path) -> AsyncIterator[StartPool]:
    """Factory: ``await pool(["sglang", "vllm", ...])`` -> (gateway URL, router, engines, session),
    once every engine's KV events reach the router's index."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(kinds: Sequence[EngineKind]) -> Pool:
            engines = [
                await stack.enter_async_context(SimServer(engine_settings(engine_kind=k))) for k in kinds
            ]
            catalog = tmp_path / "catalog.yaml"
            declared = kinds[0] if len(set(kinds)) == 1 else None
            write_catalog(catalog, [worker_set(engines, engine=declared)])
            server = Server(router_settings(catalog))
            stack.push_async_callback(server.stop)
            await server.start()
            gateway = await envoy_gateway(
                extproc_address=("127.0.0.1", server.grpc_port), pool=[("127.0.0.1", e.port) for e in engines]
            )
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
            )
            await sync_sources(server, engines, session)
            return gateway.url, server, engines, session

        yield start


async def routed(
    url: str, server: Server, engines: list[SimServer], session: aiohttp.ClientSession, body: dict[str, Any]
) -> tuple[str, int]:
    """Send ``body`` through the gateway: (the one engine that served it, its cached prompt tokens)."""
    await eventually(lambda: server.load.total == 0, what="nothing in flight")
    before = finished(engines)
    async with session.post(url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    served = [a for a, n in finished(engines).items() if n != before[a]]
    assert len(served) == 1, served
    return served[0], int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def cache_on(
    engine: SimServer, session: aiohttp.ClientSession, server: Server, body: dict[str, Any]
) -> None:
    """Put ``body``'s prompt in ``engine``'s cache (sent straight to it), and wait for the index to know."""
    source = f"{engine.address}/dp0"

    def indexed() -> int:
        return int(server.prefix.debug_state()["sources"][source]["gpuBlocks"])

    before = indexed()
    async with session.post(f"http://{engine.address}{CHAT}", json={**body, "model": LLAMA}) as resp:
        assert resp.status == 200, await resp.text()
    await eventually(lambda: indexed() >= before + 800 // 16, what=f"{source}'s new blocks indexed")


async def test_an_sglang_pool_routes_by_its_cache_and_load(pool: StartPool) -> None:
    """KV events, metrics and routes of SGLang engines: the prefix holder gets the follow-ups."""
    url, server, engines, session = await pool(["sglang", "sglang", "sglang"])
    await eventually(
        lambda: all(
            (e := server.scraper.snapshot().get(s.address)) is not None  # type: ignore[arg-type]
            and e.signals is not None
            and e.signals.engine_kind == "sglang"
            for s in engines
        ),
        what="every engine's SGLang metrics read",
    )
    for i, owner in enumerate((engines[1], engines[2])):
        system = long_text(tokens, 800, seed=21 + i)
        await cache_on(owner, session, server, chat(system, "What is in the cache?"))
        served, cached = await routed(url, server, engines, session, chat(system, "Next?"))
        assert served == owner.address and cached >= 800
    # The set declares kinference.buoyant.io/engine: sglang, and the engines' metrics agree.
    problems = server.worker_sets_state()["default/llama"]["problems"]
    assert not [p for p in problems if "kinference.buoyant.io/engine" in p], problems


async def test_a_mixed_pool_follows_each_prefix_to_its_engine_whichever_kind(pool: StartPool) -> None:
    """vLLM and SGLang pods serving one model: each engine's cache attracts its own prefix."""
    url, server, engines, session = await pool(["vllm", "sglang", "vllm"])
    for i, owner in enumerate((engines[1], engines[0], engines[2], engines[1])):
        system = long_text(tokens, 800, seed=40 + i)
        await cache_on(owner, session, server, chat(system, "First question."))
        served, cached = await routed(url, server, engines, session, chat(system, "Second question."))
        assert served == owner.address, (
            f"prefix {i} cached on {owner.settings.engine_kind} engine {owner.address}"
        )
        assert cached >= 800


async def test_a_cache_salt_matches_only_blocks_cached_under_it(pool: StartPool) -> None:
    """Salted prompts follow their own salt's cache, on either engine kind; another salt finds none."""
    url, server, engines, session = await pool(["sglang", "vllm", "vllm"])
    system = long_text(tokens, 800, seed=60)
    salted_home, plain_home = engines[0], engines[1]
    await cache_on(salted_home, session, server, chat(system, "Question.", cache_salt="tenant-a"))
    await cache_on(plain_home, session, server, chat(system, "Question."))

    served, cached = await routed(
        url, server, engines, session, chat(system, "Again?", cache_salt="tenant-a")
    )
    assert (served, cached >= 800) == (salted_home.address, True)
    served, cached = await routed(url, server, engines, session, chat(system, "Again?"))
    assert (served, cached >= 800) == (plain_home.address, True)
    # Nobody holds tenant-b's blocks: wherever it goes, the engine computes the whole prompt.
    _, cached = await routed(url, server, engines, session, chat(system, "Again?", cache_salt="tenant-b"))
    assert cached == 0
