"""``extproc demo``'s options: the worker sets it runs, its flags, and the checks before it starts."""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass
from typing import cast

from extproc.errors import ConfigError, ExtprocError
from extproc.gateway.config import BodyMode, shipped_config
from extproc.gateway.process import EnvoyError, envoy_binary
from extproc.sim.engine_core import EngineParams
from extproc.sim.settings import KVEventSettings, SimSettings

HOST = "127.0.0.1"
#: The engines' defaults model an 8B model on one H100 at real speed (time scale 1): ~6 ms per
#: decode step, so curl's 128 default tokens take ~0.8 s and a stream is visibly a stream. Only the
#: KV cache is smaller (2048 blocks = 32k tokens, a small GPU's worth) so its usage column moves
#: with a handful of requests instead of staying at 0.0%.
_ENGINE = EngineParams(num_gpu_blocks=2048)
_TIME_SCALE = 1.0


class DemoError(ExtprocError):
    """The demo could not start or check itself (exit code 1); the message says which part failed."""


@dataclass(frozen=True, slots=True)
class DemoSet:
    """One worker set the demo runs: its name, the model its engines serve, and one alias."""

    name: str
    upstream: str
    alias: str
    #: How many engines serve it (``--backends`` for the llama set).
    engines: int
    #: The shipped chat template the model's real tokenizer config would bring.
    chat_template: str = "llama3"

    def engine_settings(self) -> SimSettings:
        """One engine of this set: loopback on a free port, serving only the upstream name.

        KV events and replay on free ports make the engines publish as ``vllm serve`` with
        ``--kv-events-config`` does; prompt-token details put ``cached_tokens`` in curl's ``usage``.
        """
        return SimSettings(
            listen=f"{HOST}:0",
            model=self.upstream,
            served_model_names=(self.upstream,),
            chat_template=self.chat_template,
            engine=_ENGINE,
            time_scale=_TIME_SCALE,
            enable_prompt_tokens_details=True,
            kv_events=KVEventSettings(port=0, replay_port=0),
        )


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """Validated flags."""

    port: int
    admin_port: int
    grpc_port: int
    backends: int
    body_mode: BodyMode
    duration: float | None
    traffic: bool

    def sets(self) -> tuple[DemoSet, ...]:
        return (
            DemoSet("llama-3-8b", "meta-llama/Meta-Llama-3-8B-Instruct", "chat", self.backends, "llama3"),
            DemoSet("qwen-2-7b", "Qwen/Qwen2-7B-Instruct", "qwen", 1, "chatml"),
        )


def demo_options(args: argparse.Namespace) -> DemoOptions:
    """Flags -> options; ConfigError names the flag that is wrong."""
    ports = {"--port": args.port, "--admin-port": args.admin_port, "--grpc-port": args.grpc_port}
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise ConfigError(f"{flag} must be in 1-65535, got {port}")
    by_port: dict[int, str] = {}
    for flag, port in ports.items():
        if port in by_port:
            raise ConfigError(f"{by_port[port]} and {flag} are both {port}; they need different ports")
        by_port[port] = flag
    if not 1 <= args.backends <= 64:
        raise ConfigError(f"--backends must be in 1-64, got {args.backends}")
    if args.duration is not None and not args.duration > 0:
        raise ConfigError(f"--duration must be a positive number of seconds, got {args.duration}")
    return DemoOptions(
        port=args.port,
        admin_port=args.admin_port,
        grpc_port=args.grpc_port,
        backends=args.backends,
        body_mode=cast(BodyMode, args.body_mode),
        duration=args.duration,
        traffic=bool(args.traffic),
    )


def check_ports_free(ports: dict[str, int], host: str = HOST) -> None:
    """ConfigError naming the first taken port and its flag.

    A plain bind (SO_REUSEADDR only, as Envoy and gRPC also set it) fails if anything listens on
    the port, including sockets with SO_REUSEPORT: Envoy and gRPC set that too, so without this
    check a second demo would silently share the first one's ports and traffic.
    """
    for flag, port in ports.items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                reason = exc.strerror or str(exc)
                raise ConfigError(
                    f"port {port} on {host} is not available ({reason}); "
                    f"it is set by {flag}: pick a free one, e.g. {flag} {_suggest_port()}"
                ) from None


def _suggest_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def check_setup() -> None:
    """Missing Envoy or config files are the user's setup to fix (exit 2), not a crash."""
    try:
        envoy_binary()
    except EnvoyError as exc:
        raise ConfigError(str(exc)) from None
    try:
        shipped_config("gateway.yaml")
    except FileNotFoundError as exc:
        raise ConfigError(f"{exc} (the demo runs from a source checkout)") from None
