"""Envoy configs, pure: load the shipped ones and rewrite ports, endpoints and body mode by name.

The shipped configs (``envoy/gateway.yaml``, ``envoy/gateway-original-dst.yaml``) are what users run,
so the demo, tests and benchmarks run *those* files, only with ports/endpoints/body mode rewritten by
:func:`render_config`. Elements are found by name (listener ``gateway``, clusters ``extproc`` and
``pool``, filter ``envoy.filters.http.ext_proc``), never by position, so comments and reordering in
the YAML do not break the rewrite, and a renamed element fails loudly instead of silently running
unmodified ports. Nothing here runs Envoy: that is :mod:`extproc.gateway.process`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
HeaderSendMode = Literal["SEND", "SKIP"]

LISTENER_NAME = "gateway"
EXTPROC_CLUSTER = "extproc"
POOL_CLUSTER = "pool"
EXTPROC_FILTER = "envoy.filters.http.ext_proc"
HCM_FILTER = "envoy.filters.network.http_connection_manager"

#: The repository's ``envoy/`` directory (present in a source checkout, not in an installed wheel).
SHIPPED_CONFIG_DIR = Path(__file__).resolve().parents[2] / "envoy"

_BODY_MODES: tuple[str, ...] = ("FULL_DUPLEX_STREAMED", "BUFFERED")


def shipped_config(name: str) -> Path:
    """Path of a config shipped in ``envoy/`` (e.g. ``gateway.yaml``), or FileNotFoundError."""
    path = SHIPPED_CONFIG_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"no shipped Envoy config {name!r} in {SHIPPED_CONFIG_DIR}")
    return path


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an Envoy bootstrap YAML (or JSON) file into a dict.

    Raises ValueError when the file is not a mapping, so callers never render a half-read config.
    """
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an Envoy bootstrap must be a mapping, got {type(data).__name__}")
    return data


def render_config(
    config: Mapping[str, Any],
    *,
    listen_port: int,
    admin_port: int,
    extproc_address: tuple[str, int],
    pool_endpoints: Sequence[tuple[str, int]] | None,
    body_mode: BodyMode,
    response_header_mode: HeaderSendMode | None = None,
) -> dict[str, Any]:
    """Return a copy of ``config`` with ports, endpoints and body mode rewritten; ``config`` is untouched.

    - admin and listener ``gateway`` ports become ``admin_port`` / ``listen_port``;
    - cluster ``extproc`` gets the single endpoint ``extproc_address``;
    - cluster ``pool`` gets ``pool_endpoints`` (``None`` keeps what the file has; an ORIGINAL_DST
      pool has no endpoints, so giving it some is a ValueError);
    - the ``envoy.filters.http.ext_proc`` filter gets ``body_mode``, with request trailers ``SEND``
      for FULL_DUPLEX_STREAMED (Envoy requires it) and ``SKIP`` for BUFFERED;
    - ``response_header_mode``, when given, replaces the filter's response header mode.

    Raises ValueError naming the element that was not found or the argument that is invalid.
    """
    if body_mode not in _BODY_MODES:
        raise ValueError(f"body_mode must be one of {', '.join(_BODY_MODES)}, got {body_mode!r}")
    if response_header_mode not in (None, "SEND", "SKIP"):
        raise ValueError(f"response_header_mode must be SEND, SKIP or None, got {response_header_mode!r}")
    for what, port in (("listen_port", listen_port), ("admin_port", admin_port)):
        _check_port(what, port)
    _check_port("extproc_address port", extproc_address[1])
    for host, port in pool_endpoints or ():
        _check_port(f"pool endpoint {host}:{port} port", port)

    out: dict[str, Any] = copy.deepcopy(dict(config))

    admin_sock = _dig(out, ("admin", "address", "socket_address"), "admin.address.socket_address")
    admin_sock["port_value"] = admin_port

    listeners = _dig(out, ("static_resources", "listeners"), "static_resources.listeners")
    listener = _named(listeners, LISTENER_NAME)
    if listener is None:
        raise ValueError(f"listener named {LISTENER_NAME!r} not found in static_resources.listeners")
    _dig(listener, ("address", "socket_address"), f"listener {LISTENER_NAME!r} address.socket_address")[
        "port_value"
    ] = listen_port

    clusters = _dig(out, ("static_resources", "clusters"), "static_resources.clusters")
    extproc = _named(clusters, EXTPROC_CLUSTER)
    if extproc is None:
        raise ValueError(f"cluster named {EXTPROC_CLUSTER!r} not found in static_resources.clusters")
    extproc["load_assignment"] = _load_assignment(EXTPROC_CLUSTER, [extproc_address])

    pool = _named(clusters, POOL_CLUSTER)
    if pool is None:
        raise ValueError(f"cluster named {POOL_CLUSTER!r} not found in static_resources.clusters")
    if pool_endpoints is not None:
        if pool.get("type") == "ORIGINAL_DST":
            raise ValueError(
                f"cluster {POOL_CLUSTER!r} is ORIGINAL_DST (destinations come from the request header); "
                "pass pool_endpoints=None"
            )
        pool["load_assignment"] = _load_assignment(POOL_CLUSTER, list(pool_endpoints))

    ext_proc = _find_ext_proc_filter(listener)
    mode = ext_proc.setdefault("typed_config", {}).setdefault("processing_mode", {})
    mode["request_body_mode"] = body_mode
    mode["request_trailer_mode"] = "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
    if response_header_mode is not None:
        mode["response_header_mode"] = response_header_mode
    return out


def _check_port(what: str, port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{what} must be an integer in 1-65535, got {port!r}")


def _dig(node: Any, keys: Sequence[str], where: str) -> Any:
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"{where} not found in the Envoy config (missing key {key!r})")
        node = node[key]
    return node


def _named(items: Any, name: str) -> dict[str, Any] | None:
    if not isinstance(items, list):
        return None
    for item in items:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    return None


def _load_assignment(cluster: str, endpoints: Sequence[tuple[str, int]]) -> dict[str, Any]:
    lb_endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in endpoints
    ]
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def _find_ext_proc_filter(listener: dict[str, Any]) -> dict[str, Any]:
    for chain in listener.get("filter_chains") or []:
        for net_filter in chain.get("filters") or []:
            if net_filter.get("name") != HCM_FILTER:
                continue
            for http_filter in (net_filter.get("typed_config") or {}).get("http_filters") or []:
                if isinstance(http_filter, dict) and http_filter.get("name") == EXTPROC_FILTER:
                    return http_filter
    raise ValueError(
        f"HTTP filter named {EXTPROC_FILTER!r} not found in listener {LISTENER_NAME!r} "
        f"({HCM_FILTER} http_filters)"
    )


def admin_port_of(config: Mapping[str, Any]) -> int:
    """The admin port a config declares (ValueError if it has none)."""
    port = _dig(config, ("admin", "address", "socket_address", "port_value"), "admin port_value")
    if not isinstance(port, int):
        raise ValueError(f"admin port_value must be an integer, got {port!r}")
    return port
