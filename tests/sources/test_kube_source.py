"""Setting up the cluster source: flags, settings, credentials (no API server needed here).

Its behaviour against a real API server is in ``tests/kube/test_source.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from processes import run_extproc

from extproc.errors import ConfigError
from extproc.settings import SourceSettings
from extproc.sources.kube import RESOURCE_TYPES, KubeSource, build_inputs


@pytest.mark.parametrize(
    ("namespaces", "expected"),
    [(None, None), ("ml", ("ml",)), ("ml, prod,", ("ml", "prod"))],
    ids=["all", "one", "list"],
)
def test_kube_source_settings(namespaces: str | None, expected: tuple[str, ...] | None) -> None:
    """``--source kube`` watches all namespaces unless ``--namespaces a,b`` names some."""
    settings = SourceSettings.parse("kube", namespaces=namespaces, kubeconfig=Path("/etc/kc"))
    assert (settings.kind, settings.namespaces, settings.kubeconfig) == ("kube", expected, Path("/etc/kc"))


@pytest.mark.parametrize(
    ("spec", "namespaces", "kubeconfig", "message"),
    [
        ("kube", "Prod", None, "'Prod' is not a namespace name"),
        ("kube", ",", None, "give at least one namespace"),
        ("kube", "a" * 64, None, "is not a namespace name"),
        ("file:/x.yaml", "ml", None, "apply to --source kube only"),
        ("file:/x.yaml", None, Path("/kc"), "apply to --source kube only"),
        ("kubernetes", None, None, "expected file:PATH or kube"),
    ],
    ids=["uppercase", "empty-list", "too-long", "namespaces-with-file", "kubeconfig-with-file", "unknown"],
)
def test_bad_source_settings(
    spec: str, namespaces: str | None, kubeconfig: Path | None, message: str
) -> None:
    """Nonsense is refused at startup with the flag named."""
    with pytest.raises(ConfigError, match=message):
        SourceSettings.parse(spec, namespaces=namespaces, kubeconfig=kubeconfig)


def test_missing_kubeconfig_fails_at_construction(tmp_path: Path) -> None:
    """Credentials are loaded when the source is made, so serve fails at once, not later in a loop."""
    settings = SourceSettings.parse("kube", kubeconfig=tmp_path / "missing")
    with pytest.raises(ConfigError, match="missing: not found"):
        KubeSource(settings)


async def test_serve_with_missing_kubeconfig_exits_2(tmp_path: Path) -> None:
    """``serve --source kube`` with credentials that are not there is a setup error (exit code 2)."""
    code, output = await run_extproc("serve", "--source", "kube", "--kubeconfig", str(tmp_path / "nope"))
    assert code == 2, output
    assert "nope: not found" in output and "Traceback" not in output


def test_watches_worker_sets_services_slices_and_objectives() -> None:
    """The catalog is built from exactly these resource types, in these API versions; a cluster
    without the InferenceObjective CRD is fine (optional)."""
    assert [(r.api_version, r.plural, r.optional) for r in RESOURCE_TYPES] == [
        ("kinference.buoyant.io/v1alpha1", "inferenceworkersets", False),
        ("v1", "services", False),
        ("discovery.k8s.io/v1", "endpointslices", False),
        ("llm-d.ai/v1alpha2", "inferenceobjectives", True),
        ("inference.networking.x-k8s.io/v1alpha2", "inferenceobjectives", True),
    ]


def _ws(name: str, service: str, *, generation: int = 1, version: str = "1", **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ml", "generation": generation, "resourceVersion": version}
    return {
        "kind": "InferenceWorkerSet",
        "metadata": meta,
        "spec": {"serviceRef": {"name": service}},
        **extra,
    }


def _svc(name: str, version: str = "1", namespace: str = "ml") -> dict[str, Any]:
    return {"kind": "Service", "metadata": {"name": name, "namespace": namespace, "resourceVersion": version}}


def _slice(name: str, service: str, version: str = "1") -> dict[str, Any]:
    labels = {"kubernetes.io/service-name": service}
    return {
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ml", "resourceVersion": version, "labels": labels},
    }


def test_status_writes_and_unrelated_services_need_no_build() -> None:
    """The reconciler's status PATCHes and the cluster's other Services do not rebuild the catalog."""
    before = build_inputs([_ws("a", "llama")], [_svc("llama"), _svc("web")], [_slice("web-x", "web")])
    status_only = _ws("a", "llama", version="7", status={"conditions": [{"type": "Ready"}]})
    web_moved = [_svc("llama"), _svc("web", "9"), _svc("llama", "5", namespace="other")]
    assert build_inputs([status_only], web_moved, [_slice("web-x", "web", "9")]) == before


def test_spec_metadata_and_referenced_objects_need_a_build() -> None:
    """A spec change (generation), an annotation, a referenced Service or slice: the catalog may change."""
    objects = ([_ws("a", "llama")], [_svc("llama")], [_slice("llama-x", "llama")])
    before = build_inputs(*objects)
    assert build_inputs([_ws("a", "llama", generation=2)], *objects[1:]) != before
    annotated = _ws("a", "llama")
    annotated["metadata"]["annotations"] = {"kinference.buoyant.io/data-parallel-size": "2"}
    assert build_inputs([annotated], *objects[1:]) != before
    assert build_inputs(objects[0], [_svc("llama", "2")], objects[2]) != before
    assert build_inputs(objects[0], objects[1], [_slice("llama-x", "llama", "2")]) != before


def test_a_new_worker_set_sees_services_that_were_there_before() -> None:
    """Services nobody referred to count as soon as a worker set refers to them."""
    services, slices = [_svc("llama"), _svc("web")], [_slice("web-x", "web")]
    before = build_inputs([_ws("a", "llama")], services, slices)
    after = build_inputs([_ws("a", "llama"), _ws("b", "web")], services, slices)
    assert {key for key in after if key not in before} == {
        ("ws", "ml", "b"),
        ("svc", "ml", "web"),
        ("slice", "ml", "web-x"),
    }
