"""Requests through real Envoy, our ext_proc server and real HTTP backends, in both body modes."""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from typing import Any

import aiohttp
import orjson
import pytest
from waiting import eventually

from extproc.demo.backends import Backend

from .conftest import LLAMA, QWEN, RoutedFactory

MODES = pytest.mark.parametrize(
    "body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"], ids=["full-duplex", "buffered"]
)
CHAT = "/v1/chat/completions"


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Say hi"}], **extra}


async def post(session: aiohttp.ClientSession, url: str, payload: Any, **kw: Any) -> tuple[int, Any]:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    data = io.BytesIO(raw) if len(raw) > 1 << 20 else raw  # aiohttp warns on large raw bodies
    async with session.post(url, data=data, **kw) as r:
        body = await r.read()
        return r.status, (json.loads(body) if r.content_type == "application/json" else body)


def slow_stream(
    session: aiohttp.ClientSession, url: str, model: str, *, chunks: int, chunk_delay: float = 0.05
) -> Any:
    """A streamed completion the fake pod drips out one chunk per ``chunk_delay`` s, to hold a
    request open."""
    headers = {"x-backend-chunks": str(chunks), "x-backend-chunk-delay": str(chunk_delay)}
    return session.post(url + CHAT, json=chat(model, stream=True), headers=headers)


@MODES
async def test_requests_spread_over_endpoints(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """Requests for a model reach every endpoint serving it, and Envoy honours each pick."""
    gw = await routed_gateway(body_mode=body_mode)
    served: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(24):
            status, answer = await post(s, gw.url + CHAT, chat(LLAMA))
            assert status == 200, answer
            seen = answer["x_backend"]
            served[seen["address"]] += 1
            # The pick comes first in the destination list; the fallbacks follow.
            assert seen["destination_header"].split(",")[0] == seen["address"]
    assert set(served) == {b.address for b in gw.llama}
    assert gw.qwen.counters.received == 0


@MODES
async def test_alias_is_rewritten_and_body_intact(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """An alias reaches the pod as the upstream name, every other field intact, framing consistent."""
    gw = await routed_gateway(body_mode=body_mode)
    payload = chat("chat", temperature=0.25, max_tokens=7, user="ünïcode ✓")
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, gw.url + CHAT, payload)
    assert status == 200, answer
    seen = answer["x_backend"]
    assert seen["model"] == LLAMA
    expected = orjson.dumps({**payload, "model": LLAMA})
    assert seen["body_sha256"] == hashlib.sha256(expected).hexdigest()
    assert seen["body_bytes"] == len(expected)
    if body_mode == "BUFFERED":
        assert seen["content_length"] == len(expected)
    else:
        assert seen["transfer_encoding"] == "chunked"


@MODES
async def test_body_without_alias_passes_byte_for_byte(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """Without an alias the pod receives exactly the bytes the client sent."""
    gw = await routed_gateway(body_mode=body_mode)
    raw = b'{"model":  "' + QWEN.encode() + b'", "prompt": "odd   spacing\\u00e9", "max_tokens": 3}'
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, gw.url + "/v1/completions", raw)
    assert status == 200, answer
    assert answer["x_backend"]["body_sha256"] == hashlib.sha256(raw).hexdigest()
    assert answer["x_backend"]["address"] == gw.qwen.address


@MODES
async def test_sse_streaming_passes_through(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """A streamed completion arrives chunk by chunk, ending with data: [DONE]."""
    gw = await routed_gateway(body_mode=body_mode)
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url + CHAT, json=chat("chat", stream=True), headers={"x-backend-chunks": "6"}) as r,
    ):
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in r.content if line.startswith(b"data: ")]
    assert events[-1].strip() == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) >= 6
    assert chunks[0]["x_backend"]["model"] == LLAMA


@MODES
@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"{definitely not json", 400, "invalid_request"),
        (b'{"messages": []}', 400, "invalid_request"),
        (json.dumps(chat("gpt-nonexistent")).encode(), 404, "model_not_found"),
        (json.dumps(chat("cold-model")).encode(), 503, "no_ready_endpoint"),
        (json.dumps(chat("chat", pad="x" * 70_000)).encode(), 413, "request_too_large"),
    ],
    ids=["bad-json", "no-model", "unknown-model", "no-ready-endpoint", "too-large"],
)
async def test_errors_are_clean_json_answers(
    routed_gateway: RoutedFactory, body_mode: str, payload: bytes, status: int, code: str
) -> None:
    """Unroutable requests get the right status and an OpenAI-style JSON error; no pod sees them."""
    gw = await routed_gateway(body_mode=body_mode, max_body_bytes=64 * 1024)
    async with aiohttp.ClientSession() as s:
        got, answer = await post(s, gw.url + CHAT, payload)
        assert got == status, answer
        assert answer["error"]["code"] == code
        assert answer["error"]["message"]
        # The server is unharmed: the next good request works.
        ok, _ = await post(s, gw.url + CHAT, chat("chat"))
        assert ok == 200
    assert sum(b.counters.received for b in gw.llama) == 1


@MODES
async def test_client_cannot_steer_with_destination_header(
    routed_gateway: RoutedFactory, body_mode: str
) -> None:
    """A client-sent x-gateway-destination-endpoint is ignored: the picker alone decides."""
    gw = await routed_gateway(body_mode=body_mode)
    async with aiohttp.ClientSession() as s:
        for _ in range(8):
            status, answer = await post(
                s, gw.url + CHAT, chat(LLAMA), headers={"x-gateway-destination-endpoint": gw.qwen.address}
            )
            assert status == 200
            assert answer["x_backend"]["address"] != gw.qwen.address
    assert gw.qwen.counters.received == 0


async def test_original_dst_gateway_routes_and_strips_client_header(routed_gateway: RoutedFactory) -> None:
    """The ORIGINAL_DST variant routes by our single-address answer and drops a client's own header."""
    gw = await routed_gateway(config="gateway-original-dst.yaml", max_fallbacks=0)
    served: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(12):
            status, answer = await post(
                s, gw.url + CHAT, chat("chat"), headers={"x-gateway-destination-endpoint": gw.qwen.address}
            )
            assert status == 200, answer
            served[answer["x_backend"]["address"]] += 1
            assert "," not in answer["x_backend"]["destination_header"]
    assert set(served) == {b.address for b in gw.llama}
    assert gw.qwen.counters.received == 0


async def test_three_megabyte_body_in_full_duplex(routed_gateway: RoutedFactory) -> None:
    """A 3 MB prompt goes through FULL_DUPLEX_STREAMED intact, with the alias rewritten."""
    gw = await routed_gateway(body_mode="FULL_DUPLEX_STREAMED")
    payload = chat("chat", prompt_padding="lorem ipsum " * 262_144)
    async with aiohttp.ClientSession() as s:
        status, answer = await post(s, gw.url + CHAT, payload)
    assert status == 200, answer
    expected = orjson.dumps({**payload, "model": LLAMA})
    assert len(expected) > 3_000_000
    assert answer["x_backend"]["body_sha256"] == hashlib.sha256(expected).hexdigest()


@MODES
async def test_inflight_held_while_streaming_and_released_at_end(
    routed_gateway: RoutedFactory, body_mode: str
) -> None:
    """A request counts against its pod until its response has finished, then not at all."""
    gw = await routed_gateway(body_mode=body_mode)
    inflight = gw.server.load
    async with (
        aiohttp.ClientSession() as s,
        slow_stream(s, gw.url, "chat", chunks=20) as r,
    ):
        first = await r.content.readline()
        assert first.startswith(b"data: ")
        await eventually(lambda: inflight.total == 1)  # the accounting stream's count
        await r.read()
    await eventually(lambda: inflight.total == 0)


@MODES
async def test_killed_backend_does_not_wedge_inflight(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """A pod dying mid-stream, or refusing connections, leaves no in-flight count behind."""
    gw = await routed_gateway(body_mode=body_mode)
    inflight = gw.server.load
    async with aiohttp.ClientSession() as s:
        async with slow_stream(s, gw.url, LLAMA, chunks=200) as streaming:
            first = json.loads((await streaming.content.readline())[6:])
            [victim] = [b for b in gw.llama if b.address == first["x_backend"]["address"]]
            await eventually(lambda: inflight.total == 1)  # the accounting stream's count
            await victim.stop()
            with pytest.raises(aiohttp.ClientPayloadError):
                await streaming.read()
        await eventually(lambda: inflight.total == 0)
        # The dead pod is still in the catalog: requests picked for it are retried on the fallbacks.
        for _ in range(9):
            status, _ = await post(s, gw.url + CHAT, chat(LLAMA))
            assert status == 200
    await eventually(lambda: inflight.total == 0)


@MODES
async def test_client_disconnect_releases_inflight(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """A client hanging up mid-stream frees its pod in our accounting."""
    gw = await routed_gateway(body_mode=body_mode)
    inflight = gw.server.load
    async with aiohttp.ClientSession() as s:
        r = await slow_stream(s, gw.url, "chat", chunks=200)
        await r.content.readline()
        await eventually(lambda: inflight.total == 1)  # the accounting stream's count
        r.close()
    await eventually(lambda: inflight.total == 0)


async def test_catalog_file_change_applies_live(routed_gateway: RoutedFactory) -> None:
    """Editing the catalog file adds an alias and removes a pod while traffic keeps flowing."""
    from .conftest import worker_sets, write_catalog

    gw = await routed_gateway()
    async with aiohttp.ClientSession() as s:
        status, _ = await post(s, gw.url + CHAT, chat("llama-latest"))
        assert status == 404
        generation = gw.server.store.generation
        sets = worker_sets(gw.llama[:2], gw.qwen, llama_aliases=("chat", "llama-latest"))
        write_catalog(gw.catalog_path, sets)
        # Traffic during the reload never fails.
        while gw.server.store.generation == generation:
            status, _ = await post(s, gw.url + CHAT, chat("chat"))
            assert status == 200
        before = gw.llama[2].counters.received
        for _ in range(10):
            status, answer = await post(s, gw.url + CHAT, chat("llama-latest"))
            assert status == 200
            assert answer["x_backend"]["model"] == LLAMA
        assert gw.llama[2].counters.received == before, "a removed pod still gets traffic"


@MODES
async def test_gateway_subset_hint_is_honoured(routed_gateway: RoutedFactory, body_mode: str) -> None:
    """A subset hint a gateway filter puts in envoy.lb.subset_hint limits the pick to those pods."""

    def add_subset_filter(config: dict[str, Any], llama: list[Backend]) -> None:
        allowed = [b.address for b in llama[1:]]
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = hcm["http_filters"]
        index = next(i for i, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
        filters.insert(
            index,
            {
                "name": "envoy.filters.http.set_metadata",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                    "metadata": [
                        {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "value": {"x-gateway-destination-endpoint-subset": allowed},
                        }
                    ],
                },
            },
        )

    gw = await routed_gateway(body_mode=body_mode, edit=add_subset_filter)
    served: Counter[str] = Counter()
    async with aiohttp.ClientSession() as s:
        for _ in range(12):
            status, answer = await post(s, gw.url + CHAT, chat("chat"))
            assert status == 200, answer
            served[answer["x_backend"]["address"]] += 1
    assert set(served) == {b.address for b in gw.llama[1:]}


async def test_more_concurrent_streams_than_envoys_default_circuit_breakers(
    routed_gateway: RoutedFactory,
) -> None:
    """1,100 responses streaming at once all get through: past Envoy's default of 1,024 requests per
    cluster, which every request in flight holds twice (its accounting stream and its pod)."""
    gw = await routed_gateway()
    streams = 1_100
    # One chunk per stream every 2 s: the test is about how many are open at once, and the client,
    # the pods and the picker share this process (20 chunks/s each would be 22,000/s through it).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        opened = [
            await slow_stream(s, gw.url, "chat", chunks=100, chunk_delay=2.0).__aenter__()
            for _ in range(streams)
        ]
        try:
            statuses = Counter(r.status for r in opened)
            assert statuses == {200: streams}, statuses
            await eventually(lambda: gw.server.load.total == streams, within=30)
        finally:
            for r in opened:
                r.close()
    await eventually(lambda: gw.server.load.total == 0, within=30)
