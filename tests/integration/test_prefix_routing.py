"""Prefix-cache-aware routing end to end: real Envoy -> router -> simulated vLLM engines.

Three engines publish KV events (with replay) and report ``cached_tokens``; the catalog declares
their KV-event ports; the router tokenizes with the shipped tokenizer and the engines' chat
template, follows every engine's events, and sends each request where most of its prompt is
cached. Every claim is checked with the engines' own counters, not the router's opinion.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from waiting import eventually

from extproc.kvindex.events import Source
from extproc.kvindex.index import blocks_within
from extproc.serve.app import Server
from extproc.sim.server import SimServer
from extproc.tokenize.shipped import shipped_template
from extproc.types import EndpointAddress

from .sim_gateway import (
    BLOCK,
    CHAT,
    COMPLETIONS,
    LLAMA,
    chat,
    common_prefix,
    delta,
    engine_settings,
    finished,
    indexed_blocks,
    long_text,
    prefix_lookups,
    prompt_ids,
    router_settings,
    sources,
    sync_sources,
    tokens,
    warm_up_body,
    worker_set,
    write_catalog,
)

MODES = pytest.mark.parametrize(
    "body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"], ids=["full-duplex", "buffered"]
)


@dataclass
class SimGateway:
    url: str
    server: Server
    engines: list[SimServer]
    catalog: Path
    session: aiohttp.ClientSession
    decisions: list[dict[str, str]] = field(default_factory=list)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url + path, json=body) as resp:
            text = await resp.text()
            assert resp.status == 200, text
            self.decisions.append({k: v for k, v in resp.headers.items() if k.startswith("x-extproc-")})
            answer: dict[str, Any] = await resp.json()
            return answer

    def why(self) -> str:
        """For a failed assertion: the router's last decisions (its pick, prefix credit, predicted
        TTFT) and what it knew of each engine's load, as one string (pytest shortens a dict)."""
        engines = self.server.scraper.debug_state()["endpoints"]
        state = {
            "decisions": self.decisions[-8:],
            "engines": {
                a: {
                    "signals": e["signals"],
                    "age": e["ageSeconds"],
                    "suspect": e["suspect"],
                    "down": e["unreachable"],
                }
                for a, e in engines.items()
            },
            "inFlight": dict(self.server.load.snapshot()),
        }
        return json.dumps(state, default=str)

    def others(self, address: str) -> list[str]:
        return [e.address for e in self.engines if e.address != address]


StartSimGateway = Callable[..., Awaitable[SimGateway]]


@pytest.fixture
async def sim_gateway(
    envoy_gateway: Callable[..., Awaitable[Any]], tmp_path: Path
) -> AsyncIterator[StartSimGateway]:
    """Factory: ``await sim_gateway(body_mode=..., engines=3, time_scale=0.01, chat_template="llama3",
    config="gateway.yaml", scrape_interval=None)`` (None: the router's default).

    Returns once every engine's KV events demonstrably reach the router's index.
    """
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            *,
            body_mode: str = "FULL_DUPLEX_STREAMED",
            engines: int = 3,
            time_scale: float = 0.01,
            chat_template: str = "llama3",
            config: str = "gateway.yaml",
            scrape_interval: float | None = None,
        ) -> SimGateway:
            sims = [
                await stack.enter_async_context(SimServer(engine_settings(time_scale=time_scale)))
                for _ in range(engines)
            ]
            catalog = tmp_path / "catalog.yaml"
            write_catalog(catalog, [worker_set(sims)])
            settings = router_settings(catalog, chat_template=chat_template)
            if scrape_interval is not None:
                settings = dataclasses.replace(settings, scrape_interval=scrape_interval)
            server = Server(settings)
            stack.push_async_callback(server.stop)
            await server.start()
            gateway = await envoy_gateway(
                extproc_address=("127.0.0.1", server.grpc_port),
                # An ORIGINAL_DST pool has no endpoints of its own: it connects where we point.
                pool=None if "original-dst" in config else [("127.0.0.1", s.port) for s in sims],
                body_mode=body_mode,
                config=config,
            )
            session = await stack.enter_async_context(
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
            )
            await sync_sources(server, sims, session)
            return SimGateway(gateway.url, server, sims, catalog, session)

        yield start


def served_by(before: dict[str, int], engines: list[SimServer]) -> str:
    """The one engine that finished a request since ``before``."""
    changed = {a: n for a, n in delta(before, finished(engines)).items() if n}
    assert len(changed) == 1 and set(changed.values()) == {1}, changed
    return next(iter(changed))


QUESTIONS = (
    "What does the router read from a request?",
    "Why are shared prefixes cheaper?",
    "How are blocks evicted?",
    "Which engine holds my prompt?",
    "Write a haiku about caches.",
)


# -- (1) a shared long prefix sticks to the engine holding it ----------------------------------------


@MODES
@pytest.mark.parametrize(
    "prefix_tokens",
    # 600 tokens are tokenized inline; 2,000 (~5k characters) in the tokenizing threads, the first
    # time: the follow-ups find that prefix in the segment tree and encode their question inline.
    [600, 2000],
    ids=["inline", "threads"],
)
async def test_follow_ups_sharing_a_long_prefix_land_on_the_engine_holding_it(
    sim_gateway: StartSimGateway, body_mode: str, prefix_tokens: int
) -> None:
    gw = await sim_gateway(body_mode=body_mode)
    system = long_text(tokens, prefix_tokens, seed=1)
    pool = gw.server.prefix.tokenize_pool
    assert pool is not None
    tokenized_before = pool.completed
    first = chat(system, "Question zero: what is in the cache?")
    before = finished(gw.engines)
    answer = await gw.post(CHAT, first)
    owner = served_by(before, gw.engines)
    assert answer["model"] == LLAMA
    ids = prompt_ids(gw.server, first)
    assert answer["usage"]["prompt_tokens"] == len(ids)  # router and engine tokenized alike
    full = len(ids) // BLOCK
    await eventually(
        lambda: indexed_blocks(gw.server, ids, gw.engines)[owner] >= full,
        what=f"the index credits {owner} with the first prompt's {full} blocks",
    )
    assert all(indexed_blocks(gw.server, ids, gw.engines)[a] == 0 for a in gw.others(owner))

    # The first request's count ends a few ms after its response (the accounting stream's close).
    await eventually(lambda: gw.server.load.total == 0, what="the first request no longer in flight")
    # Concurrent follow-ups: the cache wins over load (the owner has several in flight at once).
    bodies = [chat(system, q) for q in QUESTIONS]
    precise = gw.server.prefix.matcher.counters.lookups["precise"]
    before = finished(gw.engines)
    answers = await asyncio.gather(*(gw.post(CHAT, b) for b in bodies))
    assert delta(before, finished(gw.engines)) == {
        e.address: len(bodies) if e.address == owner else 0 for e in gw.engines
    }, gw.why()
    for body, got in zip(bodies, answers, strict=True):
        follow_ids = prompt_ids(gw.server, body)
        shared = common_prefix(follow_ids, ids) // BLOCK * BLOCK
        assert shared >= prefix_tokens
        assert got["usage"]["prompt_tokens"] == len(follow_ids)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= shared
    assert gw.server.prefix.matcher.counters.lookups["precise"] == precise + len(bodies)
    assert pool.completed - tokenized_before == (0 if prefix_tokens < 1000 else 1)
    tree = gw.server.prefix.matcher.tokenizers.get(LLAMA)
    assert tree is not None and tree.tokenizer.segment_cache is not None
    assert tree.tokenizer.segment_cache.stats.hits >= len(bodies)  # each follow-up walked the prefix


# -- (2) different prefixes spread by load, then each sticks to its own engine ------------------------


@MODES
async def test_different_prefixes_spread_over_engines_then_stick(
    sim_gateway: StartSimGateway, body_mode: str
) -> None:
    # Real speed so a 150-token stream stays in flight (~1 s) while the next ones are routed.
    gw = await sim_gateway(body_mode=body_mode, time_scale=1.0)
    systems = [long_text(tokens, 300, seed=10 + i) for i in range(3)]
    owners: list[str] = []
    async with contextlib.AsyncExitStack() as streams:
        responses = []
        for i, system in enumerate(systems):
            body = chat(system, "Tell me a long story.", stream=True, max_tokens=150)
            resp = await streams.enter_async_context(gw.session.post(gw.url + CHAT, json=body))
            assert resp.status == 200, await resp.text()
            responses.append(resp)

            # Headers came from the engine, so the router has decided; the request counts in flight
            # (held by its accounting stream, which reaches the router on its own).
            def counted(n: int = i + 1) -> bool:
                inflight = {a: c for a, c in gw.server.load.snapshot().items() if c}
                return len(inflight) == n and set(inflight.values()) == {1}

            await eventually(counted, what=f"{i + 1} requests each on its own engine, in flight")
            inflight = {a: c for a, c in gw.server.load.snapshot().items() if c}
            owners.append(next(a for a in inflight if a not in owners))
        # Nothing was cached for any of them: least in flight put each on its own engine.
        assert sorted(owners) == sorted(e.address for e in gw.engines)
        for engine in gw.engines:
            core = engine.ranks[0].core
            assert core.num_running + core.num_waiting == 1
        for resp in responses:
            await resp.read()

    ids = [prompt_ids(gw.server, chat(s, "Tell me a long story.")) for s in systems]
    for owner, prompt in zip(owners, ids, strict=True):
        await eventually(
            lambda owner=owner, prompt=prompt: (
                indexed_blocks(gw.server, prompt, gw.engines)[owner] >= len(prompt) // BLOCK
            ),
            what=f"{owner}'s prompt indexed",
        )
    # Now each prefix has a home: follow-ups go there, one at a time (so load is equal everywhere).
    for _round in range(2):
        for owner, system in zip(owners, systems, strict=True):
            await eventually(lambda: gw.server.load.total == 0, what="the previous one no longer in flight")
            before = finished(gw.engines)
            answer = await gw.post(CHAT, chat(system, f"Another question, round {_round}?"))
            assert served_by(before, gw.engines) == owner, gw.why()
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 300 // BLOCK * BLOCK


# -- (3) a chat the router's template cannot render still routes (approximately) -----------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@MODES
async def test_a_chat_the_routers_template_refuses_routes_approximately(
    sim_gateway: StartSimGateway, body_mode: str, tmp_path: Path
) -> None:
    """The router's template knows no tools (an old one); the engine's does. Routing must not refuse."""
    template = tmp_path / "llama3-without-tools.jinja"
    template.write_text(
        '{%- if tools -%}{{- raise_exception("this template knows no tools") -}}{%- endif -%}\n'
        + shipped_template("llama3").read_text()
    )
    gw = await sim_gateway(body_mode=body_mode, chat_template=str(template))
    system = long_text(tokens, 200, seed=3)
    body = chat(system, "What is the weather in Paris?", tools=[WEATHER_TOOL])
    counters = gw.server.prefix.matcher.counters
    lookups, errors = dict(counters.lookups), counters.tokenize_errors

    before = finished(gw.engines)
    answer = await gw.post(CHAT, body)
    first = served_by(before, gw.engines)
    assert answer["model"] == LLAMA and answer["usage"]["prompt_tokens"] > 200
    assert counters.tokenize_errors == errors + 1
    assert counters.lookups == {**lookups, "approximate": lookups["approximate"] + 1}

    # The router remembered where it sent that prompt: the same chat follows it there.
    await eventually(lambda: gw.server.load.total == 0, what="the first chat no longer in flight")
    before = finished(gw.engines)
    again = await gw.post(CHAT, body)
    assert served_by(before, gw.engines) == first, gw.why()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    # Chats the template can render are still matched precisely.
    await gw.post(CHAT, chat(system, "And without tools?"))
    assert counters.lookups["precise"] == lookups["precise"] + 1
    assert counters.tokenize_errors == errors + 2


# -- (4) the lookup mode is visible on /metrics -----------------------------------------------------------


async def test_metrics_count_precise_lookups(sim_gateway: StartSimGateway) -> None:
    gw = await sim_gateway()
    before = await prefix_lookups(gw.session, gw.server)
    system = long_text(tokens, 100, seed=4)
    for question in QUESTIONS[:3]:
        await gw.post(CHAT, chat(system, question))
    await gw.post(COMPLETIONS, {"model": "chat", "prompt": system, "max_tokens": 2})
    after = await prefix_lookups(gw.session, gw.server)
    assert after["precise"] - before.get("precise", 0.0) == 4
    assert after.get("approximate", 0.0) == before.get("approximate", 0.0)
    async with gw.session.get(f"http://127.0.0.1:{gw.server.admin_port}/metrics") as resp:
        text = await resp.text()
    for engine in gw.engines:
        assert f'extproc_kv_index_blocks{{dp_rank="0",endpoint="{engine.address}"}}' in text
    assert 'extproc_kv_sources{state="complete"} 3.0' in text
    bound = next(line for line in text.splitlines() if line.startswith("extproc_kv_index_max_blocks "))
    assert float(bound.split()[1]) == blocks_within(1024 * 2**20)  # the default memory budget, 1 GiB
    assert "extproc_kv_index_settled_bytes " in text and "extproc_kv_index_settle_seconds_max " in text


# -- (5) an engine leaving the catalog leaves the index ------------------------------------------------------


async def test_an_engine_leaving_the_catalog_loses_its_blocks_and_comes_back(
    sim_gateway: StartSimGateway,
) -> None:
    gw = await sim_gateway()
    gone, *rest = gw.engines
    name = f"{gone.address}/dp0"
    source = Source(EndpointAddress(gone.address), 0)
    warm_ids = prompt_ids(gw.server, warm_up_body(0), COMPLETIONS)
    assert indexed_blocks(gw.server, warm_ids, gw.engines)[gone.address] == len(warm_ids) // BLOCK

    write_catalog(gw.catalog, [worker_set(rest)])
    await eventually(
        lambda: name not in sources(gw.server) and source not in gw.server.prefix.index.stats().sources,
        what=f"{name} dropped from subscriptions and index",
    )
    async with gw.session.get(f"http://127.0.0.1:{gw.server.admin_port}/debug/state") as resp:
        state = await resp.json()
    assert sorted(state["prefix"]["sources"]) == sorted(f"{e.address}/dp0" for e in rest)
    assert indexed_blocks(gw.server, warm_ids, gw.engines)[gone.address] == 0
    # Its prompt now goes to the engines still there, and they answer.
    before = finished(gw.engines)
    await gw.post(COMPLETIONS, {**warm_up_body(0), "model": "chat", "max_tokens": 2})
    assert served_by(before, gw.engines) in {e.address for e in rest}

    # Back in the catalog: subscribed again, and its next event makes the router replay its history
    # from seq 0, so the blocks it stored before (the warm-up prompt) are indexed again.
    write_catalog(gw.catalog, [worker_set(gw.engines)])
    await sync_sources(gw.server, [gone], gw.session, first_attempt=100)
    assert indexed_blocks(gw.server, warm_ids, gw.engines)[gone.address] == len(warm_ids) // BLOCK


async def test_an_engine_refusing_connections_is_routed_around_at_once(sim_gateway: StartSimGateway) -> None:
    """Behind ORIGINAL_DST a request sent to a dead engine fails; the next one must not follow it.

    Scrapes are an hour apart here, so only Envoy's report of the refused connection (the response
    attributes of its own 503) can explain the router turning away from the engine.
    """
    gw = await sim_gateway(config="gateway-original-dst.yaml", scrape_interval=3600)
    body = {**warm_up_body(0), "model": "chat", "max_tokens": 2}
    before = finished(gw.engines)
    await gw.post(COMPLETIONS, body)
    holder = served_by(before, gw.engines)  # the engine caching the prompt
    dead = next(e for e in gw.engines if e.address == holder)
    await dead.stop()

    async with gw.session.post(gw.url + COMPLETIONS, json=body) as resp:
        assert resp.status == 503  # Envoy could not connect: nothing can save this one
    before = finished([e for e in gw.engines if e is not dead])
    for _ in range(3):
        await gw.post(COMPLETIONS, body)
    assert sum(delta(before, finished([e for e in gw.engines if e is not dead])).values()) == 3
    assert sources(gw.server)[f"{holder}/dp0"]["gpuBlocks"] == 0  # its cache no longer attracts
    failures = gw.server.metrics.registry.get_sample_value(
        "extproc_upstream_failures_total", {"kind": "connect_failed"}
    )
    assert failures == 1
