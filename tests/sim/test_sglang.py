"""``extproc sim --engine sglang``: what a client, a scraper and a subscriber of SGLang 0.5.23 would see."""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import orjson
import pytest
from ports import free_port_range
from simulated import StartSim

from extproc.cli import build_parser
from extproc.engines.metrics_page import parse_signals
from extproc.errors import ConfigError
from extproc.sim.kv_wire import EventEncoding
from extproc.sim.run import sim_settings
from extproc.sim.server import SimServer
from extproc.sim.settings import KVEventSettings, LoraModule
from extproc.tokenize import shipped_chat_template, shipped_tokenizer

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


async def call(
    http: aiohttp.ClientSession, server: SimServer, method: str, path: str, body: Any = None
) -> tuple[int, Any]:
    async with http.request(method, f"http://{server.address}{path}", json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, orjson.loads(text)
        except orjson.JSONDecodeError:
            return resp.status, text


async def test_models_and_tokenize_answer_in_sglangs_shapes(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    server = await sim(engine_kind="sglang", lora_modules=(LoraModule("sql-lora", "/adapters/sql"),))
    status, models = await call(http, server, "GET", "/v1/models")
    assert status == 200
    base, lora = models["data"]
    assert base == {
        "id": MODEL,
        "object": "model",
        "created": base["created"],
        "owned_by": "sglang",
        "root": MODEL,
        "parent": None,
        "max_model_len": 512,
    }
    assert (lora["id"], lora["root"], lora["parent"], lora["max_model_len"]) == (
        "sql-lora",
        "/adapters/sql",
        MODEL,
        None,
    )

    tokenizer, template = shipped_tokenizer(), shipped_chat_template("llama3")
    expected = tokenizer.encode(
        template.render(CHAT, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token),
        add_special_tokens=False,
    )
    for path in ("/tokenize", "/v1/tokenize"):
        status, answer = await call(http, server, "POST", path, {"messages": CHAT})
        assert status == 200
        assert answer == {"tokens": expected, "count": len(expected), "max_model_len": 512}
    status, answer = await call(http, server, "POST", "/v1/detokenize", {"tokens": expected[-3:]})
    assert status == 200 and set(answer) == {"text"}
    async with http.post(f"http://{server.address}/detokenize", data=b"{nope") as resp:
        assert resp.status == 400 and (await resp.json())["object"] == "error"


async def test_server_info_describes_the_kv_event_publisher(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """Routers subscribe to rank r at ``endpoint_port_base + r``: /server_info says where (and the page)."""
    base = free_port_range(4)  # two ranks' PUB ports, then their replay ports
    kv = KVEventSettings(port=base, replay_port=base + 2, encoding=EventEncoding.SGLANG)
    server = await sim(engine_kind="sglang", kv_events=kv, data_parallel_size=2)
    for path in ("/server_info", "/get_server_info"):
        status, info = await call(http, server, "GET", path)
        assert status == 200
        described = info["kv_events"]
        assert (described["endpoint_port_base"], described["replay_endpoint_port_base"]) == (base, base + 2)
        assert [r.publisher.endpoint for r in server.ranks if r.publisher] == [
            f"tcp://127.0.0.1:{base}",
            f"tcp://127.0.0.1:{base + 1}",
        ]
        assert (described["block_size"], described["dp_size"], described["publisher"]) == (16, 2, "zmq")
        assert (info["page_size"], info["dp_size"], info["context_length"]) == (16, 2, 512)
    status, info = await call(http, server, "GET", "/model_info")
    assert status == 200 and info["model_path"] == MODEL and info["is_generation"] is True
    for path in ("/health", "/health_generate"):
        assert (await call(http, server, "GET", path))[0] == 200
    for method in ("GET", "POST"):
        status, text = await call(http, server, method, "/flush_cache")
        assert status == 200 and text.startswith("Cache flushed.")
    # vLLM's own routes are not there.
    assert (await call(http, server, "POST", "/reset_prefix_cache"))[0] == 404


async def test_requests_read_model_and_cache_salt_as_sglang_does(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """Any model name reaches the base model; ``""`` is no salt; refusals are SGLang's ErrorResponse."""
    server = await sim(engine_kind="sglang", enable_prompt_tokens_details=True)
    prompt = list(range(100, 200))

    async def cached(**extra: Any) -> int:
        status, answer = await call(
            http, server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra}
        )
        assert status == 200, answer
        return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(model="any-name-at-all") == 0
    assert await cached(cache_salt="") == 96  # no salt: the unsalted blocks
    assert await cached(cache_salt=["tenant-a"]) == 0
    assert await cached(cache_salt="tenant-a") == 96
    status, error = await call(
        http, server, "POST", "/v1/completions", {"prompt": prompt, "model": f"{MODEL}:nope"}
    )
    assert status == 400
    assert error == {
        "object": "error",
        "message": "LoRA adapter 'nope' is not loaded.",
        "type": "BadRequestError",
        "param": "model",
        "code": 400,
    }


async def test_metrics_carry_sglangs_names_and_the_router_reads_them(
    sim: StartSim, http: aiohttp.ClientSession
) -> None:
    server = await sim(engine_kind="sglang", data_parallel_size=2, served_model_names=("llama",))
    prompt = list(range(100, 200))
    for _ in range(2):
        await call(http, server, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    status, text = await call(http, server, "GET", "/metrics")
    assert status == 200 and "vllm:" not in text
    labels = 'dp_rank="1",engine_type="unified",model_name="llama",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    assert f"sglang:num_running_reqs{{{labels}}} 0.0" in text
    assert (
        'sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="llama"} 200.0'
        in text
    )
    assert (
        'sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="llama"} 96.0'
        in text
    )
    assert "sglang:time_to_first_token_seconds_count" in text
    signals = parse_signals(text)
    assert (signals.running, signals.waiting, signals.engines) == (0, 0, ("0", "1"))
    assert (signals.prefix_cache_queries, signals.prefix_cache_hits) == (200.0, 96.0)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["sim", *argv])


def test_the_flag_picks_the_engines_own_event_encoding() -> None:
    settings = sim_settings(parse("--engine", "sglang", "--kv-events-port", "0"))
    assert settings.engine_kind == "sglang"
    assert settings.kv_events is not None and settings.kv_events.encoding == EventEncoding.SGLANG
    assert sim_settings(parse("--kv-events-port", "0")).kv_events.encoding == EventEncoding.MAPS  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="--kv-hash-format is vLLM's"):
        sim_settings(parse("--engine", "sglang", "--kv-hash-format", "bytes"))
    with pytest.raises(ConfigError, match="--engine sglang does not publish the maps"):
        sim_settings(parse("--engine", "sglang", "--kv-events-port", "0", "--kv-encoding", "maps"))
    with pytest.raises(ConfigError, match="--engine vllm does not publish the sglang"):
        sim_settings(parse("--kv-events-port", "0", "--kv-encoding", "sglang"))
