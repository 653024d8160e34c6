"""Accounting streams: an ext_proc filter in observability mode counting a request in flight.

Behind the shipped Envoy configs each request reaches the picker twice. The routing filter's
stream (:mod:`extproc.protocol.stream`) decides and ends with the response headers, so a picker going
away mid-response cuts nothing. A second filter, in ``observability_mode`` and after the routing
one, sends the request headers (with the destination and the ``x-extproc-lease`` /
``x-extproc-prefill`` headers our routing answer set) and lasts until the response has ended. Its
stream holds the request's in-flight lease for that long: the routing stream's own when it offered
it in this process, else a new one (see :mod:`extproc.control.handover`). Envoy ignores answers
in observability mode, so none are sent.
"""

from __future__ import annotations

from typing import Protocol

from extproc.control.load import Lease
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.protocol import messages
from extproc.protocol.headers import LEASE_HEADER, PREFILL_HEADER, prefill_hint


class LeaseSource(Protocol):
    """What an accounting stream needs from request control (defined here, by its consumer)."""

    def accounting_lease(
        self, destination: str, *, token: str = "", prefill_tokens: int = 0, prefill_seconds: float = 0.0
    ) -> Lease | None:
        """The request's lease, now this stream's to release (None: not an endpoint we know)."""
        ...

    def release(self, lease: Lease) -> None: ...


class AccountingStream:
    """One observability-mode stream: a lease from its request headers until it ends."""

    def __init__(self, source: LeaseSource) -> None:
        self._source = source
        self._headers: dict[str, str] = {}
        self._seen = False
        self.lease: Lease | None = None

    @property
    def request_id(self) -> str:
        return messages.request_id(self._headers)

    @property
    def waits_for_upstream(self) -> bool:
        """The request headers came: what follows is the response's end, as late as it ends."""
        return self._seen

    def handle(self, request: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """Take the lease on the first request headers; nothing is ever answered."""
        if request.WhichOneof("request") != "request_headers" or self._seen:
            return []
        self._seen = True
        self._headers = messages.header_map(request.request_headers)
        tokens, seconds = prefill_hint(self._headers.get(PREFILL_HEADER, ""))
        self.lease = self._source.accounting_lease(
            self._headers.get(messages.DESTINATION_HEADER, ""),
            token=self._headers.get(LEASE_HEADER, ""),
            prefill_tokens=tokens,
            prefill_seconds=seconds,
        )
        return []

    def close(self) -> None:
        """The response has ended (or the client went away): the request no longer counts."""
        if self.lease is not None:
            self._source.release(self.lease)
            self.lease = None
