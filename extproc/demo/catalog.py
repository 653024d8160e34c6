"""Write the objects a cluster would hold for a set of local model servers.

The demo and the end-to-end tests describe their backends with the same InferenceWorkerSet,
Service and EndpointSlice objects a user keeps in a cluster, so ``serve --source file:`` runs
exactly the code path it runs in production.

Engines that publish KV-cache events (``kv_ports``) are declared the way a cluster declares them:
the set gets ``spec.kvEvents: {port: kv, replayPort: kv-replay}`` and each endpoint's slice names
its own numbers under those port names (pods of one set may listen on different ports here,
because they all share 127.0.0.1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

#: The port names the catalog gives the KV-event PUB and replay ports (the CRD's names).
KV_PORT_NAME = "kv"
KV_REPLAY_PORT_NAME = "kv-replay"
#: vLLM's usual ports, used for the Service's (informational) port list only.
_SERVICE_KV_PORTS = {KV_PORT_NAME: 5557, KV_REPLAY_PORT_NAME: 5558}


@dataclass(frozen=True, slots=True)
class LocalWorkerSet:
    """A worker set of local endpoints (``ip:port`` strings), all serving one model."""

    name: str
    model: str
    endpoints: Sequence[str]
    aliases: Sequence[str] = ()
    #: Endpoints present but not ready (e.g. starting up); they must never be picked.
    not_ready: Sequence[str] = ()
    namespace: str = "default"
    profile: str = "demo"
    kv_block_size: int = 16
    labels: dict[str, str] = field(default_factory=dict)
    #: Endpoint address -> (KV-event PUB port, replay port or None). Non-empty: the set declares
    #: ``spec.kvEvents`` and the router subscribes to every listed endpoint. An endpoint left out
    #: has no ``kv`` port in its slice, which the catalog reports as a problem, as a cluster would.
    kv_ports: Mapping[str, tuple[int, int | None]] = field(default_factory=dict)
    #: ``spec.modelDiscovery.mode``: Static (the default here) routes ``model``; Endpoint makes the
    #: router learn the names from each endpoint's ``/v1/models``, polled every ``discovery_interval``.
    discovery_mode: Literal["Static", "Endpoint"] = "Static"
    discovery_interval: str = "30s"
    #: ``spec.models`` as name -> aliases, replacing ``model``/``aliases`` (``{}`` lists none, which
    #: with Endpoint discovery leaves the set to its endpoints). None: ``[{model, aliases}]``.
    models: Mapping[str, Sequence[str]] | None = None
    #: The engine the set declares (annotation ``kinference.buoyant.io/engine``); None: undeclared.
    engine: str | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kv_ports) - set(self.endpoints) - set(self.not_ready))
        if unknown:
            raise ValueError(f"kv_ports of worker set {self.name!r} name unknown endpoints {unknown}")

    def kv_events_spec(self) -> dict[str, str] | None:
        """``spec.kvEvents``: the replay port is named only when every endpoint has one (else the
        CRD's fallback to a port named ``kv-replay`` finds it where it exists)."""
        if not self.kv_ports:
            return None
        spec = {"port": KV_PORT_NAME}
        if all(replay is not None for _, replay in self.kv_ports.values()):
            spec["replayPort"] = KV_REPLAY_PORT_NAME
        return spec


def catalog_documents(worker_sets: Sequence[LocalWorkerSet]) -> list[dict[str, Any]]:
    """One InferenceWorkerSet + Service per set, one EndpointSlice per endpoint (ports may differ)."""
    docs: list[dict[str, Any]] = []
    for ws in worker_sets:
        meta: dict[str, Any] = {"name": ws.name, "namespace": ws.namespace}
        spec: dict[str, Any] = {
            "serviceRef": {"name": ws.name, "port": "http"},
            "profile": ws.profile,
            "kvBlockSize": ws.kv_block_size,
            "modelDiscovery": {"mode": "Static"}
            if ws.discovery_mode == "Static"
            else {"mode": "Endpoint", "interval": ws.discovery_interval},
            "models": [{"name": ws.model, "aliases": list(ws.aliases)}]
            if ws.models is None
            else [{"name": name, "aliases": list(aliases)} for name, aliases in ws.models.items()],
        }
        kv_events = ws.kv_events_spec()
        if kv_events is not None:
            spec["kvEvents"] = kv_events
        annotations = (
            {} if ws.engine is None else {"annotations": {"kinference.buoyant.io/engine": ws.engine}}
        )
        docs.append(
            {
                "apiVersion": "kinference.buoyant.io/v1alpha1",
                "kind": "InferenceWorkerSet",
                "metadata": {**meta, **annotations},
                "spec": spec,
            }
        )
        service_ports = [{"name": "http", "port": 80, "protocol": "TCP"}]
        if ws.kv_ports:
            service_ports += [
                {"name": name, "port": port, "protocol": "TCP"} for name, port in _SERVICE_KV_PORTS.items()
            ]
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta,
                "spec": {"clusterIP": "None", "ports": service_ports},
            }
        )
        endpoints = [(e, True) for e in ws.endpoints] + [(e, False) for e in ws.not_ready]
        for index, (address, ready) in enumerate(endpoints):
            ip, _, port = address.rpartition(":")
            docs.append(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": {
                        "name": f"{ws.name}-{index}",
                        "namespace": ws.namespace,
                        "labels": {"kubernetes.io/service-name": ws.name},
                    },
                    "addressType": "IPv4",
                    "ports": _slice_ports(int(port), ws.kv_ports.get(address)),
                    "endpoints": [
                        {
                            "addresses": [ip],
                            "conditions": {"ready": ready, "serving": ready, "terminating": False},
                            "targetRef": {"kind": "Pod", "name": f"{ws.name}-{index}"},
                        }
                    ],
                }
            )
    return docs


def _slice_ports(http: int, kv: tuple[int, int | None] | None) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = [{"name": "http", "port": http, "protocol": "TCP"}]
    if kv is not None:
        pub, replay = kv
        ports.append({"name": KV_PORT_NAME, "port": pub, "protocol": "TCP"})
        if replay is not None:
            ports.append({"name": KV_REPLAY_PORT_NAME, "port": replay, "protocol": "TCP"})
    return ports


def kv_ports_of(pub_endpoint: str, replay_endpoint: str | None) -> tuple[int, int | None]:
    """``(pub port, replay port)`` from ZMQ endpoints such as ``tcp://127.0.0.1:5557``."""

    def port(endpoint: str) -> int:
        return int(endpoint.rsplit(":", 1)[1])

    return port(pub_endpoint), None if not replay_endpoint else port(replay_endpoint)


@dataclass(frozen=True, slots=True)
class LocalObjective:
    """An InferenceObjective for one of the local worker sets: a priority for requests naming it."""

    name: str
    priority: int
    #: The worker set (``spec.poolRef.name``).
    pool: str
    #: The llm-d router's group, or (``legacy``) the Gateway API Inference Extension's.
    legacy: bool = False
    namespace: str = "default"

    def document(self) -> dict[str, Any]:
        group = "inference.networking.x-k8s.io" if self.legacy else "llm-d.ai"
        return {
            "apiVersion": f"{group}/v1alpha2",
            "kind": "InferenceObjective",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {"priority": self.priority, "poolRef": {"name": self.pool}},
        }


def catalog_yaml(worker_sets: Sequence[LocalWorkerSet], objectives: Sequence[LocalObjective] = ()) -> str:
    documents = [*catalog_documents(worker_sets), *(o.document() for o in objectives)]
    return yaml.safe_dump_all(documents, sort_keys=False)
