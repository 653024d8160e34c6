"""Write the objects a cluster would hold for a set of local model servers.

The demo and the end-to-end tests describe their backends with the same InferenceWorkerSet,
Service and EndpointSlice objects a user keeps in a cluster, so ``serve --source file:`` runs
exactly the code path it runs in production.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml


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


def catalog_documents(worker_sets: Sequence[LocalWorkerSet]) -> list[dict[str, Any]]:
    """One InferenceWorkerSet + Service per set, one EndpointSlice per endpoint (ports may differ)."""
    docs: list[dict[str, Any]] = []
    for ws in worker_sets:
        meta = {"name": ws.name, "namespace": ws.namespace}
        docs.append(
            {
                "apiVersion": "kinference.buoyant.io/v1alpha1",
                "kind": "InferenceWorkerSet",
                "metadata": meta,
                "spec": {
                    "serviceRef": {"name": ws.name, "port": "http"},
                    "profile": ws.profile,
                    "kvBlockSize": ws.kv_block_size,
                    "modelDiscovery": {"mode": "Static"},
                    "models": [{"name": ws.model, "aliases": list(ws.aliases)}],
                },
            }
        )
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": meta,
                "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
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
                    "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
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


def catalog_yaml(worker_sets: Sequence[LocalWorkerSet]) -> str:
    return yaml.safe_dump_all(catalog_documents(worker_sets), sort_keys=False)
