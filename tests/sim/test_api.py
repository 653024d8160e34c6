"""The simulator's HTTP API over real sockets: what a client of vLLM would see."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import orjson
import pytest
from simulated import StartSim, idle
from waiting import eventually

from extproc.sim.server import SimServer
from extproc.sim.settings import KVEventSettings, LoraModule
from extproc.tokenize import shipped_chat_template, shipped_tokenizer

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def url(server: SimServer, path: str) -> str:
    return f"http://{server.address}{path}"


async def post(http: aiohttp.ClientSession, server: SimServer, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(url(server, path), json=body) as resp:
        text = await resp.text()
        return resp.status, (orjson.loads(text) if text else None)


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    """Every ``data:`` payload of an SSE answer, ``[DONE]`` kept as the string."""
    events: list[Any] = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            data = text[len("data: ") :]
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def test_models_lists_base_names_and_adapters_like_vllm(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """Base cards carry root and max_model_len; LoRA cards name their parent and adapter path."""
    server = await sim(
        served_model_names=("llama", "llama-alt"), lora_modules=(LoraModule("sql", "/adapters/sql"),)
    )
    async with http.get(url(server, "/v1/models")) as resp:
        cards = {card["id"]: card for card in (await resp.json())["data"]}
    assert set(cards) == {"llama", "llama-alt", "sql"}
    assert (cards["llama"]["root"], cards["llama"]["parent"], cards["llama"]["max_model_len"]) == (
        MODEL,
        None,
        512,
    )
    assert (cards["sql"]["root"], cards["sql"]["parent"], cards["sql"]["max_model_len"]) == (
        "/adapters/sql",
        "llama",
        None,
    )
    assert cards["sql"]["object"] == "model" and cards["sql"]["owned_by"] == "vllm"


async def test_chat_answer_counts_the_templated_prompt(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """usage.prompt_tokens is the chat template's token count, the same /tokenize reports."""
    server = await sim()
    status, answer = await post(http, server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5})
    assert status == 200
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert answer["choices"][0]["finish_reason"] == "length"
    assert (
        answer["choices"][0]["message"]["role"] == "assistant" and answer["choices"][0]["message"]["content"]
    )
    _, tokenized = await post(http, server, "/tokenize", {"messages": CHAT})
    tokenizer, template = shipped_tokenizer(), shipped_chat_template("llama3")
    expected = tokenizer.encode(
        template.render(CHAT, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token),
        add_special_tokens=False,
    )
    assert tokenized["tokens"] == expected
    assert answer["usage"] == {
        "prompt_tokens": len(expected),
        "completion_tokens": 5,
        "total_tokens": len(expected) + 5,
        "prompt_tokens_details": None,
    }


async def test_the_tokenize_cache_gives_the_same_ids_and_encodes_a_known_prefix_once(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """--tokenize-cache-mb: a conversation's next turn tokenizes to the same ids as without it, and
    its history's pieces come from the cache (what saves a load harness's CPU)."""
    plain, cached = await sim(), await sim(tokenize_cache_bytes=1 << 20)
    history = [*CHAT, {"role": "assistant", "content": "Teal, " * 40}]
    turns = [history, [*history, {"role": "user", "content": "Another, with ünïcode  and spaces "}]]
    for messages in turns:
        _, want = await post(http, plain, "/tokenize", {"messages": messages})
        _, got = await post(http, cached, "/tokenize", {"messages": messages})
        assert got["tokens"] == want["tokens"]
    cache = cached.tokenizer.segment_cache
    assert plain.tokenizer.segment_cache is None
    assert cache is not None and cache.stats.hits >= 2  # the second turn walked the first's segments


async def test_chatml_template_changes_the_tokens(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """The same conversation tokenizes differently under ChatML than under Llama-3 headers."""
    llama, chatml = await sim(), await sim(chat_template="chatml")
    _, a = await post(http, llama, "/tokenize", {"messages": CHAT})
    _, b = await post(http, chatml, "/tokenize", {"messages": CHAT})
    assert a["tokens"] != b["tokens"]
    im_start = shipped_tokenizer().token_to_id("<|im_start|>")
    assert b["tokens"][0] == im_start


@pytest.mark.parametrize(
    ("body", "expected_bos"),
    [({"prompt": "hello"}, True), ({"prompt": "hello", "add_special_tokens": False}, False)],
    ids=["default-adds-bos", "no-special-tokens"],
)
async def test_tokenize_completion_form(
    sim: StartSim, http: aiohttp.ClientSession, body: dict[str, Any], expected_bos: bool
) -> None:
    """/tokenize answers count, max_model_len, tokens, and token strings when asked."""
    server = await sim()
    status, answer = await post(http, server, "/tokenize", {**body, "return_token_strs": True})
    assert status == 200
    bos = shipped_tokenizer().bos_token_id
    assert (answer["tokens"][0] == bos) is expected_bos
    assert answer["count"] == len(answer["tokens"]) == len(answer["token_strs"])
    assert answer["max_model_len"] == 512
    _, text = await post(http, server, "/detokenize", {"tokens": answer["tokens"]})
    assert text == {"prompt": "hello"}


async def test_streaming_chat_chunks_usage_and_done(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """A chat stream: role delta, content deltas, finish_reason, the usage chunk, then [DONE]."""
    server = await sim()
    body = {"messages": CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url(server, "/v1/chat/completions"), json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    first, *content, last_choice, usage = events[:-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert last_choice["choices"][0]["finish_reason"] == "length"
    assert [e["choices"][0]["finish_reason"] for e in content] == [None] * len(content)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


async def test_cached_tokens_reported_when_enabled(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """With prompt-token details on, a repeated prompt reports its cached tokens (whole blocks)."""
    server = await sim(enable_prompt_tokens_details=True)
    prompt = list(range(100, 200))  # 100 tokens: 6 full blocks of 16
    _, first = await post(http, server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    _, second = await post(http, server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}


async def test_cache_salt_keeps_prompts_apart(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """As vLLM: a salted prompt hits only blocks cached under the same salt; an empty salt is refused."""
    server = await sim(enable_prompt_tokens_details=True)
    prompt = list(range(100, 200))

    async def cached(**extra: Any) -> int:
        status, answer = await post(
            http, server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra}
        )
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached() == 0
    assert await cached(cache_salt="tenant-a") == 0
    assert await cached(cache_salt="tenant-a") == 96
    assert await cached(cache_salt="tenant-b") == 0
    assert await cached() == 96
    status, answer = await post(http, server, "/v1/completions", {"prompt": prompt, "cache_salt": ""})
    assert status == 400 and "cache_salt" in answer["error"]["message"]


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
async def test_prefix_hits_show_in_metrics(sim: StartSim, http: aiohttp.ClientSession, algo: str) -> None:
    """vllm:prefix_cache_{queries,hits}_total count tokens per engine, with vLLM's labels, whatever
    hashes the blocks (vLLM's --prefix-caching-hash-algo, named in its cache config)."""
    server = await sim(served_model_names=("llama",), engine={"prefix_caching_hash_algo": algo})
    prompt = list(range(100, 200))
    for _ in range(2):
        await post(http, server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    async with http.get(url(server, "/metrics")) as resp:
        text = await resp.text()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 200.0' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 96.0' in text
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 2.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="llama"} 0.0' in text
    assert 'block_size="16"' in text and "vllm:cache_config_info" in text
    assert f'prefix_caching_hash_algo="{algo}"' in text


async def test_every_token_after_the_first_counts_one_inter_token_latency(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """vllm:inter_token_latency_seconds: one sample per decoded token after the first, each a
    decode step's simulated length (the engine's step cost with one sequence decoding)."""
    server = await sim(served_model_names=("llama",))
    status, answer = await post(http, server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6})
    assert status == 200, answer
    async with http.get(url(server, "/metrics")) as resp:
        text = await resp.text()
    count = re.search(
        r'^vllm:inter_token_latency_seconds_count\{engine="0",model_name="llama"\} (\S+)$', text, re.M
    )
    total = re.search(
        r'^vllm:inter_token_latency_seconds_sum\{engine="0",model_name="llama"\} (\S+)$', text, re.M
    )
    assert count is not None and total is not None, text
    assert float(count.group(1)) == 5
    step = server.settings.engine.decode_base_s + server.settings.engine.decode_per_seq_s
    assert float(total.group(1)) == pytest.approx(5 * step)


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "The model `gpt-4` does not exist."),
        ("/v1/completions", {"prompt": list(range(10, 600))}, 400, "maximum context length is 512"),
        ("/v1/chat/completions", {"messages": []}, 400, "'messages' must be a non-empty list"),
        ("/tokenize", {"text": "x"}, 400, "give either 'prompt' or 'messages'"),
        ("/detokenize", {"tokens": "x"}, 400, "'tokens' must be a list"),
        ("/sim/kv_events", {"restart": True}, 400, "KV events are off"),
    ],
    ids=["unknown-model", "too-long", "no-messages", "tokenize-neither", "detokenize-bad", "kv-off"],
)
async def test_refusals_are_vllm_error_json(
    sim: StartSim, http: aiohttp.ClientSession, path: str, body: Any, status: int, fragment: str
) -> None:
    """Bad requests get vLLM's error JSON with the status as code and a message naming the problem."""
    server = await sim()
    got_status, answer = await post(http, server, path, body)
    assert got_status == status
    assert answer["error"]["code"] == status and fragment in answer["error"]["message"]


async def test_invalid_json_is_a_400(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """A body that is not JSON is refused with a message saying so."""
    server = await sim()
    async with http.post(url(server, "/v1/completions"), data=b"{nope") as resp:
        assert resp.status == 400
        assert "not valid JSON" in (await resp.json())["error"]["message"]


async def test_client_going_away_frees_the_request(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """Closing a stream mid-way aborts the request: it stops running and its blocks are freed."""
    server = await sim(time_scale=1.0)
    body = {"prompt": list(range(100, 164)), "max_tokens": 400, "stream": True}
    async with http.post(url(server, "/v1/completions"), json=body) as resp:
        await resp.content.readline()
        assert server.ranks[0].core.num_running == 1
    await eventually(lambda: idle(server))
    assert server.ranks[0].core.kv_cache_usage == 0.0


async def test_reset_prefix_cache_refuses_while_blocks_are_in_use(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """Like vLLM, the reset only happens when nothing runs; the refusal says why."""
    server = await sim(time_scale=1.0)
    body = {"prompt": list(range(100, 164)), "max_tokens": 400, "stream": True}
    async with http.post(url(server, "/v1/completions"), json=body) as resp:
        await resp.content.readline()
        status, answer = await post(http, server, "/reset_prefix_cache", None)
        assert status == 400 and "in use" in answer["error"]["message"]
    await eventually(lambda: idle(server))
    async with http.post(url(server, "/reset_prefix_cache")) as resp:
        assert resp.status == 200
    assert not server.ranks[0].core.cache.cached_hashes()


async def test_health_and_version(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """GET /health is an empty 200; /version names the simulator."""
    server = await sim()
    async with http.get(url(server, "/health")) as resp:
        assert resp.status == 200 and await resp.read() == b""
    async with http.get(url(server, "/version")) as resp:
        assert "extproc-sim" in (await resp.json())["version"]


async def test_data_parallel_rank_header_picks_the_rank(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """X-data-parallel-rank sends a request to that rank's cache; a bad value is a 400."""
    server = await sim(data_parallel_size=2, kv_events=KVEventSettings(port=0))
    prompt = list(range(100, 140))
    async with http.post(
        url(server, "/v1/completions"),
        json={"prompt": prompt, "max_tokens": 1},
        headers={"X-data-parallel-rank": "1"},
    ) as resp:
        assert resp.status == 200
    assert server.ranks[0].core.prefix_cache_queries == 0
    assert server.ranks[1].core.prefix_cache_queries == 40
    async with http.post(
        url(server, "/v1/completions"), json={"prompt": prompt}, headers={"X-data-parallel-rank": "2"}
    ) as resp:
        assert resp.status == 400
        assert "out of range (0-1)" in (await resp.json())["error"]["message"]
    endpoints = [rank["kv_events"]["endpoint"] for rank in server.state()["ranks"]]
    assert len(set(endpoints)) == 2


async def test_requests_without_rank_spread_over_ranks(sim: StartSim, http: aiohttp.ClientSession) -> None:
    """Concurrent requests go to the least-loaded rank, so both ranks get work."""
    server = await sim(data_parallel_size=2, time_scale=0.1)
    body = {"prompt": list(range(100, 140)), "max_tokens": 20}
    await asyncio.gather(*(post(http, server, "/v1/completions", body) for _ in range(6)))
    assert all(rank.core.prefix_cache_queries > 0 for rank in server.ranks)
