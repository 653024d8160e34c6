"""One HTTP request's ext_proc conversation: a small state machine, one method per message kind.

Envoy opens one gRPC stream per HTTP request. We read the headers, collect the body, decide, and
answer in the message the body mode allows:

* bodiless request (headers carry ``end_of_stream``): decide in the headers answer;
* BUFFERED: acknowledge the headers, answer the whole body with the destination (and the
  rewritten body, if an alias was used);
* FULL_DUPLEX_STREAMED: hold the headers answer until the body ends, then send it with the
  destination, followed by the body in chunks (we own the body in this mode).

The stream asks request control (:mod:`extproc.control.requests`, behind the :class:`Router`
protocol) for a routed request and reports what Envoy tells it: the response began, the upstream
failed, the stream ended (:meth:`RequestStream.close`, which the gRPC handler calls however the
stream ends). It never holds or releases a lease itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

from extproc.control.flow import RequestClass
from extproc.errors import BadRequest, BodyTooLarge, ModelNotFound, Overloaded, RequestError
from extproc.openai import (
    INFERENCE_PATHS,
    MODELS_PATH,
    InferenceRequest,
    model_in_path,
    model_response,
    models_list,
    normalize_path,
    parse_request,
    rewrite_model,
)
from extproc.pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.protocol import messages
from extproc.protocol.budget import BodyBudget
from extproc.protocol.headers import explain, request_class, routing_headers
from extproc.scheduling.scheduler import Decision
from extproc.telemetry import LogLimiter, Metrics, clip
from extproc.types import EndpointAddress

log = logging.getLogger(__name__)

_FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
_NO_BODY = pm.ProcessingMode.NONE
#: Messages Envoy never sends are logged once a minute per kind, whoever sends them.
_UNEXPECTED: LogLimiter[str] = LogLimiter(time.monotonic)
Responses = list[ep.ProcessingResponse]


class Pending:
    """Answers that need an await first (the prompt is being tokenized off the event loop).

    :meth:`RequestStream.handle` returns one instead of a list; the gRPC handler awaits :meth:`wait`.
    """

    __slots__ = ("_after", "_answers")

    def __init__(self, answers: Coroutine[Any, Any, Responses], after: Responses | None = None) -> None:
        self._answers = answers
        self._after = after or []

    def then(self, *more: ep.ProcessingResponse) -> Pending:
        """The same answers, followed by ``more``."""
        return Pending(self._answers, [*self._after, *more])

    async def wait(self) -> Responses:
        return [*(await self._answers), *self._after]


class Routed(Protocol):
    """A routed request, as its routing stream reports on it (defined here, by its consumer)."""

    @property
    def decision(self) -> Decision: ...

    @property
    def token(self) -> str:
        """The token the accounting stream claims the request's lease with."""
        ...

    def response_started(self) -> None: ...

    def stream_ended(self) -> None: ...

    def unreachable(self, address: EndpointAddress) -> None:
        """Envoy could not connect to ``address`` (the pick or a fallback)."""

    def retried_away(self) -> None:
        """Envoy gave up on the pick and retried elsewhere."""

    @property
    def waited(self) -> float:
        """Seconds it waited for room in a saturated pool (not part of the decision's time)."""
        ...


#: A routing outcome: at once, or once the prompt is tokenized off the event loop.
Outcome: TypeAlias = Routed | Coroutine[Any, Any, Routed]


class Router(Protocol):
    """What a stream needs from the routing side (defined here, by its consumer)."""

    def route(
        self, request: InferenceRequest | None, subset: frozenset[str] | None, klass: RequestClass | None
    ) -> Outcome:
        """Decide and lease for ``request`` (None: a bodiless request); raises ``RequestError``."""
        ...

    def models(self) -> list[tuple[str, str]]:
        """Every client-facing model name with its upstream name."""
        ...


@dataclass(frozen=True, slots=True)
class StreamOptions:
    """What every routing stream of one ``serve`` is given."""

    #: Larger request bodies get 413 (``--max-body-bytes``).
    max_body_bytes: int
    #: Request-body bytes all streams may hold at once (``--max-buffered-bytes``).
    budget: BodyBudget
    #: Add headers explaining the pick to the client's response (``--decision-headers``).
    decision_headers: bool = False


class RequestStream:
    """State of one ext_proc stream."""

    def __init__(self, router: Router, metrics: Metrics, options: StreamOptions) -> None:
        self._router = router
        self._metrics = metrics
        self._max_body = options.max_body_bytes
        self._budget = options.budget
        #: Headers describing our decision, added to the client's response (opt-in), once routed.
        self._explain = options.decision_headers
        self._explanation: dict[str, str] | None = None
        self._full_duplex = False
        self._headers: dict[str, str] = {}
        self._headers_seen = False
        #: ``:path``, normalized once (see :func:`~extproc.openai.normalize_path`).
        self._path = ""
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._done = False
        #: Envoy said (in its first message) that it sends no response body: the response headers
        #: are then the last message, unless the gateway sends response trailers (ours skip them).
        self._headers_last = False
        #: The last message Envoy sends on this stream has been answered.
        self.exchange_over = False
        #: The routed request, once our answer named its destination.
        self.routed: Routed | None = None
        #: The addresses our answer named (the pick and its fallbacks): the only ones a report on
        #: this stream may mark, so whatever reaches the gRPC port cannot take others out of
        #: rotation.
        self._picked: frozenset[str] = frozenset()

    @property
    def request_id(self) -> str:
        return messages.request_id(self._headers)

    @property
    def waits_for_upstream(self) -> bool:
        """The request is answered (routed or refused): Envoy's next message comes when the
        upstream answers, and a client may abandon the request before that."""
        return self._done

    def handle(self, request: ep.ProcessingRequest) -> Responses | Pending:
        """Answer one message from Envoy; errors a client caused become HTTP answers.

        A :class:`Pending` (only for the message completing a request body) must be awaited.
        """
        kind = request.WhichOneof("request")
        try:
            if kind == "request_headers":
                return self._on_request_headers(request)
            if kind == "request_body":
                return self._on_request_body(request.request_body)
            if kind == "request_trailers":
                return self._on_request_trailers()
            if kind == "response_headers":
                self._check_upstream(request)
            return self._on_response(kind)
        except RequestError as error:
            return self._reject(error)

    def close(self) -> None:
        """The stream ended: give any buffered body bytes back, and tell request control."""
        self._drop_body()
        if self.routed is not None:
            self.routed.stream_ended()

    def _drop_body(self) -> None:
        self._budget.give(len(self._body))
        self._body = bytearray()

    # -- request path -------------------------------------------------------------------------

    def _on_request_headers(self, request: ep.ProcessingRequest) -> Responses | Pending:
        if self._headers_seen:
            # Envoy sends one request_headers per stream; a second one (anything else can reach
            # the gRPC port) must not take a second in-flight count that nothing would release.
            raise BadRequest("ext_proc protocol error: request_headers sent twice on one stream")
        self._headers_seen = True
        self._full_duplex = request.protocol_config.request_body_mode == _FULL_DUPLEX
        self._headers_last = (
            request.HasField("protocol_config") and request.protocol_config.response_body_mode == _NO_BODY
        )
        self._headers = messages.header_map(request.request_headers)
        self._path = normalize_path(self._headers.get(":path", ""))
        self._subset = messages.subset_hint(request)
        if not request.request_headers.end_of_stream:
            # A body follows. In FULL_DUPLEX the headers answer carries the decision, so it waits.
            return [] if self._full_duplex else [messages.acknowledge("request_headers")]
        return self._bodiless()

    def _bodiless(self) -> Responses | Pending:
        method, path = self._headers.get(":method", ""), self._path
        reading = method in ("GET", "HEAD")
        if reading and path == MODELS_PATH:
            return self._answer(models_list(self._router.models()))
        if reading and (name := model_in_path(path)) is not None:
            for client, upstream in self._router.models():
                if client == name:
                    return self._answer(model_response(client, upstream))
            raise ModelNotFound(f"The model '{clip(name, 256)}' does not exist.", param="model")
        if path in INFERENCE_PATHS or not reading:
            # Bodiless writes (e.g. an engine's POST /reset_prefix_cache or /sleep) are not for
            # clients to send to a pod of our choosing; only reads pass without a model.
            raise BadRequest(f"{method} {path} needs a JSON body with a 'model' field")
        started = time.perf_counter()
        return self._when_routed(self._router.route(None, self._subset, None), None, b"", started, True)

    def _on_request_body(self, body: ep.HttpBody) -> Responses | Pending:
        if self._done:
            # Envoy may still flush chunks after we decided (e.g. after an immediate response race).
            return []
        if len(self._body) + len(body.body) > self._max_body:
            self._metrics.body_bytes.observe(len(self._body) + len(body.body))
            self._drop_body()
            raise BodyTooLarge(f"request body exceeds the {self._max_body}-byte limit of this gateway")
        if not self._budget.take(len(body.body)):
            self._drop_body()
            raise Overloaded("the router is holding too many request bodies right now; retry shortly")
        self._body += body.body
        if not body.end_of_stream:
            return [] if self._full_duplex else [messages.acknowledge("request_body")]
        return self._decide_with_body(end_of_stream=True)

    def _on_request_trailers(self) -> Responses | Pending:
        if self._done:
            return [messages.acknowledge("request_trailers")]
        # Trailers end the body when the client sent them.
        decided = self._decide_with_body(end_of_stream=False)
        acknowledged = messages.acknowledge("request_trailers")
        if isinstance(decided, Pending):
            return decided.then(acknowledged)
        return [*decided, acknowledged]

    def _decide_with_body(self, *, end_of_stream: bool) -> Responses | Pending:
        started = time.perf_counter()
        body = bytes(self._body)
        self._drop_body()
        self._metrics.body_bytes.observe(len(body))
        parsed = parse_request(body, path=self._path)
        return self._when_routed(
            self._router.route(parsed, self._subset, request_class(self._headers)),
            parsed,
            body,
            started,
            end_of_stream,
        )

    def _when_routed(
        self,
        routing: Outcome,
        parsed: InferenceRequest | None,
        body: bytes,
        started: float,
        end_of_stream: bool,
    ) -> Responses | Pending:
        """The answers for a routing outcome, or a :class:`Pending` for one still to come."""
        if isinstance(routing, Coroutine):
            return Pending(self._answer_once_routed(routing, parsed, body, started, end_of_stream))
        return self._answer_routed(routing, parsed, body, started, end_of_stream)

    async def _answer_once_routed(
        self,
        routing: Coroutine[Any, Any, Routed],
        parsed: InferenceRequest | None,
        body: bytes,
        started: float,
        end_of_stream: bool,
    ) -> Responses:
        try:
            return self._answer_routed(await routing, parsed, body, started, end_of_stream)
        except RequestError as error:
            return self._reject(error)

    def _answer_routed(
        self,
        routed: Routed,
        parsed: InferenceRequest | None,
        body: bytes,
        started: float,
        end_of_stream: bool,
    ) -> Responses:
        self.routed = routed
        if parsed is None:  # bodiless: the headers answer carries the destination
            return [self._routed_answer(routed, started, phase="headers")]
        route = routed.decision.route
        rewritten: bytes | None = None
        if route is not None and route.is_alias:
            rewritten = rewrite_model(parsed, route.upstream_model, body)
            self._metrics.model_rewrites.inc()
        if not self._full_duplex:
            return [self._routed_answer(routed, started, phase="body", body=rewritten)]
        return [
            self._routed_answer(routed, started, phase="headers"),
            *messages.streamed_body(body if rewritten is None else rewritten, end_of_stream=end_of_stream),
        ]

    def _routed_answer(
        self,
        routed: Routed,
        started: float,
        *,
        phase: Literal["headers", "body"],
        body: bytes | None = None,
    ) -> ep.ProcessingResponse:
        """The answer carrying the destination, in the message kind the phase calls for."""
        self._done = True
        decision = routed.decision
        self._picked = frozenset(e.address for e in decision.endpoints)
        extra = routing_headers(decision, routed.token)
        if body is not None:
            # BUFFERED keeps Content-Length; it must describe the rewritten body.
            extra["content-length"] = str(len(body))
        destination = decision.destination
        if self._explain:
            self._explanation = explain(decision)
        if phase == "headers":
            response = messages.routed_headers_response(destination, extra=extra)
        else:
            response = messages.routed_body_response(destination, body=body, extra=extra)
        self._metrics.decision_seconds.observe(time.perf_counter() - started - routed.waited)
        self._metrics.requests.labels("routed").inc()
        if log.isEnabledFor(logging.DEBUG):  # the hot path: no escaping work unless it is logged
            log.debug(
                "routed request_id=%s model=%s destination=%s",
                self.request_id,
                decision.route.client_name if decision.route else "-",
                destination,
            )
        return response

    # -- response path ------------------------------------------------------------------------

    def _check_upstream(self, request: ep.ProcessingRequest) -> None:
        """Learn from Envoy's report on the upstream that a pick may be gone, without a scrape.

        Behind ORIGINAL_DST a refused connection ends in Envoy's own 503, and every request sent
        to a dead engine until the next scrape fails; behind override_host retries hide the
        failures but each costs a retry (bench/results/dead_engine.md).
        """
        report = messages.upstream_report(request)
        if report is None:
            return
        if report.connect_failed:
            if report.address not in self._picked:
                return
            if self.routed is not None:
                self._metrics.upstream_failures.labels("connect_failed").inc()
                self.routed.unreachable(EndpointAddress(report.address))
        elif (
            report.attempts > 1
            and self.routed is not None
            and report.address != self.routed.decision.pick.address
        ):
            # override_host: the pick failed (refused stream, reset, or a connection) and a retry
            # elsewhere (a fallback, or round robin's choice) answered.
            self._metrics.upstream_failures.labels("retried_away").inc()
            self.routed.retried_away()

    def _on_response(self, kind: str | None) -> Responses:
        if kind == "response_headers":
            self.exchange_over = self._headers_last
        if kind == "response_headers" and self.routed is not None:
            # The engine answered: its prefill is done (the count now stands for decoding).
            self.routed.response_started()
        if kind == "response_headers" and self._explanation:
            return [messages.response_headers_response(self._explanation)]
        if kind in ("response_headers", "response_body", "response_trailers"):
            return [messages.acknowledge(kind)]
        if _UNEXPECTED.allow("", str(kind)):
            log.warning("unexpected ext_proc message request_id=%s kind=%s", self.request_id, kind)
        return []

    # -- answers of our own -------------------------------------------------------------------

    def _answer(self, body: bytes) -> Responses:
        self._done = True
        self._metrics.requests.labels("answered").inc()
        return [messages.immediate_response(200, body)]

    def _reject(self, error: RequestError) -> Responses:
        self._done = True
        self._metrics.requests.labels(error.code).inc()
        log.info(
            "rejected request_id=%s status=%d code=%s reason=%s",
            self.request_id,
            error.status,
            error.code,
            clip(error.message),
        )
        return [messages.error_response(error)]
