"""The pollers' shared skeleton: rounds that survive failures, early wake-ups, classified asks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from waiting import eventually

from extproc.engines.poller import EndpointPoller
from extproc.types import EndpointAddress

A = EndpointAddress("127.0.0.1:1")


class Bad(Exception):
    pass


class Counting(EndpointPoller):
    """Rounds every hour unless woken; the first round fails."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(what="test poll", timeout=0.2, clock=lambda: clock[0])
        self.rounds = 0

    async def round(self) -> None:
        self.rounds += 1
        if self.rounds == 1:
            raise RuntimeError("a bug in round 1")

    def delay(self, elapsed: float) -> float:
        return 3600.0


@pytest.fixture
async def server() -> AsyncIterator[str]:
    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="42")

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500)

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/broken", broken)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_a_failing_round_does_not_stop_the_next_and_wake_starts_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Round 1 raises (logged once), yet a wake-up runs round 2 long before the hour is up."""
    poller = Counting([0.0])
    poller.start()
    try:
        await eventually(lambda: poller.rounds == 1, what="first round")
        poller.wake()
        await eventually(lambda: poller.rounds == 2, what="woken round")
    finally:
        await poller.close()
    assert "test poll round failed" in caplog.text
    assert poller.session is None  # the session it made is closed with it


@pytest.mark.parametrize(
    ("path", "parse_error", "expected"),
    [
        ("/ok", None, (42, None)),
        ("/broken", None, (None, "HTTP 500 from")),
        ("/slow", None, (None, "no answer within 0.2s")),
        ("/ok", Bad("not a page"), (None, "not a page")),
        ("/ok", KeyError("x"), (None, "unexpected KeyError")),
    ],
    ids=["parsed", "status", "timeout", "parse-error", "bug"],
)
async def test_asks_return_a_result_or_what_went_wrong(
    server: str, path: str, parse_error: Exception | None, expected: tuple[int | None, str | None]
) -> None:
    """Every failure becomes a message; nothing raises out of an ask."""

    def parse(body: bytes) -> int:
        if parse_error is not None:
            raise parse_error
        return int(body)

    poller = Counting([0.0])
    poller.start()
    try:
        result, error = await poller.get(
            A,
            server + path,
            accept="text/plain",
            max_bytes=100,
            parse=parse,
            error=RuntimeError,
            parse_errors=(Bad,),
        )
    finally:
        await poller.close()
    assert result == expected[0]
    assert (error is None) == (expected[1] is None)
    if expected[1] is not None:
        assert error is not None and str(error).startswith(expected[1]) and not error.unreachable


async def test_a_refused_connection_is_named() -> None:
    """Nobody listening: the client error's name and message."""
    poller = Counting([0.0])
    poller.start()
    try:
        result, error = await poller.get(
            A, "http://127.0.0.1:1/x", accept="*/*", max_bytes=10, parse=bytes, error=RuntimeError
        )
    finally:
        await poller.close()
    assert result is None and error is not None
    assert str(error).startswith("ConnectError: cannot connect to 127.0.0.1:1")
    assert error.unreachable  # nothing listens: the engine is gone, not slow


def test_warnings_are_rate_limited_per_endpoint_and_kind(caplog: pytest.LogCaptureFixture) -> None:
    """The same failure is logged once a minute per endpoint; another kind or endpoint logs at once."""
    clock = [0.0]
    poller = Counting(clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            poller.warn_sometimes(A, "ClientConnectorError: refused")
        poller.warn_sometimes(A, "HTTP 500 from x")
        poller.warn_sometimes(EndpointAddress("127.0.0.1:2"), "ClientConnectorError: refused")
        clock[0] = 61.0
        poller.warn_sometimes(A, "ClientConnectorError: refused")
    assert len(caplog.records) == 4
