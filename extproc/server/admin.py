"""The admin HTTP port: Prometheus ``/metrics`` and a read-only JSON ``/debug/state``.

Read-only by construction (GET routes only) and bound to loopback by default: the state names
every pod address, which is for operators and the reconciler sidecar, not for clients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def admin_app(
    *, registry: CollectorRegistry, state: Callable[[], dict[str, Any]], ready: Callable[[], bool]
) -> web.Application:
    """The aiohttp application serving the admin routes."""

    async def metrics(_: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def debug_state(_: web.Request) -> web.Response:
        body = orjson.dumps(state(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        return web.Response(body=body, content_type="application/json")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="catalog not loaded\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/state", debug_state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
