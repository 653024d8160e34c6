"""Simulated vLLM engines with KV events behind the router: the pieces of prefix-routing tests.

Engines are :class:`~extproc.sim.server.SimServer` s on free loopback ports, publishing KV events
with replay (as ``vllm serve --kv-events-config`` does) and reporting ``cached_tokens``. The
catalog declares their KV-event ports (:func:`worker_set`), and the router gets the shipped
tokenizer with a chat template (:func:`router_settings`), so it routes by cached prefix.

Nothing here sleeps for a fixed time: :func:`eventually` polls a condition with a deadline, and
:func:`sync_sources` waits until every engine's events demonstrably reach the router's index.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from ports import free_port
from waiting import eventually

from extproc.demo.catalog import LocalWorkerSet, catalog_yaml, kv_ports_of
from extproc.kvindex.events import Source
from extproc.kvindex.keys import block_keys, namespace_seed
from extproc.openai import read_request
from extproc.serve.app import Server
from extproc.settings import PrefixSettings, ServeSettings, SourceSettings, TokenizerSpec
from extproc.sim.engine_core import EngineParams
from extproc.sim.kv_wire import EventEncoding
from extproc.sim.server import SimServer
from extproc.sim.settings import KVEventSettings, SimSettings
from extproc.tokenize.registry import SHIPPED_TOKENIZER
from extproc.tokenize.shipped import shipped_tokenizer
from extproc.types import EndpointAddress, EngineKind

LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BLOCK = 16
#: Room for a few thousand-token prompts and their answers without evictions.
ENGINE = EngineParams(num_gpu_blocks=2048, max_model_len=4096, max_num_batched_tokens=4096)


def engine_settings(
    *, chat_template: str = "llama3", time_scale: float = 0.01, engine_kind: EngineKind = "vllm"
) -> SimSettings:
    """One engine serving :data:`LLAMA` only, with KV events + replay on free ports (SGLang's or
    vLLM's surface)."""
    encoding = EventEncoding.SGLANG if engine_kind == "sglang" else EventEncoding.MAPS
    return SimSettings(
        engine_kind=engine_kind,
        listen="127.0.0.1:0",
        model=LLAMA,
        served_model_names=(LLAMA,),
        chat_template=chat_template,
        engine=ENGINE,
        time_scale=time_scale,
        enable_prompt_tokens_details=True,
        kv_events=KVEventSettings(port=0, replay_port=0, encoding=encoding),
    )


def kv_ports(engine: SimServer) -> tuple[int, int | None]:
    """(PUB port, replay port) of the engine's only rank, as ``/sim/state`` reports them."""
    events = engine.state()["ranks"][0]["kv_events"]
    return kv_ports_of(events["endpoint"], events["replay_endpoint"])


def worker_set(
    engines: Sequence[SimServer], *, name: str = "llama", engine: str | None = None
) -> LocalWorkerSet:
    """The engines as one worker set of :data:`LLAMA` (alias ``chat``) declaring its KV events
    (and its engine, when given)."""
    return LocalWorkerSet(
        name,
        LLAMA,
        [e.address for e in engines],
        aliases=("chat",),
        kv_ports={e.address: kv_ports(e) for e in engines},
        engine=engine,
    )


def write_catalog(path: Path, sets: Sequence[LocalWorkerSet]) -> None:
    """Replace the file atomically, as a ConfigMap update or an editor would."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(catalog_yaml(sets))
    tmp.replace(path)


def router_settings(catalog: Path, *, chat_template: str = "llama3", seed: int = 1) -> ServeSettings:
    """``serve --source file:CATALOG --tokenizer LLAMA=extproc:tiny --chat-template LLAMA=...
    --decision-headers`` (the headers explain a test's failure: what the router picked, and why)."""
    return ServeSettings(
        decision_headers=True,
        source=SourceSettings.parse(f"file:{catalog}", poll_interval=0.05),
        listen=f"127.0.0.1:{free_port()}",
        admin_listen="127.0.0.1:0",
        seed=seed,
        drain_seconds=0.5,
        prefix=PrefixSettings(tokenizers=(TokenizerSpec(LLAMA, SHIPPED_TOKENIZER, chat_template),)),
    )


async def serve_behind_envoy(
    stack: contextlib.AsyncExitStack,
    settings: ServeSettings,
    engines: Sequence[SimServer],
    envoy_gateway: Callable[..., Awaitable[Any]],
) -> tuple[Server, Any]:
    """``serve`` with ``settings`` (stopped with ``stack``) and real Envoy in front of ``engines``."""
    server = Server(settings)
    stack.push_async_callback(server.stop)
    await server.start()
    gateway = await envoy_gateway(
        extproc_address=("127.0.0.1", server.grpc_port), pool=[("127.0.0.1", e.port) for e in engines]
    )
    return server, gateway


def tokens(text: str) -> int:
    """``text``'s length in the shipped tokenizer's tokens."""
    return len(shipped_tokenizer().encode(text, add_special_tokens=False))


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    """A chat to the alias ``chat``: a system prompt and one question, 4 tokens of answer."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "chat", "messages": messages, "max_tokens": 4, **extra}


def sources(server: Server) -> dict[str, Any]:
    """``/debug/state``'s ``prefix.sources``, keyed ``ip:port/dp0``."""
    state: dict[str, Any] = server.prefix.debug_state()["sources"]
    return state


async def sync_sources(
    server: Server, engines: Sequence[SimServer], session: aiohttp.ClientSession, *, first_attempt: int = 0
) -> None:
    """Wait until each engine's KV events demonstrably reach the router's index.

    Subscriptions connect in the background, and a batch published before a SUB socket is
    subscribed is lost to it (replay repairs that only when a later batch shows the gap). So: wait
    for every subscription to connect, then send a request straight to each engine (a prompt of its
    own) until the index holds blocks of every engine, in sync from seq 0. A second request is
    only sent if the first one's events were missed; its batch then triggers the replay. Prompts
    differ per attempt (an engine announces nothing for a prompt it has fully cached), and
    ``first_attempt`` > 0 gives prompts that earlier calls did not send.
    """
    names = {e.address: f"{e.address}/dp0" for e in engines}
    await eventually(
        lambda: all(sources(server).get(n, {}).get("connected") for n in names.values()),
        what="every KV-event subscription connected",
    )

    def in_sync(engine: SimServer) -> bool:
        source = sources(server).get(names[engine.address], {})
        return source.get("complete") is True and source.get("gpuBlocks", 0) > 0

    for attempt in range(first_attempt, first_attempt + 10):
        await asyncio.gather(
            *(
                poke(session, engine, warm_up_body(i, attempt))
                for i, engine in enumerate(engines)
                if not in_sync(engine)
            )
        )
        with contextlib.suppress(AssertionError):
            await eventually(lambda: all(in_sync(e) for e in engines), within=1.0)
            return
    raise AssertionError(f"KV events not in sync: {[n for e, n in names.items() if not in_sync(e)]}")


async def poke(session: aiohttp.ClientSession, engine: SimServer, body: Mapping[str, Any]) -> None:
    """One request straight to an engine (not through the router), which makes it publish events."""
    async with session.post(f"http://{engine.address}{COMPLETIONS}", json=body) as resp:
        assert resp.status == 200, await resp.text()


def warm_up_body(i: int, attempt: int = 0) -> dict[str, Any]:
    """The completion :func:`sync_sources` sends straight to engine ``i`` (a prompt of its own)."""
    prompt = f"Warm-up {i}.{attempt}: " + filler_text(48, seed=1000 + i)
    return {"model": LLAMA, "prompt": prompt, "max_tokens": 20}


def prompt_ids(server: Server, body: Mapping[str, Any], path: str = CHAT) -> list[int]:
    """The token ids the router computes for ``body`` (with its own tokenizer and template)."""
    tokenizer = server.prefix.tokenizers.get(LLAMA)
    assert tokenizer is not None
    prompt = read_request(path, dict(body)).read_prompt()
    assert prompt is not None
    ids = tokenizer.prompt_ids(prompt)
    assert ids is not None
    return ids


def indexed_blocks(server: Server, ids: Sequence[int], engines: Sequence[SimServer]) -> dict[str, int]:
    """How many leading blocks of ``ids`` the router's index credits each engine with."""
    keys = block_keys(tuple(ids), BLOCK, namespace_seed(LLAMA))
    held = server.prefix.index.match(keys, [Source(EndpointAddress(e.address), 0) for e in engines])
    return {source.endpoint: blocks for source, blocks in held.items()}


def finished(engines: Sequence[SimServer]) -> dict[str, int]:
    """Requests each engine generated to the end (the engines' own counts)."""
    return {e.address: e.requests_finished for e in engines}


def delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_WORDS = (
    "gateway",
    "router",
    "engine",
    "cache",
    "block",
    "token",
    "prefix",
    "request",
    "model",
    "server",
    "latency",
    "queue",
    "batch",
    "prompt",
    "answer",
    "stream",
    "event",
    "replica",
    "endpoint",
    "worker",
    "scheduler",
    "memory",
    "tensor",
    "attention",
    "layer",
    "decode",
    "prefill",
    "budget",
    "policy",
    "metric",
    "signal",
    "window",
    "history",
    "index",
    "shard",
    "replay",
    "subscriber",
    "publisher",
    "catalog",
    "service",
    "slice",
    "pod",
    "cluster",
    "namespace",
    "alias",
    "upstream",
    "downstream",
    "header",
    "body",
)


def filler_text(words: int, *, seed: int) -> str:
    """Deterministic prose-like text (no randomness module state touched)."""
    out = []
    state = seed * 2654435761 % 2**32 or 1
    for i in range(words):
        state = (state * 1103515245 + 12345) % 2**31
        word = _WORDS[state % len(_WORDS)]
        out.append(word.capitalize() if i % 12 == 0 else word)
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def long_text(count: Callable[[str], int], tokens: int, *, seed: int) -> str:
    """Filler text of at least ``tokens`` tokens as ``count`` counts them."""
    words = tokens // 2
    while True:
        text = filler_text(words, seed=seed)
        if count(text) >= tokens:
            return text
        words += max(words // 4, 8)


_METRIC = re.compile(r'^extproc_prefix_lookups_total\{mode="(\w+)"\} (\S+)$', re.M)


async def prefix_lookups(session: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    """``extproc_prefix_lookups_total`` by mode, scraped from the admin port's ``/metrics``."""
    async with session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {mode: float(value) for mode, value in _METRIC.findall(text)}
