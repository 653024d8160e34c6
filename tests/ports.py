"""Free loopback ports for tests that must pass a port number to a process (Envoy) up front."""

from __future__ import annotations

import random
import socket
from pathlib import Path

# Ports handed out in this test process: two calls in one test must not yield the same port.
_handed_out: set[int] = set()
#: Where ports are picked: below the kernel's ephemeral range (see _ephemeral_start).
_LOWEST = 10_000


def _ephemeral_start() -> int:
    """The first port the kernel hands out for port-0 binds and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (and not returned before here).

    There is an unavoidable window between this probe and the real listener binding the port. The
    port is picked below the kernel's ephemeral range, so that window cannot be lost to a process
    that binds port 0 (an engine's ZMQ socket) or to an outgoing connection's local port: both take
    theirs from that range (a demo test once lost its gRPC port to a simulator's ZMQ socket).
    """
    top = _ephemeral_start()
    if top <= _LOWEST + 1000:  # an unusual range: take the kernel's pick instead
        return _kernel_port(host)
    for _ in range(100):
        port = random.randrange(_LOWEST, top)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"could not find a fresh free port in {_LOWEST}-{top - 1} in 100 tries")


def _kernel_port(host: str) -> int:
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("could not find a fresh free port in 100 tries")


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive TCP ports on ``host`` that nothing listens on right now
    (for engines that put rank r at ``base + r``); same caveat as :func:`free_port`."""
    for _ in range(100):
        base = free_port(host)
        if base + count > 65535:
            continue
        probes: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                probes.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in probes:
                sock.close()
        _handed_out.update(range(base, base + count))
        return base
    raise RuntimeError(f"could not find {count} consecutive free ports in 100 tries")
