"""InferencePools and Pods -> a worker set: which pods are endpoints, one per target port."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.catalog.pools import InferencePool, Pod, join_pool, parse_pod, parse_pool
from extproc.catalog.resources import InvalidObject
from extproc.types import WorkerSetKey


def pool(spec: dict[str, Any] | None = None, **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "llama", "namespace": "ml", "annotations": annotations},
        "spec": spec
        if spec is not None
        else {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
        },
    }


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    deleting: bool = False,
) -> Pod:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ml",
        "labels": {"app": "vllm"} if labels is None else labels,
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T10:00:00Z"
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return parse_pod({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status})


def test_a_pool_with_our_annotations() -> None:
    parsed = parse_pool(
        pool(
            **{
                "kinference.buoyant.io/metrics-port": "9090",
                "kinference.buoyant.io/kv-events-port": "5557",
                "kinference.buoyant.io/kv-replay-port": "5558",
                "kinference.buoyant.io/kv-block-size": "64",
                "kinference.buoyant.io/profile": "h100",
            }
        )
    )
    assert parsed == InferencePool(
        "ml", "llama", (("app", "vllm"),), (8000, 8001), "h100", 64, 9090, 5557, 5558, None
    )
    assert parsed.label_selector == "app=vllm"
    plain = parse_pool(pool())
    assert (plain.profile, plain.kv_block_size, plain.metrics_port, plain.kv_events_port) == (
        "default",
        16,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"targetPorts": [{"number": 8000}]}, "spec.selector: required"),
        (
            {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},
            "spec.selector.matchLabels: must select",
        ),
        (
            {"selector": {"matchLabels": {"a": "b"}, "matchExpressions": []}, "targetPorts": [{"number": 1}]},
            "spec.selector.matchExpressions: is not supported",
        ),
        ({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}, "spec.targetPorts: must list"),
        (
            {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]},
            "spec.targetPorts[0].number",
        ),
        (
            {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 80}, {"number": 80}]},
            "spec.targetPorts[1].number: 80 is listed twice",
        ),
        (
            {"selector": {"matchLabels": {"a": 1}}, "targetPorts": [{"number": 80}]},
            "spec.selector.matchLabels[a]",
        ),
    ],
)
def test_a_bad_pool_names_the_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidObject) as info:
        parse_pool(pool(spec))
    assert str(info.value).startswith(f"InferencePool ml/llama: {message}"), str(info.value)


def test_a_bad_annotation_names_it() -> None:
    with pytest.raises(InvalidObject, match=r"kinference.buoyant.io/kv-block-size\]: must be a whole number"):
        parse_pool(pool(**{"kinference.buoyant.io/kv-block-size": "sixteen"}))


def test_endpoints_are_ready_matching_pods_with_an_ip_once_per_target_port() -> None:
    parsed = parse_pool(pool(**{"kinference.buoyant.io/metrics-port": "9090"}))
    pods = [
        pod("a", "10.0.0.1"),
        pod("b", "10.0.0.2", ready=False),
        pod("c", None),
        pod("d", "10.0.0.4", labels={"app": "other"}),
        pod("e", "10.0.0.5", deleting=True),  # Ready, but being deleted
        pod("f", "fd00::6"),
    ]
    ws = join_pool(parsed, pods)
    assert ws.key == WorkerSetKey("ml/llama")
    assert [e.address for e in ws.endpoints] == [
        "10.0.0.1:8000",
        "10.0.0.1:8001",
        "[fd00::6]:8000",
        "[fd00::6]:8001",
    ]
    assert {e.metrics_port for e in ws.endpoints} == {9090}
    assert ws.endpoints[0].pod == "a"
    assert ws.terminating == 2
    assert ws.discovery_mode == "Endpoint" and ws.models == ()
    assert ws.problems == ()


def test_a_pool_without_endpoints_says_so() -> None:
    ws = join_pool(parse_pool(pool()), [pod("b", ready=False)])
    assert ws.endpoints == ()
    assert ws.problems == ("InferencePool ml/llama has no Ready pod with an IP matching its selector",)
