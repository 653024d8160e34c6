"""HTTP/1.1 GETs to engines over kept-alive connections, at a fraction of a general client's cost.

Scraping a fleet is a thousand small GETs a second from one event loop. aiohttp spent ~150 µs of
CPU on each (URL objects, header multidicts, stream readers, timers), more than reading the page
itself; here a request is one write on an open connection and the answer is fed to httptools' C
parser (the parser uvicorn uses) as it arrives, ~30 µs in all (``bench/results/fleet.md``).

It does only what polling engines needs: GET, a status, a body bounded while it arrives (whatever
Content-Length claims), chunked or sized, and the connection kept for the next GET when the server
allows it. One idle connection is kept per endpoint; a GET finding none opens one.

Errors: :class:`ConnectError` when no connection could be made (nothing listens: the endpoint's
process is gone), :class:`Disconnected` when the server closed it before answering in full,
:class:`BadResponse` for what is not HTTP, a ``TimeoutError`` from the caller's timeout.
"""

from __future__ import annotations

import asyncio
from typing import cast

import httptools

from extproc.types import EndpointAddress


class HttpGetError(Exception):
    """A GET failed below the HTTP status: nothing answered, or not in full, or not HTTP."""


class ConnectError(HttpGetError, ConnectionError):
    """No connection could be made."""


class Disconnected(HttpGetError, ConnectionError):
    """The server closed the connection before its answer was complete."""


class BadResponse(HttpGetError):
    """The answer is not HTTP/1.x (or breaks its framing)."""


class TooLarge(HttpGetError):
    """The body passed the caller's bound."""


class Answer:
    """A complete response: status and body."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


class _Connection(asyncio.Protocol):
    """One connection; one GET on it at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._answer: asyncio.Future[Answer] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._max_bytes = 0
        self._status = 0
        #: The headers said where the body ends (Content-Length or chunked); else it ends at close.
        self._framed = False
        self.reusable = False
        self.closed = False
        #: Bytes of an answer to the current GET arrived (a disconnect after that is not a race).
        self.answered = False

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's does not subclass asyncio.Transport, so no isinstance).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._answer is None or self._answer.done():
            self.close()  # bytes nobody asked for: the connection's framing cannot be trusted
            return
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            # Our own callbacks raise only TooLarge; httptools wraps it.
            cause = exc.__context__
            self._fail(
                cause if isinstance(cause, TooLarge) else BadResponse(f"not an HTTP/1.x response: {exc}")
            )
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"not an HTTP/1.x response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self._answer is not None and not self._answer.done() and self._status and not self._framed:
            self._answer.set_result(Answer(self._status, b"".join(self._chunks)))  # HTTP/1.0: ends at close
        elif self._answer is not None and not self._answer.done():
            detail = f": {exc}" if exc else ""
            self._answer.set_exception(Disconnected(f"server closed the connection before answering{detail}"))

    # -- httptools callbacks -----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self._framed = True
            if value.strip().isdigit() and int(value) > self._max_bytes:
                raise TooLarge(f"response of {int(value)} bytes exceeds {self._max_bytes}")
        elif name == b"transfer-encoding":
            self._framed = True

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._max_bytes:
            raise TooLarge(f"response exceeds {self._max_bytes} bytes")
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self.reusable = self._parser.should_keep_alive()
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(Answer(self._status, b"".join(self._chunks)))

    # -- use -----------------------------------------------------------------------------------------

    def get(self, request: bytes, max_bytes: int) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self._answer = asyncio.get_running_loop().create_future()
        self._chunks, self._size, self._max_bytes, self._status = [], 0, max_bytes, 0
        self._framed = False
        self.reusable = self.answered = False
        self.transport.write(request)
        return self._answer

    def _fail(self, exc: Exception) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class KeptAliveGets:
    """GETs to many endpoints, one kept-alive connection per endpoint between them."""

    def __init__(self) -> None:
        self._idle: dict[EndpointAddress, _Connection] = {}
        self._requests: dict[tuple[EndpointAddress, str, str], bytes] = {}

    def __len__(self) -> int:
        """Idle connections held."""
        return len(self._idle)

    async def get(self, address: EndpointAddress, path: str, *, accept: str, max_bytes: int) -> Answer:
        """GET ``path`` from ``address`` (``host:port``); raises :class:`HttpGetError` subclasses.

        A kept connection the server closed just as the GET went out (its keep-alive timeout
        crossing our interval) is not the engine going away: the GET is sent once more on a new
        connection. Cancelling it (the caller's timeout) closes the connection: its answer may
        still come."""
        request = self._request(address, path, accept)
        connection = self._idle.pop(address, None)
        if connection is not None and not connection.closed:
            try:
                return self._done(address, connection, await connection.get(request, max_bytes))
            except Disconnected:
                if connection.answered:
                    raise
            except BaseException:
                connection.close()
                raise
        connection = await self._connect(address)
        try:
            answer = await connection.get(request, max_bytes)
        except BaseException:
            connection.close()
            raise
        return self._done(address, connection, answer)

    def _done(self, address: EndpointAddress, connection: _Connection, answer: Answer) -> Answer:
        """Keep the connection for the next GET when the server allows it."""
        if connection.reusable and address not in self._idle:
            self._idle[address] = connection
        else:
            connection.close()
        return answer

    def forget(self, address: EndpointAddress) -> None:
        """Close the idle connection to an endpoint that left."""
        connection = self._idle.pop(address, None)
        if connection is not None:
            connection.close()

    def close(self) -> None:
        for connection in self._idle.values():
            connection.close()
        self._idle.clear()

    async def _connect(self, address: EndpointAddress) -> _Connection:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            _transport, connection = await loop.create_connection(_Connection, host.strip("[]"), int(port))
        except OSError as exc:
            raise ConnectError(f"cannot connect to {address}: {exc.strerror or exc}") from exc
        return connection

    def _request(self, address: EndpointAddress, path: str, accept: str) -> bytes:
        key = (address, path, accept)
        request = self._requests.get(key)
        if request is None:
            if len(self._requests) > 4 * len(self._idle) + 4096:
                self._requests.clear()
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {address}\r\nAccept: {accept}\r\n"
                "User-Agent: extproc\r\nAccept-Encoding: identity\r\n\r\n"
            ).encode("latin-1")
            self._requests[key] = request
        return request
