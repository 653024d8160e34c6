"""grpc.health.v1 as the endpoint picker protocol expects it.

``liveness`` is SERVING while the process runs; ``""``, ``readiness`` and the ExternalProcessor
service are SERVING once the catalog has loaded. Unknown names answer SERVICE_UNKNOWN (as GIE's
picker does) instead of grpcio's stock NOT_FOUND error, so probes get an answer, not a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_READY_NAMES = frozenset({"", "readiness", EXT_PROC_SERVICE})
_Status = health_pb2.HealthCheckResponse


class HealthService(health_pb2_grpc.HealthServicer):
    """Health answers computed from ``is_ready`` at call time."""

    def __init__(self, is_ready: Callable[[], bool], *, watch_interval: float = 1.0) -> None:
        self._is_ready = is_ready
        self._watch_interval = watch_interval

    def status(self, service: str) -> int:
        if service == "liveness":
            return _Status.SERVING
        if service in _READY_NAMES:
            return _Status.SERVING if self._is_ready() else _Status.NOT_SERVING
        return _Status.SERVICE_UNKNOWN

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> health_pb2.HealthCheckResponse:
        return _Status(status=self.status(request.service))

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last: int | None = None
        while True:
            current = self.status(request.service)
            if current != last:
                last = current
                yield _Status(status=current)
            await asyncio.sleep(self._watch_interval)
