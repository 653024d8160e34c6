"""Accounting streams (observability mode): one in-flight count per routed request, until it ends."""

from __future__ import annotations

import pytest

from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.protocol.accounting import AccountingStream
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.profiles import DEFAULT
from extproc.types import EndpointAddress
from protocol.test_stream import Harness, body, chat, headers, set_headers


def observing(destination: str, prefill: str | None = None) -> ep.ProcessingRequest:
    """The request headers an accounting filter (observability mode, after the routing one) sends."""
    extra = {"x-gateway-destination-endpoint": destination}
    if prefill is not None:
        extra["x-extproc-prefill"] = prefill
    request = headers(extra=extra)
    request.observability_mode = True
    return request


def test_an_accounting_stream_holds_the_lease_of_the_routed_request_until_it_ends() -> None:
    """Observability-mode messages get no answer; the endpoint our header named is counted (with
    the routed request's predicted prefill) until the stream ends."""
    h = Harness()
    s = AccountingStream(h.control)
    assert s.handle(observing("127.0.0.2:8000,127.0.0.1:8000", "800,0.0500")) == []
    assert h.load.snapshot() == {"127.0.0.2:8000": 1}
    assert h.load.pending_prefill(EndpointAddress("127.0.0.2:8000")) == (800, 1)
    response = ep.ProcessingRequest()
    response.response_headers.end_of_stream = False
    response.observability_mode = True
    assert s.handle(response) == []
    s.close()
    assert h.load.snapshot() == {}


@pytest.mark.parametrize(
    ("destination", "prefill"),
    [("10.9.9.9:8000", "1,1"), ("", None), ("not an address", "x,y"), ("127.0.0.1:8000", "nan,inf")],
    ids=["unknown-endpoint", "no-header", "garbage", "odd-prefill"],
)
def test_an_accounting_stream_never_counts_what_we_did_not_route(
    destination: str, prefill: str | None
) -> None:
    """Addresses outside the catalog take no count (anyone can reach the port); odd hints count as 0."""
    h = Harness()
    s = AccountingStream(h.control)
    assert s.handle(observing(destination, prefill)) == []
    if destination == "127.0.0.1:8000":
        assert h.load.snapshot() == {"127.0.0.1:8000": 1}
        assert h.load.pending_prefill(EndpointAddress("127.0.0.1:8000"))[0] == 0
    else:
        assert h.load.snapshot() == {}
    s.close()
    assert h.load.snapshot() == {}


def test_the_routing_lease_moves_to_the_accounting_stream_and_is_counted_once() -> None:
    """On one replica the accounting stream takes over the routed request's lease (one count, not
    two); it ends with the accounting stream, not with the routing stream's early end."""
    h = Harness()
    routing = h.stream()
    routing.handle(headers())
    [answer] = routing.handle(body(chat()))
    sent = set_headers(answer.request_body.response)
    pick = sent["x-gateway-destination-endpoint"].split(",")[0]
    accounting = AccountingStream(h.control)
    request = headers(extra={k: v for k, v in sent.items() if k.startswith("x-")})
    request.observability_mode = True
    assert accounting.handle(request) == []
    assert h.load.snapshot() == {pick: 1}
    routing.close()  # the routing stream ends with the response headers
    assert h.load.snapshot() == {pick: 1}
    accounting.close()  # the response has ended
    assert h.load.snapshot() == {}


def test_an_accounting_stream_later_than_its_routing_stream_counts_the_request_as_decoding() -> None:
    """The routing stream ended (at the response headers) before its accounting stream came: the
    request still counts until the response ends, but its prefill is over and is not charged again,
    so the endpoint holding its prompt does not look busy to the conversation's next turn."""
    h = Harness()
    h.scheduler.policy = PredictedTTFT(lambda _e: DEFAULT)
    routing = h.stream()
    routing.handle(headers())
    [answer] = routing.handle(body(chat()))
    sent = set_headers(answer.request_body.response)
    pick = EndpointAddress(sent["x-gateway-destination-endpoint"].split(",")[0])
    assert int(sent["x-extproc-prefill"].split(",")[0]) > 0
    routing.close()  # no accounting stream seen yet in this process: released at once
    assert h.load.snapshot() == {}
    accounting = AccountingStream(h.control)
    request = headers(extra={k: v for k, v in sent.items() if k.startswith("x-")})
    request.observability_mode = True
    assert accounting.handle(request) == []
    assert h.load.snapshot() == {pick: 1}
    assert h.load.pending_prefill(pick) == (0, 0)
    assert h.control.handover.debug_state()["lateClaims"] == 1
    accounting.close()
    assert h.load.snapshot() == {}
