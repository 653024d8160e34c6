"""Kubernetes objects as plain dicts -> small typed records, validated the way the API server would.

Both sources hand us the same shapes (a YAML file, or the Kubernetes API's JSON), so this module is
the one place that knows field names. It rejects what the CRD schema rejects, plus names a set
lists twice for different models (the schema cannot say that), and it never raises anything but
:class:`InvalidObject`, whose message names the object and the field so that a user can fix it.

The checks of single values live in :mod:`extproc.catalog.fields` and name only the field; each
public parser is wrapped so that their :class:`~extproc.catalog.fields.FieldError` becomes an
InvalidObject naming the object too (``Kind namespace/name: path: detail``).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from extproc.catalog import fields
from extproc.catalog.fields import FieldError, IntOrString
from extproc.catalog.model import ServedModel
from extproc.errors import ExtprocError
from extproc.types import ENGINE_KINDS, EngineKind, ModelName, WorkerSetKey

WORKER_SET_API = "kinference.buoyant.io/v1alpha1"
#: InferenceObjective, as the llm-d router serves it since its 2026-06 move (llm-d-router #1449)...
OBJECTIVE_API = "llm-d.ai/v1alpha2"
#: ... and in the Gateway API Inference Extension's group it came from. Where one name exists in
#: both, the llm-d.ai one is used, as the llm-d router does.
LEGACY_OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_MAX_MODELS, _MAX_ALIASES, _MAX_MODEL_NAME = 64, 32, 512
_INTERVAL_PATTERN = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"

DiscoveryMode = Literal["Endpoint", "Static"]


@dataclass(frozen=True, slots=True)
class KvEvents:
    """Where engines publish KV-cache events (ports are numbers or Service port names)."""

    port: IntOrString
    replay_port: IntOrString | None = None


@dataclass(frozen=True, slots=True)
class InferenceWorkerSet:
    """The ``spec`` of an InferenceWorkerSet that routing needs, validated."""

    namespace: str
    name: str
    service_name: str
    #: A Service port number, or the name of a Service port.
    service_port: IntOrString
    profile: str
    kv_block_size: int
    models: tuple[ServedModel, ...] = ()
    discovery_mode: DiscoveryMode = "Endpoint"
    discovery_interval: str = "30s"
    metrics_port: IntOrString | None = None
    kv_events: KvEvents | None = None
    #: ``metadata.creationTimestamp`` normalised to RFC 3339 UTC; older sets win name conflicts.
    created: str | None = None
    #: Data-parallel ranks per pod (annotation :data:`DATA_PARALLEL_ANNOTATION`); rank r publishes
    #: KV events on the KV ports + r, as vLLM offsets them.
    data_parallel_size: int = 1
    #: The engine its pods run, if declared (annotation :data:`ENGINE_ANNOTATION`); else detected.
    engine_kind: EngineKind | None = None

    @property
    def key(self) -> WorkerSetKey:
        return WorkerSetKey(f"{self.namespace}/{self.name}")


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One ``spec.ports[]`` entry; ``name`` is "" for a Service's single unnamed port."""

    name: str
    port: int


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    ports: tuple[ServicePort, ...] = ()


@dataclass(frozen=True, slots=True)
class SlicePort:
    """An EndpointSlice port: the same ``name`` as the Service port, the pods' own ``port``."""

    name: str
    #: None means "all ports" in Kubernetes; useless for routing, so such a port is skipped.
    port: int | None


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    """One endpoint of a slice; conditions keep Kubernetes' three states (None = unknown)."""

    #: The first address only: Kubernetes says all of an endpoint's addresses are fungible.
    address: str
    ready: bool | None = None
    terminating: bool | None = None
    pod: str | None = None


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    #: The ``kubernetes.io/service-name`` label; slices without it belong to no Service.
    service_name: str | None
    address_type: str
    ports: tuple[SlicePort, ...] = ()
    endpoints: tuple[SliceEndpoint, ...] = ()


@dataclass(frozen=True, slots=True)
class InferenceObjective:
    """The ``spec`` of an InferenceObjective: a priority for requests naming it, in one pool."""

    namespace: str
    name: str
    priority: int
    #: ``spec.poolRef.name``: an InferenceWorkerSet in the objective's namespace.
    pool: str
    #: From the older ``inference.networking.x-k8s.io`` group.
    legacy: bool = False


Resource = InferenceWorkerSet | Service | EndpointSlice | InferenceObjective


class InvalidObject(ExtprocError):
    """An object the API server would refuse; ``str()`` names the object and the field."""

    def __init__(self, kind: str, namespace: str, name: str, field_path: str, detail: str) -> None:
        where = f"{field_path}: " if field_path else ""
        super().__init__(f"{kind} {namespace}/{name}: {where}{detail}")
        self.kind, self.namespace, self.name = kind, namespace, name
        self.field_path, self.detail = field_path, detail


class UnsupportedKind(InvalidObject):
    """Not an object this router reads; sources skip it and say so."""


def object_identity(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """``(kind, namespace, name)`` read leniently, so an invalid object can still be named."""
    kind = obj.get("kind")
    metadata = obj.get("metadata")
    meta: Mapping[str, Any] = metadata if isinstance(metadata, Mapping) else {}
    namespace, name = meta.get("namespace"), meta.get("name")
    return (
        kind if isinstance(kind, str) and kind else "(no kind)",
        namespace if isinstance(namespace, str) and namespace else "default",
        name if isinstance(name, str) and name else "(no name)",
    )


def iter_objects(document: Any) -> Iterator[Any]:
    """Flatten ``kind: List`` (and typed lists like ``ServiceList``) into their items.

    Typed lists from the API omit each item's kind and apiVersion; they are filled in from the list.
    """
    kind = document.get("kind") if isinstance(document, Mapping) else None
    items = document.get("items") if isinstance(document, Mapping) else None
    if not (isinstance(kind, str) and kind.endswith("List") and isinstance(items, list)):
        yield document
        return
    item_kind, api_version = kind.removesuffix("List"), document.get("apiVersion")
    for item in items:
        if item_kind and isinstance(item, Mapping) and "kind" not in item:
            item = {"kind": item_kind, "apiVersion": api_version, **item}
        yield from iter_objects(item)


def is_catalog_object(obj: Any) -> bool:
    """Whether ``obj`` claims to be one of the kinds the catalog is built from (valid or not)."""
    return isinstance(obj, Mapping) and (str(obj.get("apiVersion")), obj.get("kind")) in _PARSERS


def parse_object(obj: Any) -> Resource:
    """Dispatch on apiVersion/kind; anything else is an :class:`UnsupportedKind`."""
    if not isinstance(obj, Mapping):
        detail = f"expected a mapping, got {fields.show(obj)}"
        raise InvalidObject("(no kind)", "default", "(no name)", "", detail)
    kind, namespace, name = object_identity(obj)
    api_version = obj.get("apiVersion")
    parser = _PARSERS.get((str(api_version), kind))
    if parser is None:
        supported = ", ".join(f"{k} ({v})" for v, k in _PARSERS)
        detail = f"apiVersion {fields.show(api_version)} kind {fields.show(obj.get('kind'))} is not "
        raise UnsupportedKind(kind, namespace, name, "", f"{detail}one of {supported}; skipped")
    return parser(obj)


_R = TypeVar("_R")


def naming_object(
    kind: str,
) -> Callable[[Callable[[Mapping[str, Any]], _R]], Callable[[Mapping[str, Any]], _R]]:
    """Make a parser's :class:`FieldError` an :class:`InvalidObject` naming ``kind`` and the object."""

    def decorate(parse: Callable[[Mapping[str, Any]], _R]) -> Callable[[Mapping[str, Any]], _R]:
        @functools.wraps(parse)
        def parse_named(obj: Mapping[str, Any]) -> _R:
            try:
                return parse(obj)
            except FieldError as exc:
                _, namespace, name = object_identity(obj)
                raise InvalidObject(kind, namespace, name, exc.path, exc.detail) from exc

        return parse_named

    return decorate


def object_metadata(obj: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """``(namespace, name, created)`` once the metadata every kind has is checked.

    ``created`` is ``metadata.creationTimestamp`` normalised to RFC 3339 UTC, or None if unset.
    """
    _, namespace, name = object_identity(obj)
    meta = fields.mapping(obj.get("metadata"), "metadata", required=True)
    fields.string(meta.get("name"), "metadata.name", required=True, max_len=253)
    fields.string(meta.get("namespace"), "metadata.namespace", max_len=63)
    stamp = meta.get("creationTimestamp")
    created = None if stamp is None else fields.timestamp(stamp, "metadata.creationTimestamp")
    return namespace, name, created


@naming_object("InferenceWorkerSet")
def parse_worker_set(obj: Mapping[str, Any]) -> InferenceWorkerSet:
    """Validate an InferenceWorkerSet against the CRD schema (status is ignored)."""
    namespace, name, created = object_metadata(obj)
    spec = fields.mapping(obj.get("spec"), "spec", required=True)
    ref = fields.mapping(spec.get("serviceRef"), "spec.serviceRef", required=True)
    discovery = fields.mapping(spec.get("modelDiscovery"), "spec.modelDiscovery")
    mode = fields.string(discovery.get("mode", "Endpoint"), "spec.modelDiscovery.mode")
    if mode not in ("Endpoint", "Static"):
        detail = f'must be "Endpoint" or "Static", got {fields.show(mode)}'
        raise FieldError("spec.modelDiscovery.mode", detail)
    interval = fields.string(discovery.get("interval", "30s"), "spec.modelDiscovery.interval")
    fields.match(interval, _INTERVAL_PATTERN, "spec.modelDiscovery.interval", "a duration like 30s or 1m30s")
    kv_events = None
    if spec.get("kvEvents") is not None:
        kv = fields.mapping(spec["kvEvents"], "spec.kvEvents")
        kv_events = KvEvents(
            port=fields.int_or_string(kv.get("port"), "spec.kvEvents.port", required=True),
            replay_port=fields.int_or_string(kv.get("replayPort"), "spec.kvEvents.replayPort"),
        )
    return InferenceWorkerSet(
        namespace=namespace,
        name=name,
        service_name=fields.string(ref.get("name"), "spec.serviceRef.name", required=True, max_len=253),
        service_port=fields.int_or_string(ref.get("port"), "spec.serviceRef.port", required=True),
        profile=fields.string(spec.get("profile"), "spec.profile", required=True, max_len=253),
        kv_block_size=fields.integer(spec.get("kvBlockSize"), "spec.kvBlockSize", 1, 4096),
        models=_parse_models(spec.get("models")),
        discovery_mode="Static" if mode == "Static" else "Endpoint",
        discovery_interval=interval,
        metrics_port=fields.int_or_string(spec.get("metricsPort"), "spec.metricsPort"),
        kv_events=kv_events,
        created=created,
        data_parallel_size=_data_parallel_size(obj),
        engine_kind=_engine_kind(obj),
    )


#: Not in the CRD's spec (kept compatible): engines started with ``--data-parallel-size N``.
DATA_PARALLEL_ANNOTATION = "kinference.buoyant.io/data-parallel-size"


def _data_parallel_size(obj: Mapping[str, Any]) -> int:
    meta = fields.mapping(obj.get("metadata"), "metadata")
    annotations = fields.mapping(meta.get("annotations"), "metadata.annotations")
    value = annotations.get(DATA_PARALLEL_ANNOTATION)
    if value is None:
        return 1
    where = f"metadata.annotations[{DATA_PARALLEL_ANNOTATION}]"
    if not isinstance(value, str) or not value.isdigit() or not 1 <= int(value) <= 64:
        detail = f"must be a number of ranks from 1 to 64 (a string), got {fields.show(value)}"
        raise FieldError(where, detail)
    return int(value)


#: Not in the CRD's spec: ``vllm`` or ``sglang``, the engine the set's pods run. Optional: serve tells
#: by the metrics the pods serve, and reports a declared kind they contradict.
ENGINE_ANNOTATION = "kinference.buoyant.io/engine"


def _engine_kind(obj: Mapping[str, Any]) -> EngineKind | None:
    meta = fields.mapping(obj.get("metadata"), "metadata")
    annotations = fields.mapping(meta.get("annotations"), "metadata.annotations")
    value = annotations.get(ENGINE_ANNOTATION)
    if value is None:
        return None
    for kind in ENGINE_KINDS:
        if value == kind:
            return kind
    detail = f"must be one of {', '.join(ENGINE_KINDS)}, got {fields.show(value)}"
    raise FieldError(f"metadata.annotations[{ENGINE_ANNOTATION}]", detail)


def _parse_models(value: Any) -> tuple[ServedModel, ...]:
    """Models and aliases; one name may not point at two upstream models within one set."""
    owner: dict[str, tuple[str, str]] = {}  # client name -> (upstream, field path first seen)
    aliases: dict[str, list[ModelName]] = {}
    for i, item in enumerate(fields.array(value, "spec.models", _MAX_MODELS)):
        path = f"spec.models[{i}]"
        model = fields.mapping(item, path, required=True)
        upstream = fields.string(model.get("name"), f"{path}.name", required=True, max_len=_MAX_MODEL_NAME)
        names = [(upstream, f"{path}.name")]
        for j, alias in enumerate(fields.array(model.get("aliases"), f"{path}.aliases", _MAX_ALIASES)):
            apath = f"{path}.aliases[{j}]"
            names.append((fields.string(alias, apath, required=True, max_len=_MAX_MODEL_NAME), apath))
        for client, cpath in names:
            seen = owner.setdefault(client, (upstream, cpath))
            if seen[0] != upstream:
                detail = f"{fields.show(client)} already names model {fields.show(seen[0])} (at {seen[1]})"
                raise FieldError(cpath, detail)
        known = aliases.setdefault(upstream, [])
        known.extend(ModelName(n) for n, _ in names[1:] if n != upstream and ModelName(n) not in known)
    return tuple(ServedModel(ModelName(m), tuple(a)) for m, a in aliases.items())


@naming_object("Service")
def parse_service(obj: Mapping[str, Any]) -> Service:
    """Only the ports matter: they map serviceRef.port to the EndpointSlice port name."""
    namespace, name, _ = object_metadata(obj)
    spec = fields.mapping(obj.get("spec"), "spec")
    ports = []
    for i, item in enumerate(fields.array(spec.get("ports"), "spec.ports", 256)):
        path = f"spec.ports[{i}]"
        port = fields.mapping(item, path, required=True)
        ports.append(
            ServicePort(
                name=fields.string(port.get("name", ""), f"{path}.name", max_len=63),
                port=fields.integer(port.get("port"), f"{path}.port", 1, 65535),
            )
        )
    return Service(namespace=namespace, name=name, ports=tuple(ports))


@naming_object("EndpointSlice")
def parse_endpoint_slice(obj: Mapping[str, Any]) -> EndpointSlice:
    """Addresses are checked against ``addressType`` and normalised, so duplicates compare equal."""
    namespace, name, _ = object_metadata(obj)
    address_type = fields.string(obj.get("addressType"), "addressType", required=True)
    if address_type not in ("IPv4", "IPv6", "FQDN"):
        detail = f'must be "IPv4", "IPv6" or "FQDN", got {fields.show(address_type)}'
        raise FieldError("addressType", detail)
    meta = fields.mapping(obj.get("metadata"), "metadata")
    labels = fields.mapping(meta.get("labels"), "metadata.labels")
    service_name = labels.get(SERVICE_NAME_LABEL)
    ports = []
    for i, item in enumerate(fields.array(obj.get("ports"), "ports", 20000)):
        port = fields.mapping(item, f"ports[{i}]", required=True)
        number = port.get("port")
        ports.append(
            SlicePort(
                name=fields.string(port.get("name", ""), f"ports[{i}].name", max_len=63),
                port=None if number is None else fields.integer(number, f"ports[{i}].port", 1, 65535),
            )
        )
    endpoints = [
        _parse_slice_endpoint(item, f"endpoints[{i}]", address_type)
        for i, item in enumerate(fields.array(obj.get("endpoints"), "endpoints", 1000))
    ]
    return EndpointSlice(
        namespace=namespace,
        name=name,
        service_name=service_name if isinstance(service_name, str) and service_name else None,
        address_type=address_type,
        ports=tuple(ports),
        endpoints=tuple(endpoints),
    )


def _parse_slice_endpoint(value: Any, path: str, address_type: str) -> SliceEndpoint:
    endpoint = fields.mapping(value, path, required=True)
    addresses = fields.array(endpoint.get("addresses"), f"{path}.addresses", 100)
    if not addresses:
        raise FieldError(f"{path}.addresses", "must list at least one address")
    address = fields.string(addresses[0], f"{path}.addresses[0]", required=True)
    if address_type != "FQDN":
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(address)
        except ValueError:
            ip = None
        if ip is None or ip.version != (4 if address_type == "IPv4" else 6):
            detail = f"must be an {address_type} address, got {fields.show(address)}"
            raise FieldError(f"{path}.addresses[0]", detail)
        address = str(ip)
    conditions = fields.mapping(endpoint.get("conditions"), f"{path}.conditions")
    target = fields.mapping(endpoint.get("targetRef"), f"{path}.targetRef")
    pod = target.get("name") if target.get("kind", "Pod") == "Pod" else None
    return SliceEndpoint(
        address=address,
        ready=fields.boolean(conditions.get("ready"), f"{path}.conditions.ready"),
        terminating=fields.boolean(conditions.get("terminating"), f"{path}.conditions.terminating"),
        pod=pod if isinstance(pod, str) else None,
    )


#: ``spec.priority`` is an int32 upstream.
_INT32 = 2**31


@naming_object("InferenceObjective")
def parse_objective(obj: Mapping[str, Any]) -> InferenceObjective:
    """An unset priority is 0, as upstream's endpoint picker reads it; ``poolRef.name`` is required
    (its group and kind are not read: the name is matched to an InferenceWorkerSet)."""
    namespace, name, _ = object_metadata(obj)
    spec = fields.mapping(obj.get("spec"), "spec", required=True)
    priority = spec.get("priority")
    ref = fields.mapping(spec.get("poolRef"), "spec.poolRef", required=True)
    return InferenceObjective(
        namespace=namespace,
        name=name,
        priority=0 if priority is None else fields.integer(priority, "spec.priority", -_INT32, _INT32 - 1),
        pool=fields.string(ref.get("name"), "spec.poolRef.name", required=True, max_len=253),
        legacy=obj.get("apiVersion") == LEGACY_OBJECTIVE_API,
    )


_PARSERS: dict[tuple[str, str], Callable[[Mapping[str, Any]], Resource]] = {
    (WORKER_SET_API, "InferenceWorkerSet"): parse_worker_set,
    ("v1", "Service"): parse_service,
    ("discovery.k8s.io/v1", "EndpointSlice"): parse_endpoint_slice,
    (OBJECTIVE_API, "InferenceObjective"): parse_objective,
    (LEGACY_OBJECTIVE_API, "InferenceObjective"): parse_objective,
}
