"""The gRPC ``ExternalProcessor`` service: pumps Envoy's messages through a RequestStream.

The only place where a stream's lifetime is known, so the only place that releases its lease. A
stream's first message says which kind it is: routing (:mod:`.stream`) or, from a filter in
observability mode, accounting (:mod:`.accounting`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.server import messages
from extproc.server.accounting import AccountingStream, LeaseSource
from extproc.server.budget import BodyBudget
from extproc.server.stream import Pending, RequestStream, Router
from extproc.telemetry import LogLimiter, Metrics

log = logging.getLogger(__name__)
#: Seconds an accounting stream stays open after its client half-closed it. Envoy ends an
#: observability-mode stream by half-closing it and resetting it at once; a grpc.aio handler that
#: has already returned when the reset lands leaves ~170 B of native memory behind, one still waiting
#: (nothing pending) leaves none (``bench/results/accounting_streams.md``: at 100 requests/s, ~60 MB
#: an hour). The request's count ends at the half-close, not after this wait, and Envoy never waits
#: for it: in observability mode nothing we send is read.
ACCOUNTING_LINGER_S = 0.25
#: Undecodable messages are logged once a minute, whoever sends them.
_MALFORMED: LogLimiter[str] = LogLimiter(time.monotonic)


class Routing(Router, LeaseSource, Protocol):
    """What both kinds of stream need from the routing side (the scheduler)."""


class ExternalProcessorService(ep_grpc.ExternalProcessorServicer):
    """One RequestStream per ext_proc stream; a failure in one never touches another."""

    def __init__(
        self,
        router: Routing,
        metrics: Metrics,
        *,
        max_body_bytes: int,
        budget: BodyBudget,
        decision_headers: bool = False,
    ) -> None:
        self._router = router
        self._metrics = metrics
        self._max_body = max_body_bytes
        self._budget = budget
        self._decision_headers = decision_headers

    async def Process(
        self,
        request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[ep.ProcessingRequest, ep.ProcessingResponse],
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream: RequestStream | AccountingStream | None = None
        self._metrics.streams.inc()
        how = "closed"
        lingering = False
        try:
            async for request in request_iterator:
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
                for response in responses:
                    yield response
            if isinstance(stream, AccountingStream):
                stream.close()  # the response has ended: the request no longer counts
                lingering = True
                await asyncio.sleep(ACCOUNTING_LINGER_S)  # for Envoy's reset (see the constant)
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
            if not lingering:
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
        return RequestStream(
            self._router,
            self._metrics,
            max_body_bytes=self._max_body,
            budget=self._budget,
            decision_headers=self._decision_headers,
        )


def _kind(stream: RequestStream | AccountingStream | None) -> str:
    if stream is None:
        return "none"  # no message came
    return "accounting" if isinstance(stream, AccountingStream) else "routing"
