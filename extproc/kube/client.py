"""Connecting to the Kubernetes API: which credentials (as kubectl picks them), and raw JSON requests.

The official ``kubernetes`` client loads kubeconfig files and in-cluster service-account
credentials (refreshing tokens as they rotate) and holds the connection pool; this module uses it
for exactly that. Requests go through :func:`get_stream`, which returns the undecoded response, so
objects stay plain dicts exactly as ``kubectl get -o json`` shows them (camelCase, every field the
server sent) instead of the client's generated models, and a watch can be read line by line.

The ``kube`` package is the only one that imports ``kubernetes`` (a test walks the imports).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeAlias

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from extproc.errors import ConfigError, KubeApiError

#: An error answer is read up to this many bytes for its message; the rest is dropped.
#: An authenticated connection to the API server, for the reflectors and requests of this package.
ApiClient: TypeAlias = k8s_client.ApiClient

MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True, slots=True)
class KubeSettings:
    """How to reach the API server."""

    #: A kubeconfig file. None: in-cluster credentials when ``KUBERNETES_SERVICE_HOST`` is set,
    #: else ``$KUBECONFIG`` (a ``:``-separated list, merged as kubectl merges it), else
    #: ``~/.kube/config``.
    kubeconfig: Path | None = None
    #: Seconds to wait for a TCP + TLS connection. Default 5 s.
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.connect_timeout <= 0:
            raise ConfigError(f"Kubernetes connect timeout must be positive, got {self.connect_timeout}")


@dataclass(frozen=True, slots=True)
class ConfigOrigin:
    """Where the credentials come from: the pod's service account, or kubeconfig files."""

    kind: Literal["in-cluster", "kubeconfig"]
    files: tuple[Path, ...] = ()

    def describe(self) -> str:
        if self.kind == "in-cluster":
            return "in-cluster service account"
        return "kubeconfig " + os.pathsep.join(str(f) for f in self.files)


def config_origin(kubeconfig: Path | None, environ: Mapping[str, str], home: Path) -> ConfigOrigin:
    """Pick the credentials as kubectl would, except that a pod prefers its own service account.

    Pure: the environment and home folder are arguments.
    """
    if kubeconfig is not None:
        return ConfigOrigin("kubeconfig", (kubeconfig,))
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return ConfigOrigin("in-cluster")
    listed = tuple(Path(p).expanduser() for p in environ.get("KUBECONFIG", "").split(os.pathsep) if p)
    return ConfigOrigin("kubeconfig", listed or (home / ".kube" / "config",))


def api_client(settings: KubeSettings, *, environ: Mapping[str, str] | None = None) -> k8s_client.ApiClient:
    """An ApiClient with the chosen credentials; raises ConfigError naming where they came from.

    Reads files: call it at startup or from a worker thread. The caller closes the client.
    """
    origin = config_origin(settings.kubeconfig, os.environ if environ is None else environ, Path.home())
    configuration = k8s_client.Configuration()
    try:
        if origin.kind == "in-cluster":
            k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            missing = [f for f in origin.files if not f.is_file()]
            if len(missing) == len(origin.files):
                raise ConfigError(f"{origin.describe()}: not found (use --kubeconfig, or run in a pod)")
            files = os.pathsep.join(str(f) for f in origin.files if f not in missing)
            # persist_config=False: never write refreshed tokens back into the user's file.
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=files, client_configuration=configuration, persist_config=False
            )
    except k8s_config.ConfigException as exc:
        raise ConfigError(f"{origin.describe()}: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{origin.describe()}: cannot load: {exc}") from exc
    return k8s_client.ApiClient(configuration)


def get_stream(
    api: k8s_client.ApiClient,
    path: str,
    query: Sequence[tuple[str, str | int | bool]],
    *,
    timeout: tuple[float, float],
) -> urllib3.BaseHTTPResponse:
    """Send ``GET path?query`` and return the open response once its status is 2xx (blocking).

    ``timeout`` is (connect, read) seconds; the read timeout bounds each wait for bytes, so a
    watch needs one longer than its ``timeoutSeconds``. Raises KubeApiError: the HTTP status and
    the server's message, or status 0 when nothing answered. The caller closes the response.
    """
    method, url, headers, _, _ = api.param_serialize(
        "GET",
        path,
        query_params=list(query),
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    try:
        # The client's own pool (TLS, proxy), but no urllib3 retries: the caller backs off itself.
        response: urllib3.BaseHTTPResponse = api.rest_client.pool_manager.request(
            method,
            url,
            headers=headers,
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
            retries=False,
            preload_content=False,
        )
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeApiError(0, f"GET {path}: no answer: {_reason(exc)}") from exc
    if 200 <= response.status < 300:
        return response
    try:
        body = response.read(MAX_ERROR_BODY)
    except (urllib3.exceptions.HTTPError, OSError):
        body = b""
    finally:
        response.close()
    raise KubeApiError(response.status, f"GET {path}: {error_message(response.status, body)}")


def error_message(status: int, body: bytes) -> str:
    """The message of a ``Status`` answer (``{"kind": "Status", "message": ...}``), else the status."""
    try:
        document: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        document = None
    message = document.get("message") if isinstance(document, dict) else None
    return f"HTTP {status}: {message}" if isinstance(message, str) and message else f"HTTP {status}"


def _reason(exc: BaseException) -> str:
    """urllib3 wraps the cause (refused, reset, timed out) several levels deep; name the innermost."""
    reason = getattr(exc, "reason", None)
    while isinstance(reason, BaseException) and getattr(reason, "reason", None) is not None:
        reason = getattr(reason, "reason", None)
    return str(reason or exc) or type(exc).__name__
