"""Building and reading Envoy ext_proc messages; the only module that knows their field layout.

Everything here is pure: protobuf in, protobuf out, so the stream logic above it stays readable
and the wire details are tested once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from google.protobuf import struct_pb2

from extproc.errors import Overloaded, RequestError
from extproc.openai import error_body
from extproc.pb.envoy.config.core.v3 import base_pb2 as core
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.pb.envoy.type.v3 import http_status_pb2 as http_status
from extproc.telemetry import clip

#: The endpoint picker protocol's destination header and envoy.lb metadata key.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
#: Where a gateway puts the GIE subset hint (metadata namespace / key).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: Envoy implementations cap streamed body chunks near 64 KiB; stay under it.
STREAM_CHUNK_BYTES = 62_000

_OVERWRITE = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """Headers as a dict with lower-case keys; Envoy sends ``raw_value``, others ``value``."""
    result: dict[str, str] = {}
    for header in headers.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        result[header.key.lower()] = value
    return result


def request_id(headers: dict[str, str]) -> str:
    """The client's ``x-request-id``, made safe for logs and answers (escaped, bounded)."""
    return clip(headers.get("x-request-id", ""), 128)


#: ``response_attributes`` the shipped configs ask for on the routing filter's response headers.
UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"
CODE_DETAILS_ATTRIBUTE = "response.code_details"
ATTEMPTS_ATTRIBUTE = "upstream.request_attempt_count"
#: Envoy's response code details when it could not open a connection to the upstream (refused,
#: unreachable, or timed out connecting). A reset after connecting is not among them: the engine was
#: there, and may have been killed or merely closed one connection.
_CONNECT_FAILURES = ("remote_connection_failure", "{connection_failure", "connection_timeout")


@dataclass(frozen=True, slots=True)
class UpstreamReport:
    """What Envoy says about the upstream side of a response (its ``response_attributes``)."""

    #: The ``ip:port`` of the last attempt.
    address: str
    #: Envoy answered itself because it could not connect to ``address``.
    connect_failed: bool
    #: Attempts made (1 without retries; 0 when not reported).
    attempts: int


def upstream_report(request: ep.ProcessingRequest) -> UpstreamReport | None:
    """Envoy's report on the upstream, read from the response headers' attributes.

    They are keyed by filter name, whatever the filter is called. None when they are not
    configured (configs older than the shipped ones) or name no upstream.
    """
    for attributes in request.attributes.values():
        fields = attributes.fields
        address = fields.get(UPSTREAM_ADDRESS_ATTRIBUTE)
        if address is None or not address.string_value:
            continue
        details = fields.get(CODE_DETAILS_ATTRIBUTE)
        text = "" if details is None else details.string_value
        attempts = fields.get(ATTEMPTS_ATTRIBUTE)
        return UpstreamReport(
            address=address.string_value,
            connect_failed=text.startswith("upstream_reset_before_response_started")
            and any(failure in text for failure in _CONNECT_FAILURES),
            attempts=0 if attempts is None else int(attempts.number_value),
        )
    return None


def subset_hint(request: ep.ProcessingRequest) -> frozenset[str] | None:
    """The gateway's subset hint (a list or a comma string of ``ip[:port]``), or None if absent."""
    if not request.HasField("metadata_context"):
        return None
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    entries: list[str] = []
    if value.HasField("list_value"):
        entries = [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    elif value.HasField("string_value"):
        entries = value.string_value.split(",")
    return frozenset(e.strip() for e in entries if e.strip())


def _set_headers(mutation: ep.HeaderMutation, headers: Iterable[tuple[str, str]]) -> None:
    """Set (overwrite) each header in ``mutation``."""
    for key, value in headers:
        option = mutation.set_headers.add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = _OVERWRITE


def _destination_mutation(destination: str, extra: dict[str, str]) -> ep.HeaderMutation:
    mutation = ep.HeaderMutation()
    _set_headers(mutation, ((DESTINATION_HEADER, destination), *extra.items()))
    return mutation


def _lb_metadata(destination: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_NAMESPACE)[DESTINATION_HEADER] = destination
    return metadata


def routed_headers_response(destination: str, *, extra: dict[str, str]) -> ep.ProcessingResponse:
    """Answer ``request_headers`` with the destination (bodiless requests, and FULL_DUPLEX)."""
    response = ep.ProcessingResponse(dynamic_metadata=_lb_metadata(destination))
    common = response.request_headers.response
    common.header_mutation.CopyFrom(_destination_mutation(destination, extra))
    common.clear_route_cache = True
    return response


def routed_body_response(
    destination: str, *, body: bytes | None, extra: dict[str, str]
) -> ep.ProcessingResponse:
    """Answer a BUFFERED ``request_body`` with the destination and, if rewritten, the new body."""
    response = ep.ProcessingResponse(dynamic_metadata=_lb_metadata(destination))
    common = response.request_body.response
    common.header_mutation.CopyFrom(_destination_mutation(destination, extra))
    common.clear_route_cache = True
    if body is not None:
        common.body_mutation.body = body
    return response


def response_headers_response(headers: dict[str, str]) -> ep.ProcessingResponse:
    """Answer ``response_headers`` by adding ``headers`` to what the client receives."""
    response = ep.ProcessingResponse()
    _set_headers(response.response_headers.response.header_mutation, headers.items())
    return response


def acknowledge(kind: str) -> ep.ProcessingResponse:
    """An empty answer (carry on unchanged) to the message of ``kind``.

    The oneof member names of ProcessingRequest and ProcessingResponse are the same
    (``request_headers``, ``response_body``, ...), so the request's kind names the answer's field.
    """
    response = ep.ProcessingResponse()
    getattr(response, kind).SetInParent()
    return response


def streamed_body(body: bytes, *, end_of_stream: bool) -> Iterator[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: hand the (possibly rewritten) body back in chunks Envoy accepts."""
    view = memoryview(body)
    offsets = range(0, len(body), STREAM_CHUNK_BYTES) if body else range(1)
    last = offsets[-1]
    for offset in offsets:
        response = ep.ProcessingResponse()
        streamed = response.request_body.response.body_mutation.streamed_response
        streamed.body = bytes(view[offset : offset + STREAM_CHUNK_BYTES])
        streamed.end_of_stream = end_of_stream and offset == last
        yield response


def immediate_response(
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    details: str = "",
    headers: Mapping[str, str] | None = None,
) -> ep.ProcessingResponse:
    """End the request here with an HTTP answer of our own."""
    response = ep.ProcessingResponse()
    immediate = response.immediate_response
    immediate.status.code = status  # type: ignore[assignment]  # open enum: any HTTP code
    for key, value in {"content-type": content_type, **(headers or {})}.items():
        option = immediate.headers.set_headers.add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = _OVERWRITE
    immediate.body = body
    immediate.details = details
    return response


def error_response(error: RequestError) -> ep.ProcessingResponse:
    """The one mapping from our request errors to what the client sees (OpenAI error shape)."""
    body = error_body(error.message, error_type=error.error_type, code=error.code, param=error.param)
    headers = {"retry-after": str(error.retry_after)} if isinstance(error, Overloaded) else None
    return immediate_response(error.status, body, details=f"extproc_{error.code}", headers=headers)


def internal_error_response(request_id: str) -> ep.ProcessingResponse:
    message = f"internal error in the router (request id {request_id or 'unknown'})"
    body = error_body(message, error_type="internal_error", code="internal_error")
    return immediate_response(http_status.InternalServerError, body, details="extproc_internal_error")
