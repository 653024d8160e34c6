"""``host:port`` strings: parsed from flags and configs, and joined the way Envoy, ZMQ and URLs spell
them (an IPv6 host in brackets)."""

from __future__ import annotations

from extproc.errors import ConfigError

__all__ = ["join_host_port", "parse_host_port"]


def parse_host_port(value: str, *, what: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) and check the port's range."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"{what}: port {port_text!r} is not a number (in {value!r})") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what}: port {port} is out of range 0-65535")
    return host, port


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[fd00::5]:9003``): how Envoy, ZMQ and URLs spell it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
