"""The gRPC server Envoy talks to: the ExternalProcessor service and grpc.health.v1 on one port.

The only module that builds a ``grpc.aio.Server``, so serve's composition root never imports grpc.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2_grpc

from extproc.errors import ConfigError
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.server.budget import BodyBudget
from extproc.server.health import HealthService
from extproc.server.service import ExternalProcessorService, Routing
from extproc.settings import parse_host_port
from extproc.telemetry import Metrics

#: gRPC message headroom over the body limit (Envoy sends at most one body chunk per message).
_GRPC_OVERHEAD = 64 * 1024
#: The per-connection buffer limit of the shipped Envoy configs: the largest body chunk they send.
_ENVOY_CHUNK_MAX = 32 * 1024 * 1024


class ExtProcListener:
    """A started gRPC server; :attr:`port` is the bound port (useful with port 0)."""

    def __init__(self, server: grpc.aio.Server, port: int) -> None:
        self._server = server
        self.port = port

    @classmethod
    async def start(
        cls,
        *,
        listen: str,
        router: Routing,
        metrics: Metrics,
        max_body_bytes: int,
        budget: BodyBudget,
        decision_headers: bool,
        ready: Callable[[], bool],
    ) -> ExtProcListener:
        """Listen on ``listen`` (the ``--listen`` value); ConfigError when the address is unusable."""
        # Envoy sends a body chunk as large as its buffer limit (32 MiB in the shipped configs) in one
        # message; refusing it at the gRPC layer would turn into a bare 500 instead of our 413.
        limit = max(max_body_bytes, _ENVOY_CHUNK_MAX) + _GRPC_OVERHEAD
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # Envoy keeps one HTTP/2 connection with many streams; let it have them.
                ("grpc.max_concurrent_streams", 10_000),
                # A second serve on the same port must fail, not silently share the traffic.
                ("grpc.so_reuseport", 0),
            ]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessorService(
                router,
                metrics,
                max_body_bytes=max_body_bytes,
                budget=budget,
                decision_headers=decision_headers,
            ),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(HealthService(ready), server)
        host, port = parse_host_port(listen, what="--listen")
        try:
            bound = server.add_insecure_port(_join(host, port))
        except RuntimeError as exc:
            raise ConfigError(f"--listen {listen}: cannot listen there ({exc})") from None
        await server.start()
        return cls(server, bound)

    async def stop(self, *, grace: float) -> None:
        """Refuse new streams, let open ones finish for ``grace`` seconds, then cut them."""
        await self._server.stop(grace=grace)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
