"""Routing decisions as real Envoy times them: its ext_proc filter's own latencies, per request.

Envoy's ext_proc filter keeps, per request, how long each of its calls to the processor took
(``ExtProcLoggingInfo``), and the access log reads it with ``%FILTER_STATE(<filter>:FIELD:...)%``.
In FULL_DUPLEX_STREAMED, serve holds the request headers' answer until the body has ended and the
endpoint is picked, so the request headers' call is the routing decision as the request pays for
it: from Envoy sending the headers, through the body reaching serve, to the destination coming back.
No Python client stands between: Envoy (C++) is the processor's client, as in production.

:class:`TimedGateway` starts the shipped ``envoy/gateway.yaml`` (FULL_DUPLEX_STREAMED, one worker
thread) in front of a running serve, with a fake engine (:class:`~extproc.demo.backends.Backend`)
on each catalog endpoint and an access log of those latencies; each request carries its kind in a
header, and :meth:`TimedGateway.timings` reads them back once Envoy has stopped (its log is
flushed then).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

import aiohttp

from extproc.demo.backends import Backend
from extproc.gateway.config import EXTPROC_FILTER, HCM_FILTER, load_config, render_config, shipped_config
from extproc.gateway.process import EnvoyProcess

KIND_HEADER = "x-bench-kind"
#: One line per request: its kind, then Envoy's microseconds for the request headers' call (the
#: decision) and the response headers' call ("-" when there was none).
_FIELDS = ("request_header_latency_us", "response_header_latency_us")
LOG_FORMAT = (
    f"%REQ({KIND_HEADER})% "
    + " ".join(f"%FILTER_STATE({EXTPROC_FILTER}:FIELD:{name})%" for name in _FIELDS)
    + " %RESPONSE_CODE%\n"
)
#: Per request: loopback answers take milliseconds; this only stops a wedged request hanging the run.
_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


@dataclass(frozen=True, slots=True)
class Timing:
    """One request as Envoy logged it."""

    kind: str
    decision_us: int
    response_headers_us: int | None
    status: int


def parse_log(text: str) -> list[Timing]:
    """The access log's lines as timings; a line not in :data:`LOG_FORMAT`'s shape is an error."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4 or not parts[1].isdigit() or not parts[3].isdigit():
            raise ValueError(f"unexpected access log line {line!r} (format {LOG_FORMAT!r})")
        kind, decision, response, status = parts
        out.append(Timing(kind, int(decision), int(response) if response.isdigit() else None, int(status)))
    return out


@dataclass
class TimedGateway:
    """Envoy in front of serve's gRPC port, a fake engine on each of ``endpoints`` (``host:port``),
    timing every request's ext_proc calls; ``async with``, then :meth:`post`, then :meth:`timings`."""

    workdir: Path
    extproc_port: int
    endpoints: Sequence[str]
    listen_port: int
    admin_port: int
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    _session: aiohttp.ClientSession | None = None
    _log: Path | None = None
    #: Client-side seconds per request (through Envoy and the fake engine), by kind.
    round_trips: dict[str, list[float]] = field(default_factory=dict)

    async def __aenter__(self) -> Self:
        try:
            for endpoint in self.endpoints:
                host, port = endpoint.rsplit(":", 1)
                backend = Backend(chunks=1, chunk_delay=0)
                await backend.start(host, int(port))
                self._stack.push_async_callback(backend.stop)
            self._log = self.workdir / "envoy-access.log"
            self._log.unlink(missing_ok=True)
            await self._stack.enter_async_context(EnvoyProcess(self._config(), concurrency=1))
            # One connection: requests one after another, as the measures here send them.
            self._session = await self._stack.enter_async_context(
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=_TIMEOUT)
            )
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()

    def _config(self) -> dict[str, object]:
        assert self._log is not None
        config = render_config(
            load_config(shipped_config("gateway.yaml")),
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            extproc_address=("127.0.0.1", self.extproc_port),
            pool_endpoints=[(e.rsplit(":", 1)[0], int(e.rsplit(":", 1)[1])) for e in self.endpoints],
            body_mode="FULL_DUPLEX_STREAMED",
        )
        listener = next(x for x in config["static_resources"]["listeners"] if x["name"] == "gateway")
        hcm = next(f for f in listener["filter_chains"][0]["filters"] if f["name"] == HCM_FILTER)
        hcm["typed_config"]["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(self._log),
                    "log_format": {"text_format_source": {"inline_string": LOG_FORMAT}},
                },
            }
        ]
        return config

    async def post(self, kind: str, body: bytes) -> None:
        """POST a chat ``body`` through Envoy, labelled ``kind``; a status other than 200 raises."""
        assert self._session is not None, "use TimedGateway in async with"
        url = f"http://127.0.0.1:{self.listen_port}/v1/chat/completions"
        headers = {"content-type": "application/json", KIND_HEADER: kind}
        started = time.perf_counter()
        async with self._session.post(url, data=body, headers=headers) as response:
            data = await response.read()
            if response.status != 200:
                raise RuntimeError(f"{kind} through Envoy answered {response.status}: {data[:300]!r}")
        self.round_trips.setdefault(kind, []).append(time.perf_counter() - started)

    def timings(self) -> list[Timing]:
        """Every request Envoy logged; complete once the ``async with`` has ended (Envoy flushes its
        access log on exit)."""
        assert self._log is not None
        return parse_log(self._log.read_text()) if self._log.exists() else []
