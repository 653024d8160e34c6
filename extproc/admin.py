"""The admin HTTP port: Prometheus ``/metrics``, probes, and read-only JSON under ``/debug/``.

Read-only by construction (GET routes only) and bound to loopback by default. The deployment binds
it to all addresses so Prometheus can scrape ``/metrics``; the ``/debug/`` routes (every pod
address, the whole catalog) still answer loopback clients only (403 otherwise): operators use
``kubectl port-forward`` or ``kubectl exec``, the reconciler sidecar shares the pod's loopback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from extproc.addresses import parse_host_port
from extproc.errors import ConfigError

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: A started admin server; ``await runner.cleanup()`` stops it.
AdminRunner: TypeAlias = web.AppRunner


def is_loopback(remote: str | None) -> bool:
    """Whether a peer address (``request.remote``) is a loopback one; unknown peers are not."""
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def loopback_only(handler: _Handler) -> _Handler:
    """Wrap a handler so it answers 403 (a JSON error saying why) to non-loopback clients."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        if not is_loopback(request.remote):
            error = {"error": f"{request.path} answers loopback clients only (from {request.remote})"}
            return web.json_response(error, status=403, dumps=lambda v: orjson.dumps(v).decode())
        return await handler(request)

    return guarded


def admin_app(
    *,
    registry: CollectorRegistry,
    state: Callable[[], dict[str, Any]],
    ready: Callable[[], bool] | None = None,
    worker_sets: Callable[[], dict[str, Any]] | None = None,
    profiles: Callable[[], str] | None = None,
) -> web.Application:
    """The aiohttp application serving the admin routes (``/readyz``, ``/debug/worker-sets`` and
    ``/debug/profiles`` only when given)."""

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def debug_state(_: web.Request) -> web.Response:
        body = orjson.dumps(state(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        return web.Response(body=body, content_type="application/json")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/state", loopback_only(debug_state))
    app.router.add_get("/healthz", healthz)
    if ready is not None:
        is_ready = ready

        async def readyz(_: web.Request) -> web.Response:
            if is_ready():
                return web.Response(text="ready\n")
            return web.Response(status=503, text="not ready (catalog not loaded yet, or draining)\n")

        app.router.add_get("/readyz", readyz)
    if worker_sets is not None:
        sets = worker_sets

        # Compact: the reconciler sidecar polls it every few seconds.
        async def debug_worker_sets(_: web.Request) -> web.Response:
            return web.Response(body=orjson.dumps(sets()), content_type="application/json")

        app.router.add_get("/debug/worker-sets", loopback_only(debug_worker_sets))
    if profiles is not None:
        fitted = profiles

        async def debug_profiles(_: web.Request) -> web.Response:
            return web.Response(text=fitted(), content_type="application/yaml")

        app.router.add_get("/debug/profiles", loopback_only(debug_profiles))
    return app


async def start_admin(app: web.Application, listen: str) -> tuple[AdminRunner, int]:
    """Serve ``app`` on ``listen`` (the ``--admin-listen`` value); the runner and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, port = parse_host_port(listen, what="--admin-listen")
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(f"--admin-listen {listen}: {exc.strerror}") from None
    return runner, int(runner.addresses[0][1]) if runner.addresses else port
