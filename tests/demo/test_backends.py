"""The fake OpenAI backend over real HTTP: what it answers and what it reports having received."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from extproc.demo.backends import Backend, start_backends

CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "llama", "prompt": "Once upon a time"}


async def _sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    text = (await resp.read()).decode()
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]


@pytest.fixture
async def backend() -> AsyncIterator[Backend]:
    async with Backend("b1", chunks=3, chunk_delay=0.0) as b:
        yield b


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_start_returns_the_bound_address_and_stop_frees_the_port() -> None:
    b = Backend("x")
    address = await b.start("127.0.0.1", 0)
    assert address == b.address == f"127.0.0.1:{b.port}"
    assert b.port > 0
    await b.stop()
    await b.stop()  # idempotent
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", b.port))  # nothing holds it any more


async def test_start_twice_is_an_error(backend: Backend) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        await backend.start()


async def test_unnamed_backend_is_named_after_its_port() -> None:
    async with Backend() as b:
        assert b.name == f"backend-{b.port}"


async def test_chat_completion_reports_exactly_what_was_received(
    backend: Backend, session: aiohttp.ClientSession
) -> None:
    raw = json.dumps(CHAT).encode()
    headers = {"content-type": "application/json", "x-gateway-destination-endpoint": "10.0.0.1:8000"}
    async with session.post(f"http://{backend.address}/v1/chat/completions", data=raw, headers=headers) as r:
        assert r.status == 200
        assert r.headers["X-Backend"] == "b1"
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "llama"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == "Hello from a"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert body["x_backend"] == {
        "name": "b1",
        "address": backend.address,
        "path": "/v1/chat/completions",
        "model": "llama",
        "body_bytes": len(raw),
        "body_sha256": hashlib.sha256(raw).hexdigest(),
        "content_length": len(raw),
        "transfer_encoding": None,
        "destination_header": "10.0.0.1:8000",
    }
    assert backend.counters.received == backend.counters.served == backend.requests_served == 1
    assert backend.counters.by_path == {"/v1/chat/completions": 1}
    assert backend.history[-1].as_json() == body["x_backend"]


async def test_text_completion_shape(backend: Backend, session: aiohttp.ClientSession) -> None:
    async with session.post(f"http://{backend.address}/v1/completions", json=COMPLETION) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "Hello from a"
    assert body["x_backend"]["path"] == "/v1/completions"
    assert body["x_backend"]["destination_header"] is None


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_streaming_answers_sse_chunks_then_done(
    backend: Backend, session: aiohttp.ClientSession, path: str
) -> None:
    payload = {**(CHAT if "chat" in path else COMPLETION), "stream": True}
    async with session.post(f"http://{backend.address}{path}", json=payload) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4  # 3 content chunks + the finishing one
    assert chunks[0]["x_backend"]["model"] == "llama"
    assert chunks[0]["x_backend"]["body_bytes"] == len(json.dumps(payload).encode())
    assert all("x_backend" not in c for c in chunks[1:])
    assert all(c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    if "chat" in path:
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    else:
        assert chunks[0]["object"] == "text_completion"
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "Hello from a"
    assert backend.counters.served == 1


async def test_zero_chunk_stream_still_reports_x_backend(
    backend: Backend, session: aiohttp.ClientSession
) -> None:
    headers = {"x-backend-chunks": "0"}
    async with session.post(
        f"http://{backend.address}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as r:
        events = await _sse_events(r)
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["x_backend"]["name"] for e in events[:-1]] == ["b1"]


async def test_chunked_request_bodies_are_accepted_and_reported(
    backend: Backend, session: aiohttp.ClientSession
) -> None:
    """Envoy's FULL_DUPLEX_STREAMED mode strips Content-Length, so bodies arrive chunked."""
    raw = json.dumps(CHAT).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    headers = {"content-type": "application/json"}
    async with session.post(
        f"http://{backend.address}/v1/chat/completions", data=pieces(), headers=headers
    ) as r:
        assert r.status == 200
        info = (await r.json())["x_backend"]
    assert info["transfer_encoding"] == "chunked"
    assert info["content_length"] is None
    assert info["body_bytes"] == len(raw)
    assert info["body_sha256"] == hashlib.sha256(raw).hexdigest()


async def test_multi_megabyte_bodies_are_accepted(backend: Backend, session: aiohttp.ClientSession) -> None:
    raw = json.dumps({**CHAT, "messages": [{"role": "user", "content": "y" * 6_000_000}]}).encode()
    headers = {"content-type": "application/json"}
    async with session.post(
        f"http://{backend.address}/v1/chat/completions", data=io.BytesIO(raw), headers=headers
    ) as r:
        assert r.status == 200
        info = (await r.json())["x_backend"]
    assert info["body_bytes"] == len(raw)
    assert info["body_sha256"] == hashlib.sha256(raw).hexdigest()


async def test_bodies_over_the_limit_get_413(session: aiohttp.ClientSession) -> None:
    async with Backend("small", max_body_bytes=1000) as b:
        async with session.post(f"http://{b.address}/v1/completions", data=b"x" * 5000) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"
        assert b.counters.bad_requests == 1


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b"[1, 2]", "invalid_request"),
        (b'{"prompt": "no model"}', "missing_model"),
        (b'{"model": 7}', "missing_model"),
        (b'{"model": ""}', "missing_model"),
    ],
)
async def test_invalid_bodies_get_400_in_openai_error_shape(
    backend: Backend, session: aiohttp.ClientSession, data: bytes, code: str
) -> None:
    async with session.post(f"http://{backend.address}/v1/chat/completions", data=data) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert backend.counters.bad_requests == 1
    assert backend.counters.served == 0
    # Even a rejected body is recorded, so a test can see what reached the backend.
    assert backend.history[-1].body_bytes == len(data)


@pytest.mark.parametrize(
    ("header", "value"),
    [("x-backend-chunks", "many"), ("x-backend-chunks", "-1"), ("x-backend-chunk-delay", "99")],
)
async def test_bad_knob_headers_get_400(
    backend: Backend, session: aiohttp.ClientSession, header: str, value: str
) -> None:
    async with session.post(
        f"http://{backend.address}/v1/completions", json=COMPLETION, headers={header: value}
    ) as r:
        assert r.status == 400
        assert header in (await r.json())["error"]["message"]


async def test_strict_models_answers_404_for_unknown_models(session: aiohttp.ClientSession) -> None:
    async with Backend("s", models=["llama-3-8b"], strict_models=True) as b:
        async with session.post(f"http://{b.address}/v1/completions", json=COMPLETION) as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == "model_not_found"
        async with session.post(
            f"http://{b.address}/v1/completions", json={**COMPLETION, "model": "llama-3-8b"}
        ) as r:
            assert r.status == 200
        assert [x.model for x in b.history] == ["llama", "llama-3-8b"]


async def test_models_and_health(session: aiohttp.ClientSession) -> None:
    async with Backend("m", models=["a", "b"]) as b:
        async with session.get(f"http://{b.address}/v1/models") as r:
            assert r.status == 200
            body = await r.json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["a", "b"]
        async with session.get(f"http://{b.address}/health") as r:
            assert r.status == 200
        async with session.get(f"http://{b.address}/v1/chat/completions") as r:
            assert r.status == 405


async def test_in_flight_counts_an_open_stream_and_delay_headers_slow_it_down(
    backend: Backend, session: aiohttp.ClientSession
) -> None:
    headers = {"x-backend-chunks": "5", "x-backend-chunk-delay": "0.1"}
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with session.post(
        f"http://{backend.address}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as r:
        await r.content.readuntil(b"\n\n")  # first chunk arrived: the stream is open
        assert backend.counters.in_flight == 1
        events = await _sse_events(r)
    assert loop.time() - start >= 0.4
    assert len(events) == 6  # after the first: 4 more content chunks, the finishing one, [DONE]
    assert backend.counters.in_flight == 0
    assert backend.counters.served == 1


async def test_client_disconnect_mid_stream_is_counted_not_crashed(backend: Backend) -> None:
    headers = {"x-backend-chunks": "50", "x-backend-chunk-delay": "0.02"}
    async with aiohttp.ClientSession() as s:
        r = await s.post(
            f"http://{backend.address}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
        )
        await r.content.readuntil(b"\n\n")
        r.close()  # drop the connection
    for _ in range(100):
        if backend.counters.streams_aborted:
            break
        await asyncio.sleep(0.02)
    assert backend.counters.streams_aborted == 1
    assert backend.counters.served == 0
    assert backend.counters.in_flight == 0
    # Still serving afterwards.
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{backend.address}/v1/completions", json=COMPLETION) as r2,
    ):
        assert r2.status == 200


async def test_start_backends_helper_and_the_backends_fixture(backends: Any) -> None:
    started = await start_backends(2)
    try:
        assert [b.name for b in started] == ["backend-1", "backend-2"]
        assert len({b.port for b in started}) == 2
    finally:
        for b in started:
            await b.stop()
    first = await backends(2, chunks=1)
    more = await backends(1)
    assert [b.name for b in first + more] == ["backend-1", "backend-2", "backend-3"]
    assert first[0].chunks == 1
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{more[0].address}/v1/completions", json=COMPLETION) as r,
    ):
        assert (await r.json())["x_backend"]["name"] == "backend-3"
