"""``serve --workers N``: N processes on one port, each a full replica, peered over loopback.

One ``serve`` is one event loop on one core. With ``--workers N`` the process started becomes a
supervisor: it starts N copies of itself (the same arguments), which share the ``--listen`` port
(``SO_REUSEPORT``: the kernel spreads incoming connections, and Envoy's connections with them) and
share their leases over loopback peer sync, so each decides with every worker's requests as load.
With ``--peer-listen HOST:PORT`` (replicas in other pods too), worker ``i`` publishes on PORT + ``i``
and follows the same N ports of every peer replica and of its own pod.
Worker ``i`` answers its admin HTTP on the admin port + ``i`` (worker 0 on the port given, for
probes). The supervisor passes SIGTERM on and ends when they do; if a worker dies, it stops the
others and exits with an error, so the pod restarts whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from extproc.addresses import join_host_port, parse_host_port
from extproc.errors import ExtprocError
from extproc.settings import ServeSettings

log = logging.getLogger(__name__)
#: ``INDEX/PORT,PORT,...``: this process is worker INDEX; the ports are every worker's peer port.
WORKER_ENV = "EXTPROC_SERVE_WORKER"


def as_worker(settings: ServeSettings) -> ServeSettings:
    """``settings`` as worker INDEX of the supervisor that started us (unchanged when none did)."""
    spec = os.environ.get(WORKER_ENV)
    if not spec:
        return settings
    index_text, _, ports_text = spec.partition("/")
    index, ports = int(index_text), [int(p) for p in ports_text.split(",")]
    host, port = parse_host_port(settings.admin_listen, what="--admin-listen")
    admin = join_host_port(host, port + index)
    worker = dataclasses.replace(
        settings, workers=1, reuse_port=True, admin_listen=admin if port else settings.admin_listen
    )
    if settings.peer_listen is not None:
        # Peered with replicas in other pods too: worker i publishes on the --peer-listen port + i,
        # and follows every port of every replica, its own pod's included (extproc.peers.discovery).
        return dataclasses.replace(worker, peer_worker=index, peer_fanout=settings.workers)
    return dataclasses.replace(
        worker,
        peer_listen=f"127.0.0.1:{ports[index]}",
        peers=tuple(f"127.0.0.1:{p}" for i, p in enumerate(ports) if i != index),
    )


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


async def run_workers(settings: ServeSettings, argv: Sequence[str], stop: asyncio.Event) -> None:
    """Start ``settings.workers`` workers with ``argv``; pass ``stop`` on; end when they all have."""
    ports = ",".join(map(str, _free_ports(settings.workers)))
    children = []
    for index in range(settings.workers):
        env = {**os.environ, WORKER_ENV: f"{index}/{ports}"}
        children.append(await asyncio.create_subprocess_exec(sys.executable, "-m", "extproc", *argv, env=env))
    log.info("serve workers=%d pids=%s", settings.workers, ",".join(str(c.pid) for c in children))
    waits = [asyncio.ensure_future(c.wait()) for c in children]
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([stopping, *waits], return_when=asyncio.FIRST_COMPLETED)
        died = [c for c, w in zip(children, waits, strict=True) if w in done]
    finally:
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        await asyncio.gather(*waits)
        stopping.cancel()
    if died and not stop.is_set():
        codes = ", ".join(f"pid {c.pid}: {c.returncode}" for c in died)
        raise ExtprocError(f"a serve worker exited ({codes}); the others were stopped")
