"""The shipped Envoy configs and :mod:`extproc.gateway.config`; real Envoy validates and runs them."""

from __future__ import annotations

import copy
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ports import free_port

from extproc.gateway.config import EXTPROC_FILTER, load_config, render_config, shipped_config
from extproc.gateway.process import validate_config

CONFIGS = ["gateway.yaml", "gateway-original-dst.yaml"]
BODY_MODES = ["FULL_DUPLEX_STREAMED", "BUFFERED"]
DEST = "x-gateway-destination-endpoint"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _render(name: str, body_mode: Any = "FULL_DUPLEX_STREAMED", **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "listen_port": 18555,
        "admin_port": 18556,
        "extproc_address": ("127.0.0.1", 18557),
        "pool_endpoints": None if "original-dst" in name else [("127.0.0.1", 18558), ("127.0.0.2", 18559)],
        "body_mode": body_mode,
    }
    kwargs.update(overrides)
    return render_config(load_config(shipped_config(name)), **kwargs)


def _listener(config: dict[str, Any]) -> dict[str, Any]:
    return next(x for x in config["static_resources"]["listeners"] if x["name"] == "gateway")


def _cluster(config: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in config["static_resources"]["clusters"] if x["name"] == name)


def _http_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = _listener(config)["filter_chains"][0]["filters"][0]
    filters: list[dict[str, Any]] = hcm["typed_config"]["http_filters"]
    return filters


def _ext_proc(config: dict[str, Any]) -> dict[str, Any]:
    config_: dict[str, Any] = next(f for f in _http_filters(config) if f["name"] == EXTPROC_FILTER)[
        "typed_config"
    ]
    return config_


def _endpoints(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]


# -- shipped configs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("body_mode", BODY_MODES)
@pytest.mark.parametrize("name", CONFIGS)
async def test_shipped_config_renders_and_passes_envoy_validate(name: str, body_mode: str) -> None:
    config = _render(name, body_mode)
    await validate_config(config)

    mode = _ext_proc(config)["processing_mode"]
    assert mode["request_body_mode"] == body_mode
    assert mode["request_trailer_mode"] == ("SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP")
    assert config["admin"]["address"]["socket_address"]["port_value"] == 18556
    assert _listener(config)["address"]["socket_address"]["port_value"] == 18555
    assert _endpoints(_cluster(config, "extproc")) == [("127.0.0.1", 18557)]
    if name == "gateway.yaml":
        assert _endpoints(_cluster(config, "pool")) == [("127.0.0.1", 18558), ("127.0.0.2", 18559)]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_keep_the_documented_contract(name: str) -> None:
    """The settings the README and the server rely on, so an edit to a YAML cannot drop one silently."""
    config = load_config(shipped_config(name))
    filters = [f["name"] for f in _http_filters(config)]
    # The strip filter must run before ext_proc (required for ORIGINAL_DST, defence in depth otherwise);
    # accounting reads the request after routing set its destination.
    assert filters == [
        "envoy.filters.http.header_mutation",
        EXTPROC_FILTER,
        "extproc-accounting",
        "envoy.filters.http.router",
    ]
    strip = _http_filters(config)[0]["typed_config"]["mutations"]["request_mutations"]
    assert {"remove": DEST} in strip

    ext_proc = _ext_proc(config)
    assert ext_proc["grpc_service"] == {"envoy_grpc": {"cluster_name": "extproc"}}
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["allow_mode_override"] is False
    assert ext_proc["message_timeout"] == "5s"
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        # The routing stream ends with the response headers: a picker going away cuts no response.
        "response_trailer_mode": "SKIP",
    }
    accounting = _http_filters(config)[2]["typed_config"]
    assert accounting["grpc_service"] == ext_proc["grpc_service"]
    assert accounting["observability_mode"] is True and accounting["failure_mode_allow"] is True
    assert accounting["processing_mode"]["request_header_mode"] == "SEND"
    assert accounting["processing_mode"]["request_body_mode"] == "NONE"
    assert accounting["processing_mode"]["response_trailer_mode"] == "SEND"
    # Envoy tells the picker which endpoint it could not connect to (its own 503).
    assert ext_proc["response_attributes"] == [
        "upstream.address",
        "response.code_details",
        "upstream.request_attempt_count",
    ]
    assert ext_proc["metadata_options"] == {
        "receiving_namespaces": {"untyped": ["envoy.lb"]},
        "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
    }
    extproc = _cluster(config, "extproc")
    assert extproc["health_checks"][0]["grpc_health_check"] == {
        "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
    }
    assert "http2_protocol_options" in str(extproc["typed_extension_protocol_options"])
    assert _listener(config)["per_connection_buffer_limit_bytes"] >= 32 * 1024 * 1024

    pool = _cluster(config, "pool")
    assert pool["per_connection_buffer_limit_bytes"] >= 32 * 1024 * 1024
    route = _listener(config)["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    route_action = route["virtual_hosts"][0]["routes"][0]["route"]
    assert route_action["cluster"] == "pool"
    assert route_action["timeout"] == "300s"
    if name == "gateway.yaml":
        assert pool["type"] == "STATIC"
        policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        assert policy["name"] == "envoy.load_balancing_policies.override_host"
        assert policy["typed_config"]["override_host_sources"] == [
            {"header": DEST},
            {"metadata": {"key": "envoy.lb", "path": [{"key": DEST}]}},
        ]
        retry = route_action["retry_policy"]
        assert (retry["retry_on"], retry["num_retries"]) == ("connect-failure,refused-stream,reset", 2)
        # Retries avoid the hosts already tried (a dead engine is not picked again by round robin).
        assert [p["name"] for p in retry["retry_host_predicate"]] == [
            "envoy.retry_host_predicates.previous_hosts"
        ]
    else:
        assert pool["type"] == "ORIGINAL_DST"
        assert pool["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": DEST}


def test_original_dst_config_says_why_the_strip_filter_is_required() -> None:
    text = shipped_config("gateway-original-dst.yaml").read_text()
    assert "REQUIRED" in text
    assert "ANY host:port" in text
    assert "--max-fallbacks 0" in text


def test_render_config_does_not_touch_its_input_and_can_set_response_header_mode() -> None:
    original = load_config(shipped_config("gateway.yaml"))
    before = copy.deepcopy(original)
    out = render_config(
        original,
        listen_port=1,
        admin_port=2,
        extproc_address=("127.0.0.1", 3),
        pool_endpoints=None,
        body_mode="BUFFERED",
        response_header_mode="SKIP",
    )
    assert original == before
    assert _ext_proc(out)["processing_mode"]["response_header_mode"] == "SKIP"
    # None keeps the file's pool endpoints.
    assert _endpoints(_cluster(out, "pool")) == _endpoints(_cluster(original, "pool"))


def _drop_named(path: tuple[str, ...], name: str) -> Any:
    def edit(config: dict[str, Any]) -> None:
        node: Any = config
        for key in path:
            node = node[key]
        node[:] = [x for x in node if x.get("name") != name]

    return edit


def _drop_ext_proc(config: dict[str, Any]) -> None:
    filters = _http_filters(config)
    filters[:] = [f for f in filters if f["name"] != EXTPROC_FILTER]


def _drop_admin(config: dict[str, Any]) -> None:
    del config["admin"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        pytest.param(
            _drop_named(("static_resources", "listeners"), "gateway"),
            "listener named 'gateway'",
            id="listener",
        ),
        pytest.param(
            _drop_named(("static_resources", "clusters"), "extproc"), "cluster named 'extproc'", id="extproc"
        ),
        pytest.param(
            _drop_named(("static_resources", "clusters"), "pool"), "cluster named 'pool'", id="pool"
        ),
        pytest.param(_drop_ext_proc, "HTTP filter named 'envoy.filters.http.ext_proc'", id="filter"),
        pytest.param(_drop_admin, "admin.address.socket_address not found", id="admin"),
    ],
)
def test_render_config_names_what_is_missing(edit: Any, message: str) -> None:
    config = load_config(shipped_config("gateway.yaml"))
    edit(config)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        render_config(
            config,
            listen_port=1,
            admin_port=2,
            extproc_address=("h", 3),
            pool_endpoints=None,
            body_mode="BUFFERED",
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"body_mode": "STREAMED"}, "body_mode must be one of FULL_DUPLEX_STREAMED, BUFFERED"),
        ({"listen_port": 0}, "listen_port must be an integer in 1-65535"),
        ({"admin_port": 70000}, "admin_port must be an integer in 1-65535"),
        ({"extproc_address": ("127.0.0.1", -1)}, "extproc_address port"),
        ({"response_header_mode": "MAYBE"}, "response_header_mode must be"),
    ],
)
def test_render_config_rejects_bad_arguments(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _render("gateway.yaml", **overrides)


def test_render_config_refuses_endpoints_for_an_original_dst_pool() -> None:
    with pytest.raises(ValueError, match=r"ORIGINAL_DST.*pool_endpoints=None"):
        _render("gateway-original-dst.yaml", pool_endpoints=[("127.0.0.1", 8001)])


def test_load_config_rejects_a_non_mapping(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        load_config(path)


def test_shipped_config_names_a_missing_file() -> None:
    with pytest.raises(FileNotFoundError, match=r"no-such\.yaml"):
        shipped_config("no-such.yaml")


# -- the shipped configs route traffic (no ext_proc server needed) ---------------------------------------


def _fail_open(config: dict[str, Any]) -> None:
    _ext_proc(config)["failure_mode_allow"] = True


async def test_gateway_fails_closed_when_extproc_is_down(backends: Any, envoy_gateway: Any) -> None:
    pool = await backends(1)
    gw = await envoy_gateway(extproc_address=("127.0.0.1", free_port()), pool=pool)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{gw.url}/v1/chat/completions", json=CHAT) as r,
    ):
        assert r.status == 500
    assert pool[0].counters.received == 0


async def test_fail_open_does_not_work_for_bodies_in_full_duplex_mode(
    backends: Any, envoy_gateway: Any
) -> None:
    """Envoy 1.40 fact the README relies on: with FULL_DUPLEX_STREAMED, failure_mode_allow only saves
    body-less requests; a POST still gets 500 while the picker is down (BUFFERED fails open)."""
    pool = await backends(1)
    gw = await envoy_gateway(extproc_address=("127.0.0.1", free_port()), pool=pool, edit=_fail_open)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gw.url}/v1/chat/completions", json=CHAT) as r:
            assert r.status == 500
        async with session.get(f"{gw.url}/v1/models") as r:
            assert r.status == 200


async def test_gateway_strips_client_routing_header_and_falls_back_to_round_robin(
    backends: Any, envoy_gateway: Any
) -> None:
    """Fail-open with the picker down: override_host's round robin serves, never the client's pick."""
    pool = await backends(2)
    outsider = (await backends(1))[0]  # not in the pool: the client tries to steer to it
    gw = await envoy_gateway(
        extproc_address=("127.0.0.1", free_port()), pool=pool, body_mode="BUFFERED", edit=_fail_open
    )
    seen = set()
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 3_000_000}]}  # > Envoy's default 1 MiB
    async with aiohttp.ClientSession() as session:
        for body in (CHAT, CHAT, big):
            raw = json.dumps(body).encode()
            headers = {DEST: outsider.address, "content-type": "application/json"}
            url = f"{gw.url}/v1/chat/completions"
            async with session.post(url, data=io.BytesIO(raw), headers=headers) as r:
                assert r.status == 200, await r.text()
                info = (await r.json())["x_backend"]
            assert info["destination_header"] is None  # stripped before ext_proc
            assert info["body_bytes"] == len(raw)
            assert info["body_sha256"] == hashlib.sha256(raw).hexdigest()
            seen.add(info["name"])
    assert seen == {"backend-1", "backend-2"}
    assert outsider.counters.received == 0


async def test_original_dst_gateway_never_uses_a_client_sent_destination(
    backends: Any, envoy_gateway: Any
) -> None:
    """The security property: ORIGINAL_DST + fail-open + picker down must not reach the client's pick."""
    target = (await backends(1))[0]
    gw = await envoy_gateway(
        extproc_address=("127.0.0.1", free_port()),
        config="gateway-original-dst.yaml",
        body_mode="BUFFERED",  # fail-open only works for bodies in BUFFERED (see above)
        edit=_fail_open,
    )
    async with aiohttp.ClientSession() as session:
        for dest in (target.address, f"127.0.0.1:{gw.admin_port}"):
            async with session.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers={DEST: dest}) as r:
                assert r.status == 503  # no destination at all: "no healthy upstream"
                assert "x_backend" not in await r.text()
    assert target.counters.received == 0
