"""The gRPC ``ExternalProcessor`` service: pumps Envoy's messages through a RequestStream.

The only place where a stream's lifetime is known, so the only place that releases its lease. A
stream's first message says which kind it is: routing (:mod:`.stream`) or, from a filter in
observability mode, accounting (:mod:`.accounting`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.protocol import messages
from extproc.protocol.accounting import AccountingStream, LeaseSource
from extproc.protocol.stream import Pending, RequestStream, Router, StreamOptions
from extproc.telemetry import LogLimiter, Metrics

log = logging.getLogger(__name__)
#: Seconds a stream whose exchange is over stays open for Envoy to close it. Envoy ends an ext_proc
#: stream by half-closing it and resetting it at once. A grpc.aio handler that has returned when the
#: reset lands (its status racing the reset), or that still waits for a message (grpc/grpc#43360),
#: leaves ~100-180 B of native memory behind per stream, for good; one that is neither reading nor
#: done takes the reset and leaves none (``docs/investigations/stream_ends.md``: at 100 requests/s, ~60
#: MB an hour for accounting streams and ~35 MB for routing ones). So once nothing more can come, a
#: stream stops reading and waits this long, then ends itself if Envoy has not. Counts end before
#: the wait, and Envoy never waits for it. Below Envoy's default ``message_timeout`` (200 ms), in
#: case a gateway sends a message after all (response trailers: they then pass unprocessed).
CLOSE_WAIT_S = 0.1
#: Receives in flight (see :class:`Receiver`): held here, as asyncio keeps only weak references
#: to tasks and a reset stream's receive outlives its handler.
_READS: set[asyncio.Future[ep.ProcessingRequest | None]] = set()
#: Undecodable messages are logged once a minute, whoever sends them.
_MALFORMED: LogLimiter[str] = LogLimiter(time.monotonic)


class Routing(Router, LeaseSource, Protocol):
    """What both kinds of stream need from the routing side (request control)."""


class ExternalProcessorService(ep_grpc.ExternalProcessorServicer):
    """One RequestStream per ext_proc stream; a failure in one never touches another."""

    def __init__(self, router: Routing, metrics: Metrics, options: StreamOptions) -> None:
        self._router = router
        self._metrics = metrics
        self._options = options

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream: RequestStream | AccountingStream | None = None
        self._metrics.streams.inc()
        how = "closed"
        over = lingering = False
        receiver = Receiver(request_iterator)
        try:
            while (
                request := await receiver.next(shielded=stream is not None and stream.waits_for_upstream)
            ) is not None:
                if stream is None:
                    stream = self._stream_for(request)
                try:
                    responses = stream.handle(request)
                    if isinstance(responses, Pending):
                        responses = await responses.wait()
                except Exception:
                    # A bug, not a client's fault: answer 500 once, keep the server up.
                    log.exception("internal error request_id=%s", stream.request_id)
                    self._metrics.requests.labels("internal_error").inc()
                    yield messages.internal_error_response(stream.request_id)
                    return
                over = _exchange_over(stream, responses)
                # Hold no body while Envoy's next message is awaited: after a decision that is the
                # engine's first token, and every request piling up behind a slow engine would
                # keep its request and its streamed body copy alive until then.
                while responses:
                    yield responses.pop(0)
                del request
                if over:
                    break
            if stream is not None and (over or isinstance(stream, AccountingStream)):
                # Nothing more can come (for an accounting stream: its half-close, the response's
                # end): release the count now, then wait for Envoy's close reading nothing.
                stream.close()
                lingering = True
                await asyncio.sleep(CLOSE_WAIT_S)
        except DecodeError:
            # Not a ProcessingRequest at all (raised by the iterator): Envoy never sends one, so
            # whoever did gets a gRPC error naming the problem, counted, logged once a minute.
            self._metrics.requests.labels("malformed_message").inc()
            if _MALFORMED.allow("", "decode"):
                log.warning("ext_proc message not decodable; stream ended with INVALID_ARGUMENT")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "not an envoy.service.ext_proc.v3.ProcessingRequest"
            )
        except asyncio.CancelledError:
            # Envoy's close of an accounting stream that has its lease is its normal end (the
            # response's end; its half-close and reset come together, in either order here).
            if not (lingering or (isinstance(stream, AccountingStream) and stream.waits_for_upstream)):
                how = "cancelled"
            raise
        finally:
            self._metrics.streams_ended.labels(_kind(stream), how).inc()
            if stream is not None:
                stream.close()
            self._metrics.streams.dec()

    def _stream_for(self, first: ep.ProcessingRequest) -> RequestStream | AccountingStream:
        """A routing stream, or an accounting one when its filter runs in observability mode."""
        if first.observability_mode:
            return AccountingStream(self._router)
        return RequestStream(self._router, self._metrics, self._options)


class Receiver:
    """Envoy's messages on one stream; those that wait for the upstream received in a task of their
    own, shielded.

    When Envoy resets a stream, grpc.aio cancels the handler, and a receive cancelled with it keeps
    its operation array for good (grpc/grpc#43360: ~100 B per reset, and a reset comes with every
    request abandoned mid-answer). A receive left to finish on its own frees it
    (``bench/investigations/grpc_resets.py``). The task costs the loop ~25 µs a message, so the
    messages of the request itself, which Envoy sends at once, are received directly.
    """

    def __init__(self, messages_in: AsyncIterator[ep.ProcessingRequest]) -> None:
        self._in = aiter(messages_in)

    async def next(self, *, shielded: bool = True) -> ep.ProcessingRequest | None:
        """Envoy's next message, or None once it has half-closed the stream; ``shielded`` when it
        may take as long as the upstream does (the response's headers or end)."""
        if not shielded:
            return await anext(self._in, None)
        read = asyncio.ensure_future(anext(self._in, None))
        _READS.add(read)
        read.add_done_callback(_read_done)
        return await asyncio.shield(read)


def _read_done(read: asyncio.Future[ep.ProcessingRequest | None]) -> None:
    """A receive that ends after its handler did (the stream was reset) is awaited by nobody: its
    outcome is taken here so that asyncio does not log it as never retrieved."""
    _READS.discard(read)
    if not read.cancelled():
        read.exception()


def _exchange_over(
    stream: RequestStream | AccountingStream, responses: Sequence[ep.ProcessingResponse]
) -> bool:
    """Envoy sends nothing more on a routing stream after these answers: its last expected message
    is answered, or it was answered for Envoy (an immediate response ends the request)."""
    if isinstance(stream, AccountingStream):
        return False
    return stream.exchange_over or any(r.HasField("immediate_response") for r in responses)


def _kind(stream: RequestStream | AccountingStream | None) -> str:
    if stream is None:
        return "none"  # no message came
    return "accounting" if isinstance(stream, AccountingStream) else "routing"
