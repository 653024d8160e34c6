"""The router computes the very token ids the (simulated) engine computes, for every body shape.

With the shipped tiny tokenizer (both shipped templates) and with the real Llama 3 and Qwen 3
tokenizers and their own templates (``tests/real_tokenizers.py``). The Llama 3 files are those of
the first Meta-Llama-3 release, whose post-processor adds no BOS to a completion: vLLM loading the
same files does not either, so parity holds.

Router side: :class:`~extproc.tokenize.registry.TokenizerRegistry` as ``serve`` loads it
(``--tokenizer MODEL=extproc:tiny --chat-template MODEL=TEMPLATE``). Engine side: a
:class:`~extproc.sim.server.SimServer` started with the same template, asked over HTTP through
vLLM's ``POST /tokenize`` (chat and completion forms) and checked again against the
``usage.prompt_tokens`` of a real generation. Then the failure this guards against: a router
configured with another template than its engines computes other ids, and its keys never match
the blocks the engine announces, so routing by cache silently stops working.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from integration.sim_gateway import (
    BLOCK,
    CHAT,
    COMPLETIONS,
    LLAMA,
    engine_settings,
    eventually,
    indexed_blocks,
    long_text,
    prompt_ids,
    router_settings,
    sources,
    sync_sources,
    worker_set,
    write_catalog,
)
from real_tokenizers import real_tokenizer

from extproc.openai import read_request
from extproc.serve.app import Server
from extproc.settings import TokenizerSpec
from extproc.sim.server import SimServer
from extproc.sim.settings import SimSettings
from extproc.tokenize.registry import SHIPPED_TOKENIZER, ModelTokenizer, TokenizerRegistry
from extproc.tokenize.shipped import TEMPLATE_NAMES, shipped_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no description, no parameters
]
SYSTEM = "You are a terse assistant. Answer in one sentence."

#: (id, path, body without "model"): every request shape the router has to tokenize like vLLM.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("completion-text", COMPLETIONS, {"prompt": "Once upon a time, in a data centre far away,"}),
    ("completion-text-special", COMPLETIONS, {"prompt": "a<|eot_id|>b <|im_start|>c"}),
    ("completion-token-ids", COMPLETIONS, {"prompt": [1, 500, 42, 4999, 7, 7, 7, 3000]}),
    ("completion-batch-of-one", COMPLETIONS, {"prompt": ["A single prompt in a list."]}),
    ("chat-user-only", CHAT, {"messages": [{"role": "user", "content": "Hello!"}]}),
    (
        "chat-system",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Why is the sky blue?"},
            ]
        },
    ),
    (
        "chat-multi-turn",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name a prime."},
                {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "Another one?"},
                {"role": "assistant", "content": "Eleven."},
                {"role": "user", "content": "And their sum?"},
            ]
        },
    ),
    (
        "chat-tools",
        CHAT,
        {
            "tools": TOOLS,
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Weather in Paris and Oslo, and the time?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
                        },
                        {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": ""}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"},
                {"role": "tool", "tool_call_id": "call_2", "content": "4 C, snow"},
                {"role": "tool", "tool_call_id": "call_3", "content": "12:00"},
            ],
        },
    ),
    (
        "chat-text-parts",
        CHAT,
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "First part."},
                        {"type": "text", "text": "Second part."},
                    ],
                },
            ]
        },
    ),
    (
        "chat-template-kwargs",
        CHAT,
        {
            "messages": [{"role": "user", "content": "What day is it?"}],
            # llama3 reads date_string, chatml reads enable_thinking; each ignores the other.
            "chat_template_kwargs": {"date_string": "26 Jul 2024", "enable_thinking": False},
        },
    ),
    (
        "chat-continue-final-message",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "Count to five."},
                {"role": "assistant", "content": "One, two, three,"},
            ],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    (
        "chat-no-generation-prompt",
        CHAT,
        {"messages": [{"role": "user", "content": "Just this."}], "add_generation_prompt": False},
    ),
    (
        "chat-add-special-tokens",
        CHAT,
        {"messages": [{"role": "user", "content": "With BOS twice?"}], "add_special_tokens": True},
    ),
]


@functools.cache  # a real tokenizer takes about a second to load
def registry(template: str | None, tokenizer_dir: Path | None = None) -> ModelTokenizer:
    """What ``serve --tokenizer LLAMA=DIR --chat-template LLAMA=TEMPLATE`` loads (DIR None:
    ``extproc:tiny``; TEMPLATE None: the tokenizer's own)."""
    source = SHIPPED_TOKENIZER if tokenizer_dir is None else str(tokenizer_dir)
    tokenizer = TokenizerRegistry.load([TokenizerSpec(LLAMA, source, template)]).get(LLAMA)
    assert tokenizer is not None
    return tokenizer


#: (tokenizer, chat template): the shipped tiny tokenizer with each shipped template, and the real
#: Llama 3 and Qwen 3 tokenizers (128k and 152k vocabularies) with their own templates.
ENGINES = [*((None, name) for name in TEMPLATE_NAMES), ("llama3", None), ("qwen3", None)]


@pytest.fixture(
    params=ENGINES, ids=[f"{tok or 'tiny'}-{template or 'own-template'}" for tok, template in ENGINES]
)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[SimServer]:
    """An engine with that tokenizer and template (no KV events needed here)."""
    tokenizer, template = request.param
    settings = SimSettings(
        listen="127.0.0.1:0",
        model=LLAMA,
        served_model_names=(LLAMA,),
        tokenizer=None if tokenizer is None else real_tokenizer(tokenizer),
        chat_template=template,
        time_scale=0.01,
    )
    async with SimServer(settings) as sim:
        yield sim


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        yield http


async def engine_tokenize(
    session: aiohttp.ClientSession, engine: SimServer, body: dict[str, Any]
) -> list[int]:
    async with session.post(f"http://{engine.address}/tokenize", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    assert answer["count"] == len(answer["tokens"])
    tokens: list[int] = answer["tokens"]
    return tokens


async def engine_prompt_tokens(
    session: aiohttp.ClientSession, engine: SimServer, path: str, body: dict[str, Any]
) -> int:
    async with session.post(f"http://{engine.address}{path}", json={**body, "max_tokens": 1}) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    count: int = answer["usage"]["prompt_tokens"]
    return count


@pytest.mark.parametrize(
    ("path", "case"), [(path, body) for _, path, body in CASES], ids=[c[0] for c in CASES]
)
async def test_router_ids_equal_the_engines(
    engine: SimServer, session: aiohttp.ClientSession, path: str, case: dict[str, Any]
) -> None:
    body = {"model": LLAMA, **case}
    prompt = read_request(path, body).read_prompt()
    assert prompt is not None
    ours = registry(engine.settings.chat_template, engine.settings.tokenizer).prompt_ids(prompt)
    assert ours is not None and len(ours) > 0
    # vLLM's /tokenize takes both forms on one path: "messages" (chat) or "prompt" (completion).
    assert list(ours) == await engine_tokenize(session, engine, body)
    # And the generation itself counts the same prompt (the ids its blocks are made of).
    assert len(ours) == await engine_prompt_tokens(session, engine, path, body)


def test_the_cases_exercise_what_they_claim() -> None:
    """Guard against a case that silently tokenizes like another (e.g. kwargs that change nothing)."""
    llama, chatml = registry("llama3"), registry("chatml")
    bodies = {name: {"model": LLAMA, **body} for name, _, body in CASES}
    paths = {name: path for name, path, _ in CASES}

    def ids(tok: ModelTokenizer, name: str, **override: Any) -> list[int]:
        prompt = read_request(paths[name], {**bodies[name], **override}).read_prompt()
        assert prompt is not None
        got = tok.prompt_ids(prompt)
        assert got is not None
        return list(got)

    for tok in (llama, chatml):
        assert ids(tok, "chat-template-kwargs") != ids(tok, "chat-template-kwargs", chat_template_kwargs={})
        assert ids(tok, "chat-continue-final-message") != ids(
            tok, "chat-continue-final-message", continue_final_message=False
        )
        assert ids(tok, "chat-text-parts") == ids(
            tok,
            "chat-text-parts",
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "First part.\nSecond part."},
            ],
        )
        tool_text = shipped_tokenizer().decode(ids(tok, "chat-tools"), skip_special_tokens=False)
        assert "get_weather" in tool_text and "Oslo" in tool_text and "4 C, snow" in tool_text
    # The token-id completion is taken as given, by both.
    assert ids(llama, "completion-token-ids") == [1, 500, 42, 4999, 7, 7, 7, 3000]
    # Completions do not depend on the template; chats do.
    assert ids(llama, "completion-text") == ids(chatml, "completion-text")
    assert ids(llama, "chat-system") != ids(chatml, "chat-system")


# -- a template mismatch is detectable ---------------------------------------------------------------


async def test_other_template_gives_other_ids_and_misses_the_engines_cache(
    session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Engine: llama3. Two routers follow its KV events, one configured llama3, one chatml.

    Both receive every block the engine announces; only the llama3 router's keys find the chat's
    blocks. The chatml router still finds a completion's blocks (no template involved): its index
    works, its prompts are just not the engine's.
    """
    async with contextlib.AsyncExitStack() as stack:
        sim = await stack.enter_async_context(SimServer(engine_settings(chat_template="llama3")))
        catalog = tmp_path / "catalog.yaml"
        write_catalog(catalog, [worker_set([sim])])
        routers: dict[str, Server] = {}
        for template in ("llama3", "chatml"):
            server = Server(router_settings(catalog, chat_template=template))
            stack.push_async_callback(server.stop)
            await server.start()
            await sync_sources(server, [sim], session)
            routers[template] = server
        right, wrong = routers["llama3"], routers["chatml"]

        text = long_text(lambda t: len(shipped_tokenizer().encode(t, add_special_tokens=False)), 400, seed=5)
        chat = {
            "model": LLAMA,
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}],
        }
        completion = {"model": LLAMA, "prompt": text}
        engine_ids = await engine_tokenize(session, sim, chat)
        assert prompt_ids(right, chat) == engine_ids
        assert prompt_ids(wrong, chat) != engine_ids  # detectable: /tokenize disagrees from token 0
        assert prompt_ids(wrong, chat)[0] != engine_ids[0]

        for body, path in ((chat, CHAT), (completion, COMPLETIONS)):
            async with session.post(f"http://{sim.address}{path}", json={**body, "max_tokens": 2}) as resp:
                assert resp.status == 200, await resp.text()
        chat_blocks = len(engine_ids) // BLOCK
        completion_ids = prompt_ids(right, completion, COMPLETIONS)
        await eventually(
            lambda: all(
                indexed_blocks(server, completion_ids, [sim])[sim.address] == len(completion_ids) // BLOCK
                for server in routers.values()
            ),
            what="both routers indexed the engine's latest blocks",
        )
        assert indexed_blocks(right, engine_ids, [sim])[sim.address] == chat_blocks
        # Both indexes hold the same blocks of the engine, complete; the wrong keys match none.
        name = f"{sim.address}/dp0"
        assert sources(wrong)[name]["gpuBlocks"] == sources(right)[name]["gpuBlocks"] > chat_blocks
        assert sources(wrong)[name]["complete"] is True
        assert indexed_blocks(wrong, prompt_ids(wrong, chat), [sim])[sim.address] == 0
        assert indexed_blocks(wrong, prompt_ids(wrong, completion, COMPLETIONS), [sim])[sim.address] > 0

        # What each router's scheduler credits the engine with for a follow-up chat.
        follow_up = {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "Bye"}]}
        credited = {
            template: server.control.decide(read_request(CHAT, {**follow_up, "model": "chat"})).prefix
            for template, server in routers.items()
        }
        assert credited["llama3"].mode == "precise"
        assert credited["llama3"].cached_tokens[sim.address] >= 400 // BLOCK * BLOCK
        assert credited["chatml"].cached_tokens.get(sim.address, 0) == 0
