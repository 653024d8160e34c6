"""Kubernetes objects as plain dicts -> small typed records, validated the way the API server would.

Both sources hand us the same shapes (a YAML file, or the Kubernetes API's JSON), so this module is
the one place that knows field names. It rejects what the CRD schema rejects, plus names a set
lists twice for different models (the schema cannot say that), and it never raises anything but
:class:`InvalidObject`, whose message names the object and the field so that a user can fix it.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, NoReturn, overload

from extproc.catalog.model import ServedModel
from extproc.errors import ExtprocError
from extproc.types import ModelName, WorkerSetKey

WORKER_SET_API = "kinference.buoyant.io/v1alpha1"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_MAX_MODELS, _MAX_ALIASES, _MAX_MODEL_NAME = 64, 32, 512
_INTERVAL_PATTERN = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"

IntOrString = int | str
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


Resource = InferenceWorkerSet | Service | EndpointSlice


class InvalidObject(ExtprocError):
    """An object the API server would refuse; ``str()`` names the object and the field."""

    def __init__(self, kind: str, namespace: str, name: str, field_path: str, detail: str) -> None:
        where = f"{field_path}: " if field_path else ""
        super().__init__(f"{kind} {namespace}/{name}: {where}{detail}")
        self.kind, self.namespace, self.name = kind, namespace, name
        self.field_path, self.detail = field_path, detail


class UnsupportedKind(InvalidObject):
    """Not an object this router reads; sources skip it and say so."""


class _Fields:
    """Typed getters that fail with the object's name and the field's path."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        self.kind, self.namespace, self.name = kind, namespace, name
        self.created: str | None = None

    @classmethod
    def of(cls, kind: str, obj: Mapping[str, Any]) -> _Fields:
        _, namespace, name = object_identity(obj)
        f = cls(kind, namespace, name)
        meta = f.mapping(obj.get("metadata"), "metadata", required=True)
        f.string(meta.get("name"), "metadata.name", required=True, max_len=253)
        f.string(meta.get("namespace"), "metadata.namespace", max_len=63)
        if meta.get("creationTimestamp") is not None:
            f.created = f.timestamp(meta["creationTimestamp"], "metadata.creationTimestamp")
        return f

    def fail(self, path: str, detail: str) -> NoReturn:
        raise InvalidObject(self.kind, self.namespace, self.name, path, detail)

    @staticmethod
    def show(value: Any) -> str:
        """JSON-ish, as the user wrote it in YAML: strings quoted, booleans lower-case."""
        text = json.dumps(value, default=str, ensure_ascii=False)
        return text if len(text) <= 80 else text[:77] + "..."

    def mapping(self, value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
        if value is None and not required:
            return {}
        if value is None:
            self.fail(path, "required field is missing")
        if not isinstance(value, Mapping):
            self.fail(path, f"must be a mapping, got {self.show(value)}")
        return value

    def list(self, value: Any, path: str, max_items: int) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.fail(path, f"must be a list, got {self.show(value)}")
        if len(value) > max_items:
            self.fail(path, f"must have at most {max_items} items, got {len(value)}")
        return value

    def string(self, value: Any, path: str, *, required: bool = False, max_len: int | None = None) -> str:
        """A string; ``required`` also means non-empty, as Kubernetes names and model names are."""
        if value is None and not required:
            return ""
        if value is None:
            self.fail(path, "required field is missing")
        if not isinstance(value, str):
            self.fail(path, f"must be a string, got {self.show(value)}")
        if required and not value:
            self.fail(path, "must not be empty")
        if max_len is not None and len(value) > max_len:
            self.fail(path, f"must be at most {max_len} characters, got {len(value)}")
        return value

    def integer(self, value: Any, path: str, lo: int, hi: int) -> int:
        if value is None:
            self.fail(path, "required field is missing")
        # bool is an int subclass in Python but not an integer in YAML, JSON or OpenAPI.
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(path, f"must be an integer between {lo} and {hi}, got {self.show(value)}")
        return value

    @overload
    def int_or_string(self, value: Any, path: str, *, required: Literal[True]) -> IntOrString: ...
    @overload
    def int_or_string(self, value: Any, path: str, *, required: bool = False) -> IntOrString | None: ...
    def int_or_string(self, value: Any, path: str, *, required: bool = False) -> IntOrString | None:
        """A port: a number, or the name of one of the Service's ports."""
        if value is None and not required:
            return None
        if value is None:
            self.fail(path, "required field is missing")
        if isinstance(value, str) and value:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            self.fail(path, f"must be a port number (1-65535) or a port name, got {self.show(value)}")
        return value

    def boolean(self, value: Any, path: str) -> bool | None:
        if value is not None and not isinstance(value, bool):
            self.fail(path, f"must be true or false, got {self.show(value)}")
        return value

    def match(self, value: str, pattern: str, path: str, what: str) -> None:
        if re.fullmatch(pattern, value) is None:
            self.fail(path, f"must be {what} (pattern {pattern}), got {self.show(value)}")

    def timestamp(self, value: Any, path: str) -> str:
        """RFC 3339 in UTC; YAML turns unquoted timestamps into datetimes, the API sends strings."""
        moment = value if isinstance(value, datetime) else None
        if isinstance(value, str):
            try:
                moment = datetime.fromisoformat(value)
            except ValueError:
                moment = None
        if moment is None:
            self.fail(path, f"must be an RFC 3339 date-time, got {self.show(value)}")
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


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


def parse_object(obj: Any) -> Resource:
    """Dispatch on apiVersion/kind; anything else is an :class:`UnsupportedKind`."""
    if not isinstance(obj, Mapping):
        detail = f"expected a mapping, got {_Fields.show(obj)}"
        raise InvalidObject("(no kind)", "default", "(no name)", "", detail)
    kind, namespace, name = object_identity(obj)
    api_version = obj.get("apiVersion")
    parser = _PARSERS.get((str(api_version), kind))
    if parser is None:
        supported = ", ".join(f"{k} ({v})" for v, k in _PARSERS)
        detail = f"apiVersion {_Fields.show(api_version)} kind {_Fields.show(obj.get('kind'))} is not "
        raise UnsupportedKind(kind, namespace, name, "", f"{detail}one of {supported}; skipped")
    return parser(obj)


def parse_worker_set(obj: Mapping[str, Any]) -> InferenceWorkerSet:
    """Validate an InferenceWorkerSet against the CRD schema (status is ignored)."""
    f = _Fields.of("InferenceWorkerSet", obj)
    spec = f.mapping(obj.get("spec"), "spec", required=True)
    ref = f.mapping(spec.get("serviceRef"), "spec.serviceRef", required=True)
    discovery = f.mapping(spec.get("modelDiscovery"), "spec.modelDiscovery")
    mode = f.string(discovery.get("mode", "Endpoint"), "spec.modelDiscovery.mode")
    if mode not in ("Endpoint", "Static"):
        f.fail("spec.modelDiscovery.mode", f'must be "Endpoint" or "Static", got {f.show(mode)}')
    interval = f.string(discovery.get("interval", "30s"), "spec.modelDiscovery.interval")
    f.match(interval, _INTERVAL_PATTERN, "spec.modelDiscovery.interval", "a duration like 30s or 1m30s")
    kv_events = None
    if spec.get("kvEvents") is not None:
        kv = f.mapping(spec["kvEvents"], "spec.kvEvents")
        kv_events = KvEvents(
            port=f.int_or_string(kv.get("port"), "spec.kvEvents.port", required=True),
            replay_port=f.int_or_string(kv.get("replayPort"), "spec.kvEvents.replayPort"),
        )
    return InferenceWorkerSet(
        namespace=f.namespace,
        name=f.name,
        service_name=f.string(ref.get("name"), "spec.serviceRef.name", required=True, max_len=253),
        service_port=f.int_or_string(ref.get("port"), "spec.serviceRef.port", required=True),
        profile=f.string(spec.get("profile"), "spec.profile", required=True, max_len=253),
        kv_block_size=f.integer(spec.get("kvBlockSize"), "spec.kvBlockSize", 1, 4096),
        models=_parse_models(f, spec.get("models")),
        discovery_mode="Static" if mode == "Static" else "Endpoint",
        discovery_interval=interval,
        metrics_port=f.int_or_string(spec.get("metricsPort"), "spec.metricsPort"),
        kv_events=kv_events,
        created=f.created,
    )


def _parse_models(f: _Fields, value: Any) -> tuple[ServedModel, ...]:
    """Models and aliases; one name may not point at two upstream models within one set."""
    owner: dict[str, tuple[str, str]] = {}  # client name -> (upstream, field path first seen)
    aliases: dict[str, list[ModelName]] = {}
    for i, item in enumerate(f.list(value, "spec.models", _MAX_MODELS)):
        path = f"spec.models[{i}]"
        model = f.mapping(item, path, required=True)
        upstream = f.string(model.get("name"), f"{path}.name", required=True, max_len=_MAX_MODEL_NAME)
        names = [(upstream, f"{path}.name")]
        for j, alias in enumerate(f.list(model.get("aliases"), f"{path}.aliases", _MAX_ALIASES)):
            apath = f"{path}.aliases[{j}]"
            names.append((f.string(alias, apath, required=True, max_len=_MAX_MODEL_NAME), apath))
        for client, cpath in names:
            seen = owner.setdefault(client, (upstream, cpath))
            if seen[0] != upstream:
                f.fail(cpath, f"{f.show(client)} already names model {f.show(seen[0])} (at {seen[1]})")
        known = aliases.setdefault(upstream, [])
        known.extend(ModelName(n) for n, _ in names[1:] if n != upstream and ModelName(n) not in known)
    return tuple(ServedModel(ModelName(m), tuple(a)) for m, a in aliases.items())


def parse_service(obj: Mapping[str, Any]) -> Service:
    """Only the ports matter: they map serviceRef.port to the EndpointSlice port name."""
    f = _Fields.of("Service", obj)
    spec = f.mapping(obj.get("spec"), "spec")
    ports = []
    for i, item in enumerate(f.list(spec.get("ports"), "spec.ports", 256)):
        path = f"spec.ports[{i}]"
        port = f.mapping(item, path, required=True)
        ports.append(
            ServicePort(
                name=f.string(port.get("name", ""), f"{path}.name", max_len=63),
                port=f.integer(port.get("port"), f"{path}.port", 1, 65535),
            )
        )
    return Service(namespace=f.namespace, name=f.name, ports=tuple(ports))


def parse_endpoint_slice(obj: Mapping[str, Any]) -> EndpointSlice:
    """Addresses are checked against ``addressType`` and normalised, so duplicates compare equal."""
    f = _Fields.of("EndpointSlice", obj)
    address_type = f.string(obj.get("addressType"), "addressType", required=True)
    if address_type not in ("IPv4", "IPv6", "FQDN"):
        f.fail("addressType", f'must be "IPv4", "IPv6" or "FQDN", got {f.show(address_type)}')
    labels = f.mapping(f.mapping(obj.get("metadata"), "metadata").get("labels"), "metadata.labels")
    service_name = labels.get(SERVICE_NAME_LABEL)
    ports = []
    for i, item in enumerate(f.list(obj.get("ports"), "ports", 20000)):
        port = f.mapping(item, f"ports[{i}]", required=True)
        number = port.get("port")
        ports.append(
            SlicePort(
                name=f.string(port.get("name", ""), f"ports[{i}].name", max_len=63),
                port=None if number is None else f.integer(number, f"ports[{i}].port", 1, 65535),
            )
        )
    endpoints = [
        _parse_slice_endpoint(f, item, f"endpoints[{i}]", address_type)
        for i, item in enumerate(f.list(obj.get("endpoints"), "endpoints", 1000))
    ]
    return EndpointSlice(
        namespace=f.namespace,
        name=f.name,
        service_name=service_name if isinstance(service_name, str) and service_name else None,
        address_type=address_type,
        ports=tuple(ports),
        endpoints=tuple(endpoints),
    )


def _parse_slice_endpoint(f: _Fields, value: Any, path: str, address_type: str) -> SliceEndpoint:
    endpoint = f.mapping(value, path, required=True)
    addresses = f.list(endpoint.get("addresses"), f"{path}.addresses", 100)
    if not addresses:
        f.fail(f"{path}.addresses", "must list at least one address")
    address = f.string(addresses[0], f"{path}.addresses[0]", required=True)
    if address_type != "FQDN":
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            f.fail(f"{path}.addresses[0]", f"must be an {address_type} address, got {f.show(address)}")
        if ip.version != (4 if address_type == "IPv4" else 6):
            f.fail(f"{path}.addresses[0]", f"must be an {address_type} address, got {f.show(address)}")
        address = str(ip)
    conditions = f.mapping(endpoint.get("conditions"), f"{path}.conditions")
    target = f.mapping(endpoint.get("targetRef"), f"{path}.targetRef")
    pod = target.get("name") if target.get("kind", "Pod") == "Pod" else None
    return SliceEndpoint(
        address=address,
        ready=f.boolean(conditions.get("ready"), f"{path}.conditions.ready"),
        terminating=f.boolean(conditions.get("terminating"), f"{path}.conditions.terminating"),
        pod=pod if isinstance(pod, str) else None,
    )


_PARSERS: dict[tuple[str, str], Callable[[Mapping[str, Any]], Resource]] = {
    (WORKER_SET_API, "InferenceWorkerSet"): parse_worker_set,
    ("v1", "Service"): parse_service,
    ("discovery.k8s.io/v1", "EndpointSlice"): parse_endpoint_slice,
}
