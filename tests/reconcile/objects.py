"""Kubernetes objects as the API server returns them, for the reconciler's pure tests."""

from __future__ import annotations

from typing import Any


def worker_set(
    name: str = "llama",
    *,
    namespace: str = "default",
    models: list[dict[str, Any]] | None = None,
    port: int | str = "http",
    service: str | None = None,
    kv_events: dict[str, Any] | None = None,
    mode: str = "Static",
    generation: int = 1,
    created: str = "2026-01-01T00:00:00Z",
    status: dict[str, Any] | None = None,
    metrics_port: int | str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceRef": {"name": service or name, "port": port},
        "profile": "default",
        "kvBlockSize": 16,
        "models": [{"name": name}] if models is None else models,
        "modelDiscovery": {"mode": mode, "interval": "30s"},
    }
    if kv_events is not None:
        spec["kvEvents"] = kv_events
    if metrics_port is not None:
        spec["metricsPort"] = metrics_port
    obj: dict[str, Any] = {
        "apiVersion": "kinference.buoyant.io/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "generation": generation,
            "creationTimestamp": created,
            "resourceVersion": "1",
        },
        "spec": spec,
    }
    if status is not None:
        obj["status"] = status
    return obj


def service(
    name: str = "llama", *, namespace: str = "default", ports: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "ports": [{"name": "http", "port": 80}, {"name": "kv", "port": 5557}] if ports is None else ports
        },
    }


def endpoint_slice(
    service_name: str = "llama",
    *,
    ready: int = 2,
    terminating: int = 0,
    namespace: str = "default",
    name: str | None = None,
) -> dict[str, Any]:
    """``ready`` ready pods at 10.0.0.1.., then ``terminating`` terminating ones."""
    endpoints = [{"addresses": [f"10.0.0.{i + 1}"], "conditions": {"ready": True}} for i in range(ready)] + [
        {"addresses": [f"10.0.1.{i + 1}"], "conditions": {"ready": False, "terminating": True}}
        for i in range(terminating)
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service_name}-abc",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000}, {"name": "kv", "port": 5557}],
        "endpoints": endpoints,
    }


def http_route(
    name: str, namespace: str, backend_refs: list[dict[str, Any]], *, rules: int = 1
) -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"rules": [{"backendRefs": backend_refs} for _ in range(rules)]},
    }


def set_ref(name: str, namespace: str | None = None, **extra: Any) -> dict[str, Any]:
    ref: dict[str, Any] = {"group": "kinference.buoyant.io", "kind": "InferenceWorkerSet", "name": name}
    if namespace is not None:
        ref["namespace"] = namespace
    return {**ref, **extra}
