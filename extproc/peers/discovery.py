"""Finding peers from a Service's EndpointSlices (``--peer-service NAMESPACE/NAME``).

The replicas of one Deployment sit behind a headless Service whose port named ``peer`` is their
``--peer-listen`` port. Every address the Service's EndpointSlices list (ready or not: a replica
that is starting or draining still holds leases), except this replica's own, is a peer. One watch,
of that Service's slices only (``labelSelector``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from extproc.addresses import join_host_port, parse_host_port
from extproc.kube.client import ApiClient
from extproc.kube.reflector import Reflector, ReflectorOptions
from extproc.kube.resources import ENDPOINT_SLICES

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
PEER_PORT_NAME = "peer"


class PeerFinder:
    """Calls ``on_peers`` with the peers' addresses whenever the Service's slices change them."""

    def __init__(
        self,
        api: ApiClient,
        service: str,
        own: str,
        on_peers: Callable[[tuple[str, ...]], None],
        *,
        options: ReflectorOptions | None = None,
    ) -> None:
        namespace, _, name = service.partition("/")
        self._own = bracketed(own)
        self._on_peers = on_peers
        self._wake = asyncio.Event()
        kind = dataclasses.replace(ENDPOINT_SLICES, label_selector=f"{SERVICE_NAME_LABEL}={name}")
        self.slices = Reflector(api, kind, [namespace], self._wake.set, options=options)
        self.found: tuple[str, ...] = ()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self.slices.run(), name="peer-slices")
            while True:
                await self._wake.wait()
                self._wake.clear()
                found = peer_addresses(self.slices.objects.values(), self._own)
                if found != self.found:
                    self.found = found
                    log.info("peers found in service peers=%s", ",".join(found) or "-")
                    self._on_peers(found)


def peer_addresses(slices: Iterable[Mapping[str, Any]], own: str) -> tuple[str, ...]:
    """``ip:port`` of every endpoint of ``slices`` on their port named ``peer`` (or their only port),
    sorted, without ``own``; slices that say nothing usable are skipped."""
    found: set[str] = set()
    for item in slices:
        ports = [
            p for p in item.get("ports") or [] if isinstance(p, Mapping) and isinstance(p.get("port"), int)
        ]
        named = [p["port"] for p in ports if p.get("name") == PEER_PORT_NAME]
        port = named[0] if named else (ports[0]["port"] if len(ports) == 1 else None)
        if port is None:
            continue
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("terminating") is True and conditions.get("serving") is False:
                continue
            for ip in (endpoint.get("addresses") or [])[:1]:
                address = join_host_port(ip, port)
                if address != own:
                    found.add(address)
    return tuple(sorted(found))


def worker_ports(replicas: Iterable[str], fanout: int, own: str) -> tuple[str, ...]:
    """What a worker follows: each replica's ``--peer-listen`` address ``host:port`` stands for its
    ``fanout`` workers on ``port`` .. ``port + fanout - 1``; ``own`` (this worker's) is left out.
    A wildcard host (a replica bound to every interface) is followed on loopback."""
    followed: dict[str, None] = {}
    for replica in replicas:
        host, port = parse_host_port(replica, what="peer address")
        host = _LOOPBACK.get(host, host)
        for offset in range(fanout):
            followed[join_host_port(host, port + offset)] = None
    own_host, own_port = parse_host_port(own, what="--peer-listen")
    followed.pop(join_host_port(own_host, own_port), None)
    followed.pop(join_host_port(_LOOPBACK.get(own_host, own_host), own_port), None)
    return tuple(followed)


#: Where a worker reaches a sibling bound to every interface.
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def bracketed(address: str) -> str:
    """``host:port`` with an IPv6 host in brackets (``fd00::5:9003`` -> ``[fd00::5]:9003``)."""
    return join_host_port(*parse_host_port(address, what="peer address"))
