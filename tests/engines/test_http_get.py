"""Kept-alive GETs against real sockets: framing, reuse, bounds and every way an answer goes wrong."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from extproc.engines.http_get import BadResponse, ConnectError, Disconnected, KeptAliveGets, TooLarge
from extproc.types import EndpointAddress

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A loopback TCP server answering each request with what the test scripts; counts connections."""

    def __init__(self, answer: Callable[[int], bytes | None]) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.address = EndpointAddress("")
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = EndpointAddress(f"127.0.0.1:{port}")
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(request)
                answer = self.answer(len(self.requests))
                if answer is None:  # hang up without answering
                    break
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer or b"HTTP/1.0" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def sized(body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.fixture
async def gets() -> AsyncIterator[KeptAliveGets]:
    client = KeptAliveGets()
    yield client
    client.close()


async def test_one_connection_serves_every_get_to_an_endpoint(gets: KeptAliveGets) -> None:
    async with RawServer(lambda n: sized(f"answer {n}".encode())) as server:
        bodies = [
            (await gets.get(server.address, "/metrics", accept="text/plain", max_bytes=100)).body
            for _ in range(3)
        ]
    assert bodies == [b"answer 1", b"answer 2", b"answer 3"]
    assert server.connections == 1
    assert server.requests[0].startswith(b"GET /metrics HTTP/1.1\r\n")
    assert f"Host: {server.address}\r\n".encode() in server.requests[0]
    assert b"Accept: text/plain\r\n" in server.requests[0]


async def test_a_chunked_body_is_joined_and_a_status_is_reported(gets: KeptAliveGets) -> None:
    chunked = (
        b"HTTP/1.1 503 Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    async with RawServer(lambda _n: chunked) as server:
        answer = await gets.get(server.address, "/", accept="*/*", max_bytes=100)
    assert (answer.status, answer.body) == (503, b"hello world")


async def test_a_body_that_ends_when_the_server_closes_is_read_whole(gets: KeptAliveGets) -> None:
    async with RawServer(lambda _n: b"HTTP/1.0 200 OK\r\n\r\nold style") as server:
        answer = await gets.get(server.address, "/", accept="*/*", max_bytes=100)
        assert answer.body == b"old style"
        again = await gets.get(server.address, "/", accept="*/*", max_bytes=100)
    assert again.body == b"old style" and server.connections == 2


@pytest.mark.parametrize(
    "answer",
    [
        sized(b"x" * 101),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n65\r\n" + b"x" * 101 + b"\r\n0\r\n\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_over_the_bound_is_refused_and_the_connection_dropped(
    gets: KeptAliveGets, answer: bytes
) -> None:
    async with RawServer(lambda n: answer if n == 1 else sized(b"small")) as server:
        with pytest.raises(TooLarge, match="exceeds 100"):
            await gets.get(server.address, "/", accept="*/*", max_bytes=100)
        assert (await gets.get(server.address, "/", accept="*/*", max_bytes=100)).body == b"small"
    assert server.connections == 2


async def test_a_kept_connection_the_server_closed_as_the_get_went_out_is_tried_again(
    gets: KeptAliveGets,
) -> None:
    """A keep-alive timeout crossing our interval is not the engine going away: the GET goes out
    once more, on a new connection."""
    async with RawServer(lambda n: None if n == 2 else sized(f"answer {n}".encode())) as server:
        first = await gets.get(server.address, "/", accept="*/*", max_bytes=100)
        second = await gets.get(server.address, "/", accept="*/*", max_bytes=100)
    assert (first.body, second.body) == (b"answer 1", b"answer 3")
    assert server.connections == 2


async def test_a_kept_connection_cut_midway_through_an_answer_is_not_tried_again(gets: KeptAliveGets) -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\nConnection: close\r\n\r\npart"
    async with RawServer(lambda n: cut if n == 2 else sized(b"whole")) as server:
        await gets.get(server.address, "/", accept="*/*", max_bytes=100)
        with pytest.raises(Disconnected):
            await gets.get(server.address, "/", accept="*/*", max_bytes=100)
    assert len(server.requests) == 2


async def test_a_server_hanging_up_before_answering_is_a_disconnect(gets: KeptAliveGets) -> None:
    async with RawServer(lambda _n: None) as server:
        with pytest.raises(Disconnected):
            await gets.get(server.address, "/", accept="*/*", max_bytes=100)


async def test_a_server_hanging_up_midway_is_a_disconnect(gets: KeptAliveGets) -> None:
    async with RawServer(
        lambda _n: b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\nConnection: close\r\n\r\npart"
    ) as server:
        with pytest.raises(Disconnected):
            await gets.get(server.address, "/", accept="*/*", max_bytes=100)


async def test_what_is_not_http_is_named(gets: KeptAliveGets) -> None:
    async with RawServer(lambda _n: b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as server:
        with pytest.raises(BadResponse, match=r"not an HTTP/1\.x response"):
            await gets.get(server.address, "/", accept="*/*", max_bytes=100)


async def test_nothing_listening_is_a_connect_error(gets: KeptAliveGets) -> None:
    with pytest.raises(ConnectError, match=r"cannot connect to 127\.0\.0\.1:1"):
        await gets.get(EndpointAddress("127.0.0.1:1"), "/", accept="*/*", max_bytes=100)


async def test_a_get_cut_by_a_timeout_leaves_the_next_one_working(gets: KeptAliveGets) -> None:
    """The late answer of a timed-out GET must never be read as the next GET's answer."""
    slow: asyncio.Event = asyncio.Event()

    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await slow.wait()
        writer.write(sized(b"late"))
        writer.close()

    server = await asyncio.start_server(late, "127.0.0.1", 0)
    address = EndpointAddress(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await gets.get(address, "/", accept="*/*", max_bytes=100)
        assert len(gets) == 0
    finally:
        slow.set()
        server.close()
        await server.wait_closed()
    async with RawServer(lambda _n: sized(b"fresh")) as other:
        assert (await gets.get(other.address, "/", accept="*/*", max_bytes=100)).body == b"fresh"


def test_gets_work_on_uvloop_as_serve_runs_them() -> None:
    """serve's loop is uvloop, whose transports are not asyncio's classes."""

    async def two_gets() -> tuple[list[bytes], int]:
        client = KeptAliveGets()
        try:
            async with RawServer(lambda n: sized(f"uv {n}".encode())) as server:
                bodies = [
                    (await client.get(server.address, "/", accept="*/*", max_bytes=10)).body for _ in range(2)
                ]
            return bodies, server.connections
        finally:
            client.close()

    assert uvloop.run(two_gets()) == ([b"uv 1", b"uv 2"], 1)
