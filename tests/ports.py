"""Free loopback ports for tests that must pass a port number to a process (Envoy) up front."""

from __future__ import annotations

import socket

# Ports handed out in this test process: the kernel may return a just-closed port again, and two
# calls in one test must not yield the same port.
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (and not returned before here).

    There is an unavoidable window between closing the probe socket and the real listener binding
    it; ports come from the kernel's ephemeral range, so collisions with other processes are rare.
    """
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
