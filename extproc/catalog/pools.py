"""InferencePools and their Pods as worker sets: what ``serve --pool-name`` routes.

An InferencePool (Gateway API Inference Extension, ``inference.networking.k8s.io/v1``) names its
endpoints by a label selector over Pods in its namespace and a list of target ports. Its endpoints
are the Pods that match the selector, are Ready, have an IP and are not being deleted (a Pod with
``deletionTimestamp`` set leaves even while its Ready condition still says True); each counts once
per target port (several ports are several endpoints, e.g. data-parallel ranks). Models are
discovered from each endpoint's ``/v1/models`` (the Endpoint discovery mode of worker sets).

What the pool cannot say comes from optional annotations on it, the same settings a worker set
has in its spec: :data:`METRICS_PORT`, :data:`KV_EVENTS_PORT`, :data:`KV_REPLAY_PORT`,
:data:`KV_BLOCK_SIZE` and :data:`PROFILE`. Parsing is pure and raises only
:class:`~extproc.catalog.resources.InvalidObject`, naming the object and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.addresses import join_host_port
from extproc.catalog import fields
from extproc.catalog.fields import FieldError
from extproc.catalog.model import Endpoint, WorkerSet
from extproc.catalog.resources import naming_object, object_metadata
from extproc.types import EndpointAddress, WorkerSetKey

POOL_API = "inference.networking.k8s.io/v1"
_PREFIX = "kinference.buoyant.io/"
METRICS_PORT = _PREFIX + "metrics-port"
KV_EVENTS_PORT = _PREFIX + "kv-events-port"
KV_REPLAY_PORT = _PREFIX + "kv-replay-port"
KV_BLOCK_SIZE = _PREFIX + "kv-block-size"
PROFILE = _PREFIX + "profile"
#: What a pool without the annotations gets: the built-in profile, vLLM's default block size.
DEFAULT_PROFILE, DEFAULT_BLOCK_SIZE = "default", 16
_MAX_TARGET_PORTS = 8


@dataclass(frozen=True, slots=True)
class InferencePool:
    """The ``spec`` of an InferencePool that routing needs, with our annotations, validated."""

    namespace: str
    name: str
    #: ``spec.selector.matchLabels``, sorted.
    selector: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]
    profile: str = DEFAULT_PROFILE
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    metrics_port: int | None = None
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    created: str | None = None

    @property
    def key(self) -> WorkerSetKey:
        return WorkerSetKey(f"{self.namespace}/{self.name}")

    @property
    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` query (``k=v,k2=v2``)."""
        return ",".join(f"{k}={v}" for k, v in self.selector)


@dataclass(frozen=True, slots=True)
class Pod:
    """What the pool needs of a Pod."""

    namespace: str
    name: str
    labels: tuple[tuple[str, str], ...]
    ip: str | None
    ready: bool
    #: ``metadata.deletionTimestamp`` is set: it is going away, whatever its conditions say.
    deleting: bool

    def routable(self, selector: tuple[tuple[str, str], ...]) -> bool:
        labels = dict(self.labels)
        return (
            self.ready
            and not self.deleting
            and self.ip is not None
            and all(labels.get(k) == v for k, v in selector)
        )


@naming_object("InferencePool")
def parse_pool(obj: Mapping[str, Any]) -> InferencePool:
    """Validate an InferencePool (v1) and our annotations on it."""
    namespace, name, created = object_metadata(obj)
    spec = fields.mapping(obj.get("spec"), "spec", required=True)
    selector = fields.mapping(spec.get("selector"), "spec.selector", required=True)
    if "matchExpressions" in selector:
        raise FieldError(
            "spec.selector.matchExpressions", "is not supported by InferencePool v1; use matchLabels"
        )
    labels = fields.mapping(selector.get("matchLabels"), "spec.selector.matchLabels", required=True)
    if not labels:
        raise FieldError("spec.selector.matchLabels", "must select with at least one label")
    pairs = []
    for key, value in labels.items():
        path = f"spec.selector.matchLabels[{key}]"
        fields.string(key, path, required=True, max_len=317)
        pairs.append((key, fields.string(value, path, required=True, max_len=63)))
    ports = fields.array(spec.get("targetPorts"), "spec.targetPorts", _MAX_TARGET_PORTS)
    if not ports:
        raise FieldError("spec.targetPorts", "must list at least one port")
    numbers: list[int] = []
    for i, item in enumerate(ports):
        port = fields.mapping(item, f"spec.targetPorts[{i}]", required=True)
        number = fields.integer(port.get("number"), f"spec.targetPorts[{i}].number", 1, 65535)
        if number in numbers:
            raise FieldError(f"spec.targetPorts[{i}].number", f"{number} is listed twice")
        numbers.append(number)
    meta = fields.mapping(obj.get("metadata"), "metadata")
    notes = fields.mapping(meta.get("annotations"), "metadata.annotations")
    return InferencePool(
        namespace=namespace,
        name=name,
        selector=tuple(sorted(pairs)),
        target_ports=tuple(numbers),
        profile=_note(notes, PROFILE, str) or DEFAULT_PROFILE,
        kv_block_size=_note(notes, KV_BLOCK_SIZE, int, 1, 4096) or DEFAULT_BLOCK_SIZE,
        metrics_port=_note(notes, METRICS_PORT, int, 1, 65535),
        kv_events_port=_note(notes, KV_EVENTS_PORT, int, 1, 65535),
        kv_replay_port=_note(notes, KV_REPLAY_PORT, int, 1, 65535),
        created=created,
    )


def _note(notes: Mapping[str, Any], key: str, kind: type, lo: int = 1, hi: int = 1) -> Any:
    """One annotation: a number in ``[lo, hi]`` written as a string, or a non-empty string."""
    value = notes.get(key)
    if value is None:
        return None
    where = f"metadata.annotations[{key}]"
    if kind is str:
        return fields.string(value, where, required=True, max_len=253) or None
    if not isinstance(value, str) or not value.isdigit() or not lo <= int(value) <= hi:
        raise FieldError(
            where, f"must be a whole number from {lo} to {hi} (a string), got {fields.show(value)}"
        )
    return int(value)


@naming_object("Pod")
def parse_pod(obj: Mapping[str, Any]) -> Pod:
    """Labels, the pod IP, the Ready condition and whether it is being deleted."""
    namespace, name, _ = object_metadata(obj)
    meta = fields.mapping(obj.get("metadata"), "metadata")
    labels = fields.mapping(meta.get("labels"), "metadata.labels")
    status = fields.mapping(obj.get("status"), "status")
    ip = status.get("podIP")
    ready = False
    for i, item in enumerate(fields.array(status.get("conditions"), "status.conditions", 64)):
        condition = fields.mapping(item, f"status.conditions[{i}]", required=True)
        if condition.get("type") == "Ready":
            ready = condition.get("status") == "True"
    return Pod(
        namespace=namespace,
        name=name,
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        ip=ip if isinstance(ip, str) and ip else None,
        ready=ready,
        deleting=meta.get("deletionTimestamp") is not None,
    )


def join_pool(pool: InferencePool, pods: Iterable[Pod]) -> WorkerSet:
    """The pool as a worker set: its routable pods' endpoints, one per target port; models to be
    discovered from the endpoints."""
    endpoints: dict[str, Endpoint] = {}
    terminating = 0
    for pod in pods:
        if pod.namespace != pool.namespace:
            continue
        if pod.deleting and pod.ip is not None and dict(pod.labels).items() >= dict(pool.selector).items():
            terminating += len(pool.target_ports)
        if not pod.routable(pool.selector):
            continue
        assert pod.ip is not None
        for port in pool.target_ports:
            address = join_host_port(pod.ip, port)
            endpoints[address] = Endpoint(
                EndpointAddress(address),
                pod.ip,
                port,
                pool.key,
                pod.name,
                kv_events_port=pool.kv_events_port,
                kv_replay_port=pool.kv_replay_port,
                metrics_port=pool.metrics_port or port,
            )
    return WorkerSet(
        key=pool.key,
        profile=pool.profile,
        kv_block_size=pool.kv_block_size,
        models=(),
        endpoints=tuple(endpoints[a] for a in sorted(endpoints)),
        terminating=terminating,
        problems=()
        if endpoints
        else (f"InferencePool {pool.key} has no Ready pod with an IP matching its selector",),
        created=pool.created,
        discovery_mode="Endpoint",
    )
