"""The skeleton every engine poller shares: an owned task, an HTTP session, bounded asks, quiet logs.

A poller (:mod:`~extproc.engines.scraper`, :mod:`~extproc.engines.discovery`,
:mod:`~extproc.engines.parity`) keeps its own per-endpoint state and says what one round does
(:meth:`EndpointPoller.round`) and how long to wait before the next (:meth:`EndpointPoller.delay`);
what each endpoint last answered is kept in a :class:`LastAnswer`.
This base runs the rounds in one owned task (a failing round is logged and the next one runs;
:meth:`wake` starts one early), owns or borrows the ``aiohttp`` session, asks endpoints through
:meth:`get` (concurrency-bounded, time-bounded, size-bounded, every failure turned into a message),
and rate-limits the warnings a broken endpoint would otherwise repeat every round.

Plain ``http://`` GETs go over one kept-alive connection per endpoint
(:mod:`~extproc.engines.http_get`): a fleet's scrapes are a thousand a second, and aiohttp's
per-request machinery cost more than the pages. Other schemes use the session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import aiohttp

from extproc.engines.http_get import HttpGetError, KeptAliveGets, TooLarge
from extproc.fetch import fetch_bounded
from extproc.tasks import cancel_and_wait, sleep_or_wake
from extproc.telemetry import LogLimiter
from extproc.types import EndpointAddress

log = logging.getLogger(__name__)

#: At most one warning per endpoint and kind of failure per this many seconds.
LOG_INTERVAL = 60.0
#: Asks in flight at once, so a catalog of hundreds of pods does not open hundreds of sockets.
MAX_CONCURRENCY = 64

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AskFailure:
    """Why asking an endpoint gave no usable answer."""

    message: str
    #: Nothing took the connection (refused, reset, unreachable): the engine is likely down, not slow.
    unreachable: bool = False

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True)
class LastAnswer(Generic[T]):
    """What a poller keeps of one endpoint: its latest good answer and the failure since, if any."""

    url: str
    #: The latest good answer (kept across later failures); None before the first.
    value: T | None = None
    #: ``clock()`` when ``value`` came.
    answered_at: float | None = None
    #: What went wrong since the latest good answer; None once one comes.
    error: str | None = None
    error_at: float | None = None
    asks: int = 0
    failures: int = 0

    def answered(self, value: T, now: float) -> bool:
        """Keep a good answer; True when it ends a run of failures (worth saying so in the log)."""
        recovered = self.error is not None
        self.asks += 1
        self.value, self.answered_at, self.error, self.error_at = value, now, None, None
        return recovered

    def failed(self, error: AskFailure, now: float) -> None:
        self.asks += 1
        self.failures += 1
        self.error, self.error_at = str(error), now


class EndpointPoller:
    """Subclasses implement :meth:`round` and :meth:`delay`; see the module docstring.

    ``what`` names the poller in logs and its task ("engine scrape"). ``session`` is borrowed if
    given (not closed), else one is made in :meth:`start` and closed in :meth:`close`. ``clock``
    (seconds) paces the warnings. ``timeout`` bounds each ask once it is its turn.
    """

    def __init__(
        self,
        *,
        what: str,
        timeout: float,
        clock: Callable[[], float],
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.what = what
        self.timeout = timeout
        self._clock = clock
        self.session = session
        self._own_session = session is None
        self._log_limiter: LogLimiter[EndpointAddress] = LogLimiter(clock, LOG_INTERVAL)
        self._semaphore = asyncio.Semaphore(MAX_CONCURRENCY)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.gets = KeptAliveGets()
        #: url -> (host:port, path) for plain-http URLs, None for others (asked through the session).
        self._targets: dict[str, tuple[EndpointAddress, str] | None] = {}

    # -- what a poller says -----------------------------------------------------------------------

    async def round(self) -> None:
        """One round of asking."""
        raise NotImplementedError

    def delay(self, elapsed: float) -> float:
        """Seconds to wait before the next round, given the last one took ``elapsed`` seconds."""
        raise NotImplementedError

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        self._task = asyncio.create_task(self._run(), name=self.what.replace(" ", "-"))

    def wake(self) -> None:
        """Start the next round now (e.g. the catalog changed)."""
        self._wake.set()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self.gets.close()
        if self._own_session and self.session is not None:
            await self.session.close()
            self.session = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._wake.clear()
            try:
                await self.round()
            except Exception:
                # A bug here must not stop later rounds.
                log.exception("%s round failed", self.what)
            await sleep_or_wake(self._wake, max(0.0, self.delay(loop.time() - started)))

    # -- asking one endpoint ----------------------------------------------------------------------

    async def get(
        self,
        address: EndpointAddress,
        url: str,
        *,
        accept: str,
        max_bytes: int,
        parse: Callable[[bytes], T],
        error: type[Exception],
        parse_errors: tuple[type[Exception], ...] = (),
    ) -> tuple[T, None] | tuple[None, AskFailure]:
        """GET ``url`` and ``parse`` the body: ``(parsed, None)``, or ``(None, what went wrong)``.

        ``error`` is the poller's own failure type (raised for a bad status or an oversized body, and
        maybe by ``parse``); its message is kept as is, as is that of ``parse_errors``. Nothing
        raises out of here, so one endpoint never ends a round.
        """
        assert self.session is not None, "start() first"
        try:
            async with self._semaphore:  # the timeout starts once it is our turn
                async with asyncio.timeout(self.timeout):
                    body = await self._fetch(url, accept=accept, max_bytes=max_bytes, error=error)
            return parse(body), None
        except TimeoutError:
            return None, AskFailure(f"no answer within {self.timeout:g}s")
        except TooLarge as exc:
            return None, AskFailure(str(exc))
        # ConnectionError covers http_get's ConnectError and Disconnected.
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as exc:
            return None, AskFailure(f"{type(exc).__name__}: {exc}", unreachable=True)
        except HttpGetError as exc:
            return None, AskFailure(f"{type(exc).__name__}: {exc}")
        except aiohttp.ClientError as exc:
            return None, AskFailure(f"{type(exc).__name__}: {exc}")
        except (error, *parse_errors) as exc:
            return None, AskFailure(str(exc))
        except Exception as exc:
            log.exception("%s failed endpoint=%s", self.what, address)
            return None, AskFailure(f"unexpected {type(exc).__name__}: {exc}")

    async def _fetch(self, url: str, *, accept: str, max_bytes: int, error: type[Exception]) -> bytes:
        if url in self._targets:
            target = self._targets[url]
        else:
            target = _plain_http(url)
            if len(self._targets) >= 8192:
                self._targets.clear()
            self._targets[url] = target
        if target is None:
            assert self.session is not None, "start() first"
            return await fetch_bounded(self.session, url, accept=accept, max_bytes=max_bytes, error=error)
        host_port, path = target
        answer = await self.gets.get(host_port, path, accept=accept, max_bytes=max_bytes)
        if answer.status != 200:
            raise error(f"HTTP {answer.status} from {url}")
        return answer.body

    def warn_sometimes(self, address: EndpointAddress, error: AskFailure | str) -> None:
        """Log a failure, at most once per endpoint and kind of failure per :data:`LOG_INTERVAL`."""
        text = str(error)
        if self._log_limiter.allow(address, text.split(":", 1)[0]):
            log.warning("%s failed endpoint=%s error=%s", self.what, address, text)

    def forget(self, address: EndpointAddress) -> None:
        """The endpoint left: its warning history and idle connection go with it."""
        self._log_limiter.forget(address)
        self.gets.forget(address)


def _plain_http(url: str) -> tuple[EndpointAddress, str] | None:
    """(host:port, path) of an ``http://host:port/path`` URL; None for anything else."""
    if not url.startswith("http://"):
        return None
    host_port, slash, rest = url[len("http://") :].partition("/")
    if not host_port or "@" in host_port or ":" not in host_port.rsplit("]", 1)[-1]:
        return None
    return EndpointAddress(host_port), slash + rest if slash else "/"
