"""A small OpenAI-compatible fake model server for the demo and the integration tests.

Not a simulator (that is :mod:`extproc.sim`): it answers instantly with canned text, but it reports
*exactly what it received* in every answer, under ``"x_backend"`` (JSON answer, and the first SSE
chunk), so an end-to-end test through real Envoy can assert which pod served a request, whether the
``model`` was rewritten, whether the body arrived byte-for-byte (size + sha256), and how it was
framed (Envoy's FULL_DUPLEX_STREAMED mode strips Content-Length, so bodies arrive chunked).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON, or SSE with ``"stream": true``),
``GET /v1/models``, ``GET /health``.

Per-request knobs, as request headers (tests only; a real client never sends them):

- ``x-backend-chunks``: number of content chunks to stream (default: the Backend's ``chunks``);
- ``x-backend-chunk-delay``: seconds between SSE chunks (default: the Backend's ``chunk_delay``),
  to keep a stream open for a while.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from extproc.addresses import join_host_port
from extproc.tasks import StartStop

DESTINATION_HEADER = "x-gateway-destination-endpoint"
CHUNKS_HEADER = "x-backend-chunks"
CHUNK_DELAY_HEADER = "x-backend-chunk-delay"

#: Large prompts must get through: the gateway allows 32 MiB bodies.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
_MAX_CHUNKS = 10_000
_MAX_CHUNK_DELAY = 10.0
_WORDS = ("Hello", " from", " a", " fake", " model", " server", ".", " Tokens", " keep", " coming")


@dataclass(frozen=True, slots=True)
class Received:
    """What one completion request looked like on arrival (also sent back as ``x_backend``)."""

    name: str
    address: str
    path: str
    model: str | None
    body_bytes: int
    body_sha256: str
    content_length: int | None
    transfer_encoding: str | None
    destination_header: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "address": self.address,
            "path": self.path,
            "model": self.model,
            "body_bytes": self.body_bytes,
            "body_sha256": self.body_sha256,
            "content_length": self.content_length,
            "transfer_encoding": self.transfer_encoding,
            "destination_header": self.destination_header,
        }


@dataclass(slots=True)
class BackendCounters:
    """Counts for tests: ``served`` = completion answers finished (JSON sent, or SSE up to [DONE])."""

    received: int = 0
    served: int = 0
    streams_aborted: int = 0
    bad_requests: int = 0
    in_flight: int = 0
    by_path: collections.Counter[str] = field(default_factory=collections.Counter)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class Backend(StartStop):
    """One fake model server on ``host:port`` (``port=0`` picks a free port).

    ``async with Backend("b1") as b:`` starts it on 127.0.0.1; ``b.address`` is ``"127.0.0.1:PORT"``.
    ``models`` is what ``/v1/models`` lists; with ``strict_models`` any other model gets the 404 a
    real engine gives (to prove an alias was rewritten), otherwise every model is accepted.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        models: Sequence[str] = ("fake-model",),
        strict_models: bool = False,
        chunks: int = 4,
        chunk_delay: float = 0.01,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        history: int = 100,
    ) -> None:
        self.name = name
        self.models = tuple(models)
        self.strict_models = strict_models
        self.chunks = chunks
        self.chunk_delay = chunk_delay
        self.max_body_bytes = max_body_bytes
        self.counters = BackendCounters()
        #: The most recent requests' :class:`Received` records, oldest first.
        self.history: collections.deque[Received] = collections.deque(maxlen=history)
        self._runner: web.AppRunner | None = None
        self._host = ""
        self._port = 0
        self._ids = itertools.count(1)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` and return the bound ``host:port`` address."""
        if self._runner is not None:
            raise RuntimeError(f"backend {self.name!r} already started on {self.address}")
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        # Binding our own socket gives the real port for port=0 without touching aiohttp internals.
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        # Short shutdown: open SSE streams must not hold a test's teardown for a minute.
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            await runner.cleanup()
            sock.close()
            raise
        self._runner = runner
        self._host, self._port = sock.getsockname()[:2]
        if self.name is None:
            self.name = f"backend-{self._port}"
        return self.address

    async def stop(self) -> None:
        """Stop listening and close open connections. Safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """``ip:port`` as Envoy and the catalog spell it (``[v6]:port`` for IPv6)."""
        return join_host_port(self._host, self._port)

    @property
    def requests_served(self) -> int:
        return self.counters.served

    # -- handlers -----------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": self.name} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.counters.bad_requests += 1
            return _error(413, f"body over {self.max_body_bytes} bytes", "request_too_large")
        self.counters.received += 1
        self.counters.by_path[request.path] += 1
        try:
            body = _parse_body(raw)
            model = body["model"]
            received = self._received(request, raw, model)
            self.history.append(received)
            if self.strict_models and model not in self.models:
                raise _BadRequest(404, f"The model `{model}` does not exist.", "model_not_found")
            chunks = _header_number(request, CHUNKS_HEADER, int, self.chunks, 0, _MAX_CHUNKS)
            delay = _header_number(
                request, CHUNK_DELAY_HEADER, float, self.chunk_delay, 0.0, _MAX_CHUNK_DELAY
            )
        except _BadRequest as exc:
            self.counters.bad_requests += 1
            if exc.status == 400:
                self.history.append(self._received(request, raw, None))
            return _error(exc.status, exc.message, exc.code)

        chat = request.path.endswith("/chat/completions")
        self.counters.in_flight += 1
        try:
            if body.get("stream") is True:
                return await self._stream(request, received, model, chat, chunks, delay)
            text = "".join(_WORDS[i % len(_WORDS)] for i in range(chunks))
            answer = _completion(self._id(chat), model, chat, text, received)
            self.counters.served += 1
            return web.json_response(answer, headers={"X-Backend": self.name or ""})
        finally:
            self.counters.in_flight -= 1

    async def _stream(
        self, request: web.Request, received: Received, model: str, chat: bool, chunks: int, delay: float
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Backend": self.name or "",
            }
        )
        ident = self._id(chat)
        try:
            await resp.prepare(request)
            for i in range(chunks):
                chunk = _chunk(ident, model, chat, _WORDS[i % len(_WORDS)], first=i == 0, finish=None)
                if i == 0:
                    chunk["x_backend"] = received.as_json()
                await resp.write(_sse(chunk))
                await asyncio.sleep(delay)
            final = _chunk(ident, model, chat, "", first=chunks == 0, finish="stop")
            if chunks == 0:
                final["x_backend"] = received.as_json()
            await resp.write(_sse(final))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            # The client (or Envoy) went away mid-stream: normal for SSE, not a server error.
            self.counters.streams_aborted += 1
            return resp
        self.counters.served += 1
        return resp

    def _received(self, request: web.Request, raw: bytes, model: str | None) -> Received:
        length = request.headers.get("Content-Length")
        return Received(
            name=self.name or "",
            address=self.address,
            path=request.path,
            model=model,
            body_bytes=len(raw),
            body_sha256=hashlib.sha256(raw).hexdigest(),
            content_length=int(length) if length is not None and length.isdigit() else None,
            transfer_encoding=request.headers.get("Transfer-Encoding"),
            destination_header=request.headers.get(DESTINATION_HEADER),
        )

    def _id(self, chat: bool) -> str:
        prefix = "chatcmpl" if chat else "cmpl"
        return f"{prefix}-{self._port}-{next(self._ids)}"


# -- helpers --------------------------------------------------------------------------------------------


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _BadRequest(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _BadRequest(400, "request body must be a JSON object", "invalid_request")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _BadRequest(400, "`model` is required and must be a non-empty string", "missing_model")
    return body


_N = TypeVar("_N", int, float)


def _header_number(request: web.Request, header: str, kind: type[_N], default: _N, low: _N, high: _N) -> _N:
    text = request.headers.get(header)
    if text is None:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise _BadRequest(400, f"{header} must be a number, got {text!r}", "invalid_request") from None
    if not low <= value <= high:
        raise _BadRequest(400, f"{header} must be in [{low}, {high}], got {text!r}", "invalid_request")
    return value


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}, status=status
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _completion(ident: str, model: str, chat: bool, text: str, received: Received) -> dict[str, Any]:
    completion_tokens = len(text.split())
    choice: dict[str, Any]
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(max(1, received.body_bytes // 4), completion_tokens),
        "x_backend": received.as_json(),
    }


def _chunk(
    ident: str, model: str, chat: bool, text: str, *, first: bool, finish: str | None
) -> dict[str, Any]:
    choice: dict[str, Any]
    if chat:
        delta: dict[str, Any] = {"content": text} if text else {}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def start_backends(count: int, *, host: str = "127.0.0.1", **kwargs: Any) -> list[Backend]:
    """Start ``count`` backends named ``backend-1..N`` on free ports; on failure stop those started."""
    started: list[Backend] = []
    try:
        for i in range(1, count + 1):
            backend = Backend(f"backend-{i}", **kwargs)
            await backend.start(host)
            started.append(backend)
    except BaseException:
        for backend in started:
            await backend.stop()
        raise
    return started
