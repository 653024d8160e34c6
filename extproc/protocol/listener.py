"""The gRPC server Envoy talks to: the ExternalProcessor service and grpc.health.v1 on one port.

The only module that builds a ``grpc.aio.Server``, so serve's composition root never imports grpc.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2_grpc

from extproc.addresses import join_host_port, parse_host_port
from extproc.errors import ConfigError
from extproc.pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.protocol.health import HealthService
from extproc.protocol.service import ExternalProcessorService, Routing
from extproc.protocol.stream import StreamOptions
from extproc.telemetry import Metrics

#: gRPC message headroom over the body limit (Envoy sends at most one body chunk per message).
_GRPC_OVERHEAD = 64 * 1024
#: The per-connection buffer limit of the shipped Envoy configs: the largest body chunk they send.
_ENVOY_CHUNK_MAX = 32 * 1024 * 1024
#: New calls that may wait for the event loop to take them (gRPC core's default: 1,000 soft, 3,000
#: hard). As many as one Envoy connection may open streams (``grpc.max_concurrent_streams``).
_MAX_PENDING_CALLS = 10_000


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
        options: StreamOptions,
        ready: Callable[[], bool],
        reuse_port: bool = False,
    ) -> ExtProcListener:
        """Listen on ``listen`` (the ``--listen`` value); ConfigError when the address is unusable."""
        # Envoy sends a body chunk as large as its buffer limit (32 MiB in the shipped configs) in one
        # message; refusing it at the gRPC layer would turn into a bare 500 instead of our 413.
        limit = max(options.max_body_bytes, _ENVOY_CHUNK_MAX) + _GRPC_OVERHEAD
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # Envoy keeps one HTTP/2 connection with many streams; let it have them.
                ("grpc.max_concurrent_streams", 10_000),
                # A second serve on the same port must fail, not silently share the traffic; the
                # workers of one serve --workers N share it on purpose (the kernel spreads connections).
                ("grpc.so_reuseport", 1 if reuse_port else 0),
                # gRPC core cancels calls the application has not picked up yet once more than
                # 1,000 wait (all of them past 3,000): a burst of 3,000 new streams lost 465 that
                # way, reset with no trace in our logs (docs/investigations/burst.md). A waiting call
                # costs a few KB; Envoy's own limits bound how many arrive.
                ("grpc.server.max_pending_requests", _MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", _MAX_PENDING_CALLS),
            ]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessorService(router, metrics, options),
            server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(HealthService(ready), server)
        host, port = parse_host_port(listen, what="--listen")
        try:
            bound = server.add_insecure_port(join_host_port(host, port))
        except RuntimeError as exc:
            raise ConfigError(f"--listen {listen}: cannot listen there ({exc})") from None
        await server.start()
        return cls(server, bound)

    async def stop(self, *, grace: float) -> None:
        """Refuse new streams, let open ones finish for ``grace`` seconds, then cut them."""
        await self._server.stop(grace=grace)
