"""The ext_proc conversation, message by message, against real request control, scheduler and catalog
(no sockets)."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest

from extproc.catalog.model import Catalog, Endpoint, Route, WorkerSet
from extproc.control.load import LoadView
from extproc.control.requests import RequestControl
from extproc.openai import InferenceRequest
from extproc.pb.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.protocol.budget import BodyBudget
from extproc.protocol.messages import STREAM_CHUNK_BYTES
from extproc.protocol.stream import RequestStream, StreamOptions
from extproc.scheduling.cache_then_load import CacheThenLoad
from extproc.scheduling.predictor import PredictedTTFT
from extproc.scheduling.prefix import PrefixMatch
from extproc.scheduling.profiles import DEFAULT
from extproc.scheduling.scheduler import Decision, Scheduler
from extproc.telemetry import Metrics
from extproc.types import EndpointAddress, ModelName, WorkerSetKey

BUFFERED = pm.ProcessingMode.BUFFERED
FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED


def _endpoint(n: int) -> Endpoint:
    return Endpoint(EndpointAddress(f"127.0.0.{n}:8000"), f"127.0.0.{n}", 8000, WorkerSetKey("default/llama"))


def _catalog(endpoints: tuple[Endpoint, ...] = (_endpoint(1), _endpoint(2))) -> Catalog:
    ws = WorkerSet(WorkerSetKey("default/llama"), "default", 16, (), endpoints)
    upstream = ModelName("llama-3-8b")
    return Catalog(
        worker_sets={ws.key: ws},
        routes={
            upstream: Route(upstream, upstream, (ws.key,), endpoints),
            ModelName("chat"): Route(ModelName("chat"), upstream, (ws.key,), endpoints),
        },
    )


class Harness:
    def __init__(
        self,
        catalog: Catalog | None = None,
        *,
        max_body: int = 1 << 20,
        fallbacks: int = 1,
        budget: int = 1 << 30,
    ) -> None:
        self.catalog = catalog or _catalog()
        self.load = LoadView()
        self.scheduler = Scheduler(self.load, CacheThenLoad(), max_fallbacks=fallbacks, rng=random.Random(7))
        self.control = RequestControl(catalog=lambda: self.catalog, scheduler=self.scheduler, load=self.load)
        self.metrics = Metrics()
        self.max_body = max_body
        self.budget = BodyBudget(budget)

    def stream(self) -> RequestStream:
        return RequestStream(self.control, self.metrics, StreamOptions(self.max_body, self.budget))


def headers(
    method: str = "POST",
    path: str = "/v1/chat/completions",
    *,
    eos: bool = False,
    mode: int = BUFFERED,
    extra: dict[str, str] | None = None,
    subset: list[str] | None = None,
) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    request.protocol_config.request_body_mode = mode  # type: ignore[assignment]
    for key, value in {":method": method, ":path": path, "x-request-id": "r1", **(extra or {})}.items():
        h = request.request_headers.headers.headers.add()
        h.key = key
        h.raw_value = value.encode()
    request.request_headers.end_of_stream = eos
    if subset is not None:
        ns = request.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        ns.update({"x-gateway-destination-endpoint-subset": subset})
    return request


def body(data: bytes, *, eos: bool = True) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    request.request_body.body = data
    request.request_body.end_of_stream = eos
    return request


def chat(model: str = "llama-3-8b", **extra: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in common.header_mutation.set_headers}


def destination_metadata(response: ep.ProcessingResponse) -> str:
    return (
        response.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
    )


def test_buffered_routes_in_body_answer() -> None:
    """BUFFERED: the headers are acknowledged, the body answer names the endpoint in header and metadata."""
    h = Harness()
    s = h.stream()
    [ack] = s.handle(headers())
    assert ack.WhichOneof("response") == "request_headers"
    assert not ack.request_headers.response.header_mutation.set_headers
    [answer] = s.handle(body(chat()))
    common = answer.request_body.response
    dest = set_headers(common)["x-gateway-destination-endpoint"]
    assert dest == destination_metadata(answer)
    first, fallback = dest.split(",")
    assert {first, fallback} == {"127.0.0.1:8000", "127.0.0.2:8000"}
    assert not common.HasField("body_mutation"), "no alias: the body goes through untouched"
    assert common.clear_route_cache
    assert h.load.count(EndpointAddress(first)) == 1
    s.close()
    assert h.load.total == 0


def test_buffered_alias_rewrites_model_and_content_length() -> None:
    """An alias is rewritten to the upstream name; other fields stay; Content-Length follows the new body."""
    h = Harness()
    s = h.stream()
    s.handle(headers())
    [answer] = s.handle(body(chat("chat", temperature=0.5, stream=True)))
    common = answer.request_body.response
    new_body = common.body_mutation.body
    sent = orjson.loads(new_body)
    assert sent["model"] == "llama-3-8b"
    assert sent["temperature"] == 0.5 and sent["stream"] is True
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    hdrs = set_headers(common)
    assert hdrs["content-length"] == str(len(new_body))
    assert hdrs["x-gateway-model-name"] == "llama-3-8b"


def test_full_duplex_holds_headers_then_streams_body_back() -> None:
    """FULL_DUPLEX: nothing is answered until the body ends; then headers (routed) and the body in chunks."""
    h = Harness()
    s = h.stream()
    assert s.handle(headers(mode=FULL_DUPLEX)) == []
    big = chat("chat", padding="x" * (3 * STREAM_CHUNK_BYTES))
    assert s.handle(body(big[:1000], eos=False)) == []
    out = s.handle(body(big[1000:], eos=True))
    assert out[0].WhichOneof("response") == "request_headers"
    assert "x-gateway-destination-endpoint" in set_headers(out[0].request_headers.response)
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert all(len(c.body) <= STREAM_CHUNK_BYTES for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    sent = orjson.loads(b"".join(c.body for c in chunks))
    assert sent["model"] == "llama-3-8b" and sent["padding"] == "x" * (3 * STREAM_CHUNK_BYTES)


def test_full_duplex_body_passes_byte_for_byte_without_alias() -> None:
    """Without an alias the streamed-back body is exactly what the client sent."""
    h = Harness()
    s = h.stream()
    s.handle(headers(mode=FULL_DUPLEX))
    original = b'{"model":   "llama-3-8b", "prompt": "keep   my  spacing"}'
    s.handle(body(original, eos=False))
    out = s.handle(body(b"", eos=True))
    assert b"".join(r.request_body.response.body_mutation.streamed_response.body for r in out[1:]) == original


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"{not json", 400, "invalid_request"),
        (b"[1, 2]", 400, "invalid_request"),
        (b'{"messages": []}', 400, "invalid_request"),
        (b'{"model": 7}', 400, "invalid_request"),
        (b"", 400, "invalid_request"),
        (chat("no-such-model"), 404, "model_not_found"),
    ],
    ids=["not-json", "not-object", "no-model", "model-not-string", "empty", "unknown-model"],
)
@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "full-duplex"])
def test_bad_requests_get_openai_errors(payload: bytes, status: int, code: str, mode: int) -> None:
    """Malformed or unroutable bodies are answered with an HTTP error and an OpenAI-shaped JSON body."""
    h = Harness()
    s = h.stream()
    s.handle(headers(mode=mode))
    [answer] = s.handle(body(payload))
    immediate = answer.immediate_response
    assert immediate.status.code == status
    error = orjson.loads(immediate.body)["error"]
    assert error["code"] == code and error["message"]
    assert h.load.total == 0


def test_no_ready_endpoint_is_503() -> None:
    """A known model with no ready endpoint is 503, not 404."""
    h = Harness(_catalog(endpoints=()))
    s = h.stream()
    s.handle(headers())
    [answer] = s.handle(body(chat()))
    assert answer.immediate_response.status.code == 503


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "full-duplex"])
def test_body_over_limit_is_413_before_the_end(mode: int) -> None:
    """A body over the limit is refused as soon as it crosses it; later chunks are ignored."""
    h = Harness(max_body=100)
    s = h.stream()
    s.handle(headers(mode=mode))
    [answer] = s.handle(body(b"x" * 101, eos=False))
    assert answer.immediate_response.status.code == 413
    assert s.handle(body(b"y" * 10, eos=True)) == []


def test_models_list_answered_by_router() -> None:
    """GET /v1/models lists every client-facing name, aliases included, in OpenAI's format."""
    h = Harness()
    [answer] = h.stream().handle(headers("GET", "/v1/models", eos=True))
    listing = orjson.loads(answer.immediate_response.body)
    assert answer.immediate_response.status.code == 200
    assert listing["object"] == "list"
    assert {(m["id"], m["root"]) for m in listing["data"]} == {
        ("chat", "llama-3-8b"),
        ("llama-3-8b", "llama-3-8b"),
    }


def test_single_model_lookup() -> None:
    """GET /v1/models/{name} answers one model, or 404 for an unknown one."""
    h = Harness()
    [found] = h.stream().handle(headers("GET", "/v1/models/chat", eos=True))
    assert orjson.loads(found.immediate_response.body)["id"] == "chat"
    [missing] = h.stream().handle(headers("GET", "/v1/models/nope", eos=True))
    assert missing.immediate_response.status.code == 404


def test_bodiless_request_is_routed_in_headers_phase() -> None:
    """A request without a body is decided in the headers answer, with destination header and metadata."""
    h = Harness()
    s = h.stream()
    [answer] = s.handle(headers("GET", "/health", eos=True))
    common = answer.request_headers.response
    assert set_headers(common)["x-gateway-destination-endpoint"] == destination_metadata(answer)
    assert h.load.total == 1


def test_inference_path_without_body_is_400() -> None:
    """POST /v1/chat/completions with no body cannot be routed by model: 400."""
    [answer] = Harness().stream().handle(headers(eos=True))
    assert answer.immediate_response.status.code == 400


@pytest.mark.parametrize(
    ("subset", "expected"),
    [
        (["127.0.0.2:8000"], "127.0.0.2:8000"),
        (["127.0.0.2"], "127.0.0.2:8000"),
        (["127.0.0.9:8000"], None),
        ([], None),
    ],
    ids=["ip-port", "bare-ip", "outside-pool", "empty"],
)
def test_subset_hint_narrows_the_pick(subset: list[str], expected: str | None) -> None:
    """Only endpoints in the gateway's subset hint are eligible; none eligible is 503."""
    h = Harness(fallbacks=2)
    s = h.stream()
    s.handle(headers(subset=subset))
    [answer] = s.handle(body(chat()))
    if expected is None:
        assert answer.immediate_response.status.code == 503
    else:
        assert set_headers(answer.request_body.response)["x-gateway-destination-endpoint"] == expected


def test_load_spreads_to_least_busy() -> None:
    """With one endpoint busy, new requests go to the idle one."""
    h = Harness(fallbacks=0)
    busy = h.control.acquire(EndpointAddress("127.0.0.1:8000"))
    for _ in range(3):
        s = h.stream()
        s.handle(headers())
        [answer] = s.handle(body(chat()))
        assert set_headers(answer.request_body.response)["x-gateway-destination-endpoint"] == "127.0.0.2:8000"
        s.close()
    h.control.release(busy)


def test_trailers_end_the_body() -> None:
    """A request with trailers is decided when the trailers arrive, and the trailers are acknowledged."""
    h = Harness()
    s = h.stream()
    s.handle(headers(mode=FULL_DUPLEX))
    s.handle(body(chat(), eos=False))
    trailers = ep.ProcessingRequest()
    trailers.request_trailers.SetInParent()
    out = s.handle(trailers)
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"
    assert not out[-2].request_body.response.body_mutation.streamed_response.end_of_stream


def test_bodies_held_across_streams_are_capped() -> None:
    """When streams together hold too many body bytes, the next chunk is shed with 429; bytes come back."""
    h = Harness(budget=1000)
    first, second = h.stream(), h.stream()
    first.handle(headers(mode=FULL_DUPLEX))
    second.handle(headers(mode=FULL_DUPLEX))
    assert first.handle(body(b"a" * 800, eos=False)) == []
    [shed] = second.handle(body(b"b" * 300, eos=False))
    assert shed.immediate_response.status.code == 429
    assert orjson.loads(shed.immediate_response.body)["error"]["type"] == "rate_limit_error"
    assert h.budget.held == 800
    first.close()
    assert h.budget.held == 0
    third = h.stream()
    third.handle(headers(mode=FULL_DUPLEX))
    out = third.handle(body(chat(), eos=True))
    assert out[0].WhichOneof("response") == "request_headers"
    assert h.budget.held == 0, "a decided request holds no budget"


@pytest.mark.parametrize(
    "path", ["/reset_prefix_cache", "/sleep?level=1", "/v1/chat/completions"], ids=["reset", "sleep", "chat"]
)
def test_bodiless_writes_are_refused(path: str) -> None:
    """A POST without a body is not routed to a pod: engines' admin endpoints stay out of clients' reach."""
    h = Harness()
    [answer] = h.stream().handle(headers("POST", path, eos=True))
    assert answer.immediate_response.status.code == 400
    assert h.load.total == 0


def test_model_lookup_decodes_escapes() -> None:
    """GET /v1/models/{name} finds a model whether its name is written plainly or %-escaped."""
    h = Harness()
    for path in ("/v1/models/llama-3-8b", "/v1/models/llama%2D3%2D8b"):
        [answer] = h.stream().handle(headers("GET", path, eos=True))
        assert orjson.loads(answer.immediate_response.body)["id"] == "llama-3-8b"


class _Routed:
    """A routed request that records what its stream reports."""

    def __init__(self, router: _RankedRouter, decision: Decision) -> None:
        self._router = router
        self.decision = decision
        self.token = "t"
        self.waited = 0.0

    def response_started(self) -> None:
        pass

    def stream_ended(self) -> None:
        pass

    def unreachable(self, address: EndpointAddress) -> None:
        self._router.unreachable_reports.append(address)

    def retried_away(self) -> None:
        self._router.retried_away_reports.append(self.decision.pick.address)


class _RankedRouter:
    """A router whose decision says which data-parallel rank of the pick holds the prefix."""

    def __init__(self, rank: int | None) -> None:
        self.rank = rank
        self.unreachable_reports: list[EndpointAddress] = []
        self.retried_away_reports: list[EndpointAddress] = []

    def route(
        self, request: InferenceRequest | None, subset: frozenset[str] | None = None, klass: object = None
    ) -> _Routed:
        route = _catalog().resolve("llama-3-8b")
        assert route is not None
        pick = route.endpoints[0]
        ranks = {} if self.rank is None else {pick.address: self.rank}
        return _Routed(
            self, Decision(route, (pick,), PrefixMatch("precise", {pick.address: 48}, 60, [], ranks))
        )

    def models(self) -> list[tuple[str, str]]:
        return []


@pytest.mark.parametrize(("rank", "expected"), [(1, "1"), (None, None)], ids=["ranked", "no-rank"])
def test_data_parallel_rank_header_names_the_rank_holding_the_prefix(
    rank: int | None, expected: str | None
) -> None:
    """When a DP rank of the pick holds the prefix, the request carries x-data-parallel-rank for vLLM."""
    s = RequestStream(_RankedRouter(rank), Metrics(), StreamOptions(1 << 20, BodyBudget(1 << 30)))
    s.handle(headers())
    [answer] = s.handle(body(chat("llama-3-8b")))
    assert set_headers(answer.request_body.response).get("x-data-parallel-rank") == expected


def response_headers() -> ep.ProcessingRequest:
    request = ep.ProcessingRequest()
    h = request.response_headers.headers.headers.add()
    h.key, h.raw_value = ":status", b"200"
    return request


def _envoy_answer(
    address: str, details: str, attempts: int = 1, *, filter_name: str = "envoy.filters.http.ext_proc"
) -> ep.ProcessingRequest:
    """Response headers with the ``response_attributes`` the shipped configs ask for."""
    request = response_headers()
    request.attributes[filter_name].update(
        {
            "upstream.address": address,
            "response.code_details": details,
            "upstream.request_attempt_count": attempts,
        }
    )
    return request


#: What Envoy 1.40 reported for a killed engine (bench/dead_engine.py).
REFUSED = (
    "upstream_reset_before_response_started"
    "{remote_connection_failure|delayed_connect_error:_Connection_refused}"
)
PICK, OTHER = "127.0.0.1:8000", "127.0.0.2:8000"


@pytest.mark.parametrize(
    ("answer", "unreachable", "retried_away"),
    [
        ((PICK, REFUSED), [PICK], []),
        ((PICK, "upstream_reset_before_response_started{connection_failure}"), [PICK], []),
        ((PICK, "upstream_reset_before_response_started{connection_timeout}"), [PICK], []),
        ((PICK, "via_upstream"), [], []),  # the engine answered (whatever its status)
        ((PICK, "upstream_reset_before_response_started{connection_termination}"), [], []),  # it was there
        ((PICK, "upstream_response_timeout"), [], []),
        ((OTHER, "via_upstream", 2), [], [PICK]),  # override_host: the retry went elsewhere
        ((PICK, "via_upstream", 2), [], []),  # a retry on the pick itself succeeded: it is there
        ((OTHER, REFUSED), [], []),  # not an address we named: not ours to take out of rotation
    ],
    ids=[
        "refused",
        "connection-failure",
        "connect-timeout",
        "answered",
        "reset",
        "timeout",
        "retried",
        "retried-same",
        "refused-elsewhere",
    ],
)
def test_envoys_report_on_the_pick_reaches_the_router(
    answer: tuple[Any, ...], unreachable: list[str], retried_away: list[str]
) -> None:
    """Envoy's own 503 for a connection it could not open, or a retry away from the pick, tells the
    router that endpoint may be gone; the response itself goes on untouched."""
    router = _RankedRouter(None)
    metrics = Metrics()
    s = RequestStream(router, metrics, StreamOptions(1 << 20, BodyBudget(1 << 30)))
    s.handle(headers())
    s.handle(body(chat("llama-3-8b")))
    [reply] = s.handle(_envoy_answer(*answer, filter_name="my-picker"))
    assert reply.WhichOneof("response") == "response_headers"
    assert (router.unreachable_reports, router.retried_away_reports) == (unreachable, retried_away)
    for kind, reports in (("connect_failed", unreachable), ("retried_away", retried_away)):
        count = metrics.registry.get_sample_value("extproc_upstream_failures_total", {"kind": kind})
        assert count == (len(reports) or None)


def test_response_headers_without_attributes_report_nothing() -> None:
    """Configs that do not ask for the attributes (older ones) work as before."""
    router = _RankedRouter(None)
    s = RequestStream(router, Metrics(), StreamOptions(1 << 20, BodyBudget(1 << 30)))
    s.handle(headers())
    s.handle(body(chat("llama-3-8b")))
    s.handle(response_headers())
    assert router.unreachable_reports == router.retried_away_reports == []


@pytest.mark.parametrize("enabled", [True, False], ids=["opted-in", "default"])
def test_decision_headers_reach_the_client_only_when_asked(enabled: bool) -> None:
    """--decision-headers adds the pick, prefix mode and cached tokens to the response; off by default."""
    router = _RankedRouter(None)
    s = RequestStream(
        router, Metrics(), StreamOptions(1 << 20, BodyBudget(1 << 30), decision_headers=enabled)
    )
    s.handle(headers())
    s.handle(body(chat("llama-3-8b")))
    [answer] = s.handle(response_headers())
    added = set_headers(answer.response_headers.response)
    if enabled:
        assert added == {
            "x-extproc-endpoint": "127.0.0.1:8000",
            "x-extproc-prefix-mode": "precise",
            "x-extproc-cached-tokens": "48",
            "x-extproc-prompt-tokens": "60",
        }
    else:
        assert added == {}


def test_request_headers_twice_is_refused_and_leaks_no_in_flight_count() -> None:
    """A second request_headers on one stream (Envoy never sends it) is a 400, and close frees all."""
    h = Harness()
    s = h.stream()
    [first] = s.handle(headers("GET", "/metrics", eos=True))
    assert first.WhichOneof("response") == "request_headers"
    assert sum(h.load.snapshot().values()) == 1
    [second] = s.handle(headers("GET", "/metrics", eos=True))
    assert second.immediate_response.status.code == 400
    assert b"request_headers sent twice" in second.immediate_response.body
    assert sum(h.load.snapshot().values()) == 1
    s.close()
    assert h.load.snapshot() == {}


@pytest.mark.parametrize("mode", [BUFFERED, FULL_DUPLEX], ids=["buffered", "full-duplex"])
def test_alias_rewrite_of_a_deeply_nested_body_is_routed(mode: int) -> None:
    """300 nested arrays (orjson reads them, cannot write them): the alias is still rewritten, no 500."""
    raw = b'{"model": "chat", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 300
    raw += b"]" * 300 + b"}"
    h = Harness()
    s = h.stream()
    s.handle(headers(mode=mode))
    answers = s.handle(body(raw))
    assert not any(a.HasField("immediate_response") for a in answers)
    if mode == BUFFERED:
        sent = answers[0].request_body.response.body_mutation.body
    else:
        sent = b"".join(a.request_body.response.body_mutation.streamed_response.body for a in answers[1:])
    assert orjson.loads(sent)["model"] == "llama-3-8b"
    assert sent.replace(b'"llama-3-8b"', b'"chat"') == raw


def test_client_text_in_logs_is_escaped_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """A forged x-request-id and a megabyte model name make one short log line, and a short answer."""
    h = Harness()
    s = h.stream()
    s.handle(headers(extra={"x-request-id": "r1\nts=0 level=ERROR forged"}))
    name = "m" * 1_000_000
    with caplog.at_level("INFO"):
        [answer] = s.handle(body(chat(name)))
    assert answer.immediate_response.status.code == 404
    assert len(answer.immediate_response.body) < 1000
    [line] = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert "\n" not in line and "r1\\nts=0 level=ERROR forged" in line
    assert len(line) < 600


def test_the_routing_answer_carries_the_predicted_prefill_for_the_accounting_stream() -> None:
    """With a predicting policy, the routed request's headers name its predicted prefill."""
    h = Harness()
    h.scheduler.policy = PredictedTTFT(lambda _e: DEFAULT)
    s = h.stream()
    s.handle(headers())
    [answer] = s.handle(body(chat()))
    hint = set_headers(answer.request_body.response)["x-extproc-prefill"]
    tokens, seconds = hint.split(",")
    assert int(tokens) > 0 and float(seconds) > 0


def test_without_an_accounting_stream_the_routing_stream_releases_its_lease() -> None:
    """One-filter gateways (no accounting filter): the count ends with the routing stream."""
    h = Harness()
    s = h.stream()
    s.handle(headers())
    s.handle(body(chat()))
    assert sum(h.load.snapshot().values()) == 1
    s.close()
    assert h.load.snapshot() == {}


def test_response_headers_end_the_requests_predicted_prefill() -> None:
    """Once the engine's answer begins, our accounting stops charging its endpoint for the prefill."""
    h = Harness()
    h.scheduler.policy = PredictedTTFT(lambda _e: DEFAULT)
    s = h.stream()
    s.handle(headers())
    [answer] = s.handle(body(chat()))
    pick = EndpointAddress(
        set_headers(answer.request_body.response)["x-gateway-destination-endpoint"].split(",")[0]
    )
    assert h.load.pending_prefill(pick)[0] > 0
    response = ep.ProcessingRequest()
    response.response_headers.end_of_stream = False
    s.handle(response)
    assert h.load.pending_prefill(pick) == (0, 0) and h.load.count(pick) == 1
