"""Parsing and validation of InferenceWorkerSets, Services and EndpointSlices from plain dicts."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest

from extproc.catalog.model import ServedModel
from extproc.catalog.resources import (
    InferenceObjective,
    InferenceWorkerSet,
    InvalidObject,
    KvEvents,
    Service,
    ServicePort,
    SliceEndpoint,
    SlicePort,
    UnsupportedKind,
    iter_objects,
    parse_endpoint_slice,
    parse_object,
    parse_service,
    parse_worker_set,
)
from extproc.types import ModelName

_LONG = "x" * 513


def worker_set(spec: dict[str, Any] | None = None, **metadata: Any) -> dict[str, Any]:
    """A valid InferenceWorkerSet named default/llama, with ``spec`` keys replaced (None deletes)."""
    body: dict[str, Any] = {
        "serviceRef": {"name": "llama", "port": 80},
        "profile": "h100",
        "kvBlockSize": 16,
        "models": [{"name": "llama-3", "aliases": ["chat"]}],
    }
    for key, value in (spec or {}).items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return {
        "apiVersion": "kinference.buoyant.io/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": {"name": "llama", "namespace": "default", **metadata},
        "spec": body,
    }


def test_valid_worker_set_fills_schema_defaults() -> None:
    """A minimal set gets the CRD defaults: discovery mode Endpoint every 30s, no KV events."""
    obj = worker_set({"models": None})
    del obj["metadata"]["namespace"]
    assert parse_worker_set(obj) == InferenceWorkerSet(
        namespace="default",
        name="llama",
        service_name="llama",
        service_port=80,
        profile="h100",
        kv_block_size=16,
    )


def test_full_worker_set_keeps_every_field() -> None:
    """Optional fields (KV events, metrics port, discovery) are carried over as written."""
    obj = worker_set(
        {
            "serviceRef": {"name": "llama", "port": "http"},
            "kvEvents": {"port": 5557, "replayPort": "kv-replay"},
            "metricsPort": "metrics",
            "modelDiscovery": {"mode": "Static", "interval": "1m30s"},
        },
        creationTimestamp="2025-01-10T09:00:00Z",
    )
    parsed = parse_worker_set(obj)
    assert parsed.key == "default/llama"
    assert (parsed.service_port, parsed.metrics_port) == ("http", "metrics")
    assert parsed.kv_events == KvEvents(port=5557, replay_port="kv-replay")
    assert (parsed.discovery_mode, parsed.discovery_interval) == ("Static", "1m30s")
    assert parsed.created == "2025-01-10T09:00:00Z"
    assert parsed.models == (ServedModel(ModelName("llama-3"), (ModelName("chat"),)),)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2025-01-10T09:00:00Z", "2025-01-10T09:00:00Z"),
        ("2025-01-10T11:00:00+02:00", "2025-01-10T09:00:00Z"),
        (dt.datetime(2025, 1, 10, 9, 0, tzinfo=dt.UTC), "2025-01-10T09:00:00Z"),
        (dt.datetime(2025, 1, 10, 9, 0), "2025-01-10T09:00:00Z"),
    ],
    ids=["rfc3339-z", "offset", "yaml-datetime", "naive-is-utc"],
)
def test_creation_timestamp_is_normalised_to_utc(value: object, expected: str) -> None:
    """Creation times compare correctly whether YAML parsed them or the API sent a string."""
    assert parse_worker_set(worker_set(creationTimestamp=value)).created == expected


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ([{"name": "m", "aliases": ["a", "a", "m"]}], (ServedModel(ModelName("m"), (ModelName("a"),)),)),
        (
            [{"name": "m", "aliases": ["a"]}, {"name": "m", "aliases": ["b"]}],
            (ServedModel(ModelName("m"), (ModelName("a"), ModelName("b"))),),
        ),
    ],
    ids=["repeated-alias", "model-listed-twice"],
)
def test_repeated_names_for_the_same_model_are_merged(models: list[Any], expected: object) -> None:
    """Listing a name twice for the same model is harmless and counts once."""
    assert parse_worker_set(worker_set({"models": models})).models == expected


_IWS = "InferenceWorkerSet default/llama: "


@pytest.mark.parametrize(
    ("spec", "metadata", "message"),
    [
        ({"kvBlockSize": "big"}, {}, 'spec.kvBlockSize: must be an integer between 1 and 4096, got "big"'),
        ({"kvBlockSize": True}, {}, "spec.kvBlockSize: must be an integer between 1 and 4096, got true"),
        ({"kvBlockSize": 0}, {}, "spec.kvBlockSize: must be an integer between 1 and 4096, got 0"),
        ({"kvBlockSize": 4097}, {}, "spec.kvBlockSize: must be an integer between 1 and 4096, got 4097"),
        ({"kvBlockSize": None}, {}, "spec.kvBlockSize: required field is missing"),
        ({"profile": ""}, {}, "spec.profile: must not be empty"),
        ({"profile": "p" * 254}, {}, "spec.profile: must be at most 253 characters, got 254"),
        ({"serviceRef": None}, {}, "spec.serviceRef: required field is missing"),
        ({"serviceRef": {"port": 80}}, {}, "spec.serviceRef.name: required field is missing"),
        ({"serviceRef": {"name": "s"}}, {}, "spec.serviceRef.port: required field is missing"),
        (
            {"serviceRef": {"name": "s", "port": 0}},
            {},
            "spec.serviceRef.port: must be a port number (1-65535) or a port name, got 0",
        ),
        (
            {"serviceRef": {"name": "s", "port": False}},
            {},
            "spec.serviceRef.port: must be a port number (1-65535) or a port name, got false",
        ),
        (
            {"metricsPort": 70000},
            {},
            "spec.metricsPort: must be a port number (1-65535) or a port name, got 70000",
        ),
        ({"kvEvents": {"replayPort": 5558}}, {}, "spec.kvEvents.port: required field is missing"),
        (
            {"modelDiscovery": {"mode": "Auto"}},
            {},
            'spec.modelDiscovery.mode: must be "Endpoint" or "Static", got "Auto"',
        ),
        (
            {"modelDiscovery": {"interval": "30 seconds"}},
            {},
            "spec.modelDiscovery.interval: must be a duration like 30s or 1m30s "
            '(pattern ^([0-9]{1,5}(h|m|s|ms)){1,4}$), got "30 seconds"',
        ),
        ({"models": "llama"}, {}, 'spec.models: must be a list, got "llama"'),
        (
            {"models": [{"name": f"m{i}"} for i in range(65)]},
            {},
            "spec.models: must have at most 64 items, got 65",
        ),
        (
            {"models": [{"name": "m"}, {"aliases": ["a"]}]},
            {},
            "spec.models[1].name: required field is missing",
        ),
        ({"models": [{"name": _LONG}]}, {}, "spec.models[0].name: must be at most 512 characters, got 513"),
        (
            {"models": [{"name": "m", "aliases": [f"a{i}" for i in range(33)]}]},
            {},
            "spec.models[0].aliases: must have at most 32 items, got 33",
        ),
        (
            {"models": [{"name": "m", "aliases": [7]}]},
            {},
            "spec.models[0].aliases[0]: must be a string, got 7",
        ),
        (
            {"models": [{"name": "a", "aliases": ["chat"]}, {"name": "b", "aliases": ["chat"]}]},
            {},
            'spec.models[1].aliases[0]: "chat" already names model "a" (at spec.models[0].aliases[0])',
        ),
        (
            {"models": [{"name": "a", "aliases": ["b"]}, {"name": "b"}]},
            {},
            'spec.models[1].name: "b" already names model "a" (at spec.models[0].aliases[0])',
        ),
        (
            {},
            {"creationTimestamp": "yesterday"},
            'metadata.creationTimestamp: must be an RFC 3339 date-time, got "yesterday"',
        ),
        ({}, {"namespace": 5}, "metadata.namespace: must be a string, got 5"),
    ],
    ids=[
        "block-size-string",
        "block-size-bool",
        "block-size-zero",
        "block-size-too-big",
        "block-size-missing",
        "profile-empty",
        "profile-too-long",
        "service-ref-missing",
        "service-name-missing",
        "service-port-missing",
        "service-port-zero",
        "service-port-bool",
        "metrics-port-range",
        "kv-events-without-port",
        "discovery-mode",
        "discovery-interval",
        "models-not-list",
        "too-many-models",
        "model-without-name",
        "model-name-too-long",
        "too-many-aliases",
        "alias-not-string",
        "alias-for-two-models",
        "alias-is-other-model",
        "bad-timestamp",
        "namespace-not-string",
    ],
)
def test_invalid_worker_set_names_object_and_field(
    spec: dict[str, Any], metadata: dict[str, Any], message: str
) -> None:
    """A rejected set's error names the object and the exact field path, as kubectl would."""
    with pytest.raises(InvalidObject) as info:
        parse_worker_set(worker_set(spec, **metadata))
    assert str(info.value) == _IWS + message
    assert info.value.field_path == message.split(": ", 1)[0]


def test_worker_set_without_name_is_named_as_such() -> None:
    """An object without metadata.name is still reported readably."""
    obj = worker_set()
    del obj["metadata"]["name"]
    with pytest.raises(
        InvalidObject, match=r"^InferenceWorkerSet default/\(no name\): metadata.name: required"
    ):
        parse_worker_set(obj)


def test_service_ports_named_and_unnamed() -> None:
    """A Service's single unnamed port gets the name "" (what EndpointSlices call it)."""
    obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "llama", "namespace": "prod"},
        "spec": {"ports": [{"port": 8000}, {"name": "metrics", "port": 9400, "targetPort": 9400}]},
    }
    assert parse_service(obj) == Service(
        namespace="prod", name="llama", ports=(ServicePort("", 8000), ServicePort("metrics", 9400))
    )


def test_service_with_invalid_port_is_rejected() -> None:
    """A Service port out of range is refused with its index in the message."""
    obj = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {"ports": [{"port": 0}]}}
    with pytest.raises(InvalidObject, match=r"^Service default/s: spec.ports\[0\].port: must be an integer"):
        parse_service(obj)


def endpoint_slice(address_type: str, addresses: list[Any], **endpoint: Any) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "llama-abc", "labels": {"kubernetes.io/service-name": "llama"}},
        "addressType": address_type,
        "ports": [{"name": "http", "port": 8000}, {"name": "all", "port": None}],
        "endpoints": [{"addresses": addresses, **endpoint}],
    }


def test_endpoint_slice_keeps_conditions_and_pod() -> None:
    """Only the first address is used; absent conditions stay None (unknown), not False."""
    obj = endpoint_slice(
        "IPv4",
        ["127.0.0.1", "127.0.0.9"],
        conditions={"terminating": True},
        targetRef={"kind": "Pod", "name": "llama-0"},
    )
    parsed = parse_endpoint_slice(obj)
    assert parsed.service_name == "llama"
    assert parsed.ports == (SlicePort("http", 8000), SlicePort("all", None))
    assert parsed.endpoints == (SliceEndpoint("127.0.0.1", ready=None, terminating=True, pod="llama-0"),)


def test_ipv6_addresses_are_normalised() -> None:
    """IPv6 written in any spelling compares equal, so duplicates across slices are found."""
    parsed = parse_endpoint_slice(endpoint_slice("IPv6", ["2001:DB8:0::0001"]))
    assert parsed.endpoints[0].address == "2001:db8::1"


@pytest.mark.parametrize(
    ("address_type", "addresses", "endpoint", "message"),
    [
        ("IPv4", ["::1"], {}, 'endpoints[0].addresses[0]: must be an IPv4 address, got "::1"'),
        ("IPv6", ["127.0.0.1"], {}, 'endpoints[0].addresses[0]: must be an IPv6 address, got "127.0.0.1"'),
        ("IPv4", ["pod-0"], {}, 'endpoints[0].addresses[0]: must be an IPv4 address, got "pod-0"'),
        ("IPv4", [], {}, "endpoints[0].addresses: must list at least one address"),
        ("IPv5", ["127.0.0.1"], {}, 'addressType: must be "IPv4", "IPv6" or "FQDN", got "IPv5"'),
        (
            "IPv4",
            ["127.0.0.1"],
            {"conditions": {"ready": "yes"}},
            'endpoints[0].conditions.ready: must be true or false, got "yes"',
        ),
    ],
    ids=["v6-in-v4-slice", "v4-in-v6-slice", "hostname", "no-address", "bad-type", "non-bool-ready"],
)
def test_invalid_endpoint_slice_names_field(
    address_type: str, addresses: list[Any], endpoint: dict[str, Any], message: str
) -> None:
    """A slice with a malformed endpoint is refused with the endpoint's field path."""
    with pytest.raises(InvalidObject) as info:
        parse_endpoint_slice(endpoint_slice(address_type, addresses, **endpoint))
    assert str(info.value) == f"EndpointSlice default/llama-abc: {message}"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "ops"}},
            'ConfigMap ops/cfg: apiVersion "v1" kind "ConfigMap" is not one of',
        ),
        (
            {**worker_set(), "apiVersion": "kinference.buoyant.io/v1beta1"},
            'InferenceWorkerSet default/llama: apiVersion "kinference.buoyant.io/v1beta1" kind',
        ),
        ({"metadata": {"name": "x"}}, "(no kind) default/x: apiVersion null kind null is not one of"),
    ],
    ids=["other-kind", "other-version", "no-kind"],
)
def test_unsupported_kinds_are_refused_by_name(obj: dict[str, Any], message: str) -> None:
    """Objects this router does not read are reported as skipped, naming what is supported."""
    with pytest.raises(UnsupportedKind) as info:
        parse_object(obj)
    assert str(info.value).startswith(message)
    assert "InferenceWorkerSet (kinference.buoyant.io/v1alpha1)" in str(info.value)
    assert str(info.value).endswith("; skipped")


def test_non_mapping_document_is_invalid() -> None:
    """A YAML document that is not a mapping is reported, not crashed on."""
    with pytest.raises(InvalidObject, match=r'expected a mapping, got \["a", "b"\]'):
        parse_object(["a", "b"])


def test_parse_object_dispatches_on_kind() -> None:
    """Each supported kind reaches its own parser."""
    assert isinstance(parse_object(worker_set()), InferenceWorkerSet)
    assert isinstance(
        parse_object({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}), Service
    )


@pytest.mark.parametrize(
    ("document", "expected_kinds"),
    [
        ({"apiVersion": "v1", "kind": "Service"}, ["Service"]),
        (
            {"apiVersion": "v1", "kind": "List", "items": [{"kind": "Service"}, {"kind": "ConfigMap"}]},
            ["Service", "ConfigMap"],
        ),
        ({"apiVersion": "v1", "kind": "ServiceList", "items": [{"metadata": {"name": "a"}}]}, ["Service"]),
        (
            {"apiVersion": "v1", "kind": "List", "items": [{"kind": "List", "items": [{"kind": "Service"}]}]},
            ["Service"],
        ),
        ({"apiVersion": "v1", "kind": "List", "items": []}, []),
    ],
    ids=["plain", "list", "typed-list", "nested-list", "empty-list"],
)
def test_list_documents_are_flattened(document: dict[str, Any], expected_kinds: list[str]) -> None:
    """`kubectl get -o yaml` output (kind: List, or typed lists without item kinds) is accepted."""
    assert [obj["kind"] for obj in iter_objects(document)] == expected_kinds


def test_typed_list_items_inherit_api_version() -> None:
    """Items of a typed list from the API get the list's apiVersion, so they parse."""
    items = list(
        iter_objects({"apiVersion": "v1", "kind": "ServiceList", "items": [{"metadata": {"name": "a"}}]})
    )
    assert parse_object(items[0]) == Service(namespace="default", name="a")


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [(None, 1), ({"kinference.buoyant.io/data-parallel-size": "4"}, 4), ({"other": "x"}, 1)],
    ids=["absent", "four", "unrelated"],
)
def test_data_parallel_size_comes_from_an_annotation(
    annotations: dict[str, str] | None, expected: int
) -> None:
    """The DP rank count per pod is an annotation (the CRD spec stays as it is)."""
    doc = _dp_doc(annotations)
    parsed = parse_object(doc)
    assert isinstance(parsed, InferenceWorkerSet) and parsed.data_parallel_size == expected


@pytest.mark.parametrize("value", ["0", "65", "two", 4], ids=["zero", "too-many", "word", "not-a-string"])
def test_bad_data_parallel_annotation_names_it(value: object) -> None:
    """A bad annotation value is rejected naming the annotation."""
    with pytest.raises(
        InvalidObject, match=r"metadata.annotations\[kinference.buoyant.io/data-parallel-size\]"
    ):
        parse_object(_dp_doc({"kinference.buoyant.io/data-parallel-size": value}))


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("vllm", "vllm"), ("sglang", "sglang")])
def test_the_engine_a_set_runs_may_be_declared_by_an_annotation(
    value: str | None, expected: str | None
) -> None:
    parsed = parse_object(_dp_doc(None if value is None else {"kinference.buoyant.io/engine": value}))
    assert isinstance(parsed, InferenceWorkerSet) and parsed.engine_kind == expected


@pytest.mark.parametrize("value", ["SGLang", "trtllm", 1], ids=["capitals", "unknown", "not-a-string"])
def test_an_unknown_engine_is_rejected_naming_the_annotation_and_the_choices(value: object) -> None:
    with pytest.raises(
        InvalidObject, match=r"annotations\[kinference.buoyant.io/engine\]: must be one of vllm, sglang"
    ):
        parse_object(_dp_doc({"kinference.buoyant.io/engine": value}))


def _dp_doc(annotations: dict[str, object] | None) -> dict[str, object]:
    metadata: dict[str, object] = {"name": "llama", "namespace": "default"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {
        "apiVersion": "kinference.buoyant.io/v1alpha1",
        "kind": "InferenceWorkerSet",
        "metadata": metadata,
        "spec": {"serviceRef": {"name": "llama", "port": 80}, "profile": "p", "kvBlockSize": 16},
    }


def objective(spec: Any, *, group: str = "llm-d.ai") -> dict[str, Any]:
    return {
        "apiVersion": f"{group}/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": "interactive", "namespace": "ml"},
        "spec": spec,
    }


def test_inference_objectives_of_either_group_parse_with_priority_0_when_unset() -> None:
    parsed = parse_object(objective({"priority": 10, "poolRef": {"group": "x", "name": "llama"}}))
    assert parsed == InferenceObjective("ml", "interactive", 10, "llama")
    legacy = parse_object(objective({"poolRef": {"name": "llama"}}, group="inference.networking.x-k8s.io"))
    assert legacy == InferenceObjective("ml", "interactive", 0, "llama", legacy=True)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"priority": 1}, "spec.poolRef: required"),
        ({"priority": "high", "poolRef": {"name": "llama"}}, "spec.priority: must be an integer"),
        ({"priority": 2**31, "poolRef": {"name": "llama"}}, "spec.priority: must be an integer"),
        ({"priority": True, "poolRef": {"name": "llama"}}, "spec.priority: must be an integer"),
        ({"poolRef": {"kind": "InferencePool"}}, "spec.poolRef.name: required"),
        (None, "spec: required"),
    ],
)
def test_invalid_inference_objective_names_object_and_field(spec: Any, message: str) -> None:
    with pytest.raises(InvalidObject, match=rf"^InferenceObjective ml/interactive: {re.escape(message)}"):
        parse_object(objective(spec))
