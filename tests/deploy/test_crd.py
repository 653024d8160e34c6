"""The committed InferenceWorkerSet CRD: generated from the shared schema, and what kubectl users see."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from .manifests import DEPLOY, ROOT, kustomization_resources, load

CRD_PATH = DEPLOY / "crds" / "kinference.buoyant.io_inferenceworkersets.yaml"
SCHEMA_COPY = DEPLOY / "schema" / "inferenceworkerset.schema.json"
SHARED_SCHEMA = ROOT.parent / "shared" / "spec" / "inferenceworkerset.schema.json"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_crd", ROOT / "scripts" / "gen_crd.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return _generator()


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    (doc,) = load(CRD_PATH)
    return doc


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    versions: list[dict[str, Any]] = crd["spec"]["versions"]
    assert len(versions) == 1
    return versions[0]


def _schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object under ``node`` (not field-name maps), with a readable path."""
    yield path or ".", node
    for name, sub in node.get("properties", {}).items():
        yield from _schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{path}[]")


def test_committed_crd_is_what_the_generator_writes(gen: ModuleType) -> None:
    """The CRD is regenerated from the schema copy byte for byte (run scripts/gen_crd.py if not)."""
    assert CRD_PATH.read_text(encoding="utf-8") == gen.render(gen.load_schema(SCHEMA_COPY)), (
        "deploy/crds CRD is stale: run python scripts/gen_crd.py"
    )


@pytest.mark.skipif(not SHARED_SCHEMA.exists(), reason="../shared/spec is not checked out next to the repo")
def test_schema_copy_matches_the_shared_spec() -> None:
    """The in-repo schema is the shared spec, unchanged (copy it again if the spec moved)."""
    assert json.loads(SCHEMA_COPY.read_text()) == json.loads(SHARED_SCHEMA.read_text())


def test_crd_keeps_every_field_limit_and_default_of_the_schema(gen: ModuleType, crd: dict[str, Any]) -> None:
    """Only JSON-Schema bookkeeping keys are dropped; everything else is the spec's."""
    schema = json.loads(SCHEMA_COPY.read_text())
    for key in gen.JSON_SCHEMA_ONLY_KEYS:
        schema.pop(key, None)
    assert _version(crd)["schema"]["openAPIV3Schema"] == schema


def test_no_json_schema_only_keys_anywhere(gen: ModuleType, crd: dict[str, Any]) -> None:
    """An API server rejects $schema/$id/title/x-* bookkeeping keys in a CRD schema."""
    root = _version(crd)["schema"]["openAPIV3Schema"]
    bad = [(p, k) for p, node in _schema_nodes(root) for k in node if k in gen.JSON_SCHEMA_ONLY_KEYS]
    assert bad == []


def test_every_schema_node_is_structural(crd: dict[str, Any]) -> None:
    """Each node has a type (or is int-or-string): what apiextensions/v1 calls a structural schema."""
    root = _version(crd)["schema"]["openAPIV3Schema"]
    untyped = [
        p
        for p, node in _schema_nodes(root)
        if "type" not in node and not node.get("x-kubernetes-int-or-string")
    ]
    assert untyped == []


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"title": "t", "type": "object"}, {"type": "object"}),
        (
            {"type": "object", "properties": {"title": {"type": "string", "$id": "x"}}},
            {"type": "object", "properties": {"title": {"type": "string"}}},
        ),
        (
            {"type": "array", "items": {"x-source": "s", "type": "string", "maxLength": 3}},
            {"type": "array", "items": {"type": "string", "maxLength": 3}},
        ),
    ],
    ids=["top-level-title", "field-named-title-kept", "inside-items"],
)
def test_generator_strips_keywords_not_field_names(
    gen: ModuleType, schema: dict[str, Any], expected: dict[str, Any]
) -> None:
    """Bookkeeping keywords go at every depth; a field that happens to be called `title` stays."""
    assert gen.openapi_schema(schema) == expected


def test_names_scope_and_status_subresource(crd: dict[str, Any]) -> None:
    """`kubectl get iws` works, objects are namespaced, and status has its own subresource."""
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferenceworkersets.kinference.buoyant.io"
    assert spec["group"] == "kinference.buoyant.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferenceWorkerSet"
    assert spec["names"]["plural"] == "inferenceworkersets"
    assert "iws" in spec["names"]["shortNames"]
    assert spec["names"]["categories"]
    version = _version(crd)
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_printer_columns(crd: dict[str, Any]) -> None:
    """The default columns are the ones an operator wants at a glance, from simple JSON paths."""
    columns = {c["name"]: c for c in _version(crd)["additionalPrinterColumns"]}
    default = [name for name, c in columns.items() if c.get("priority", 0) == 0]
    assert default == ["Profile", "Ready", "Model", "KV", "State", "Age"]
    assert columns["Ready"]["jsonPath"] == ".status.endpoints.ready"
    assert columns["KV"]["jsonPath"] == ".status.kvEvents.subscribedEndpoints"
    assert columns["State"]["jsonPath"] == ".status.state"
    assert columns["Age"]["type"] == "date"
    assert all("*" not in c["jsonPath"] and "?" not in c["jsonPath"] for c in columns.values())


def test_kustomization_installs_the_crd() -> None:
    """`kubectl apply -k deploy/` creates the CRD along with the router."""
    assert CRD_PATH in kustomization_resources()


def test_crd_folder_holds_only_crds() -> None:
    """`kubectl apply -f deploy/crds/` (and the kube test fixture) must find nothing but CRDs there."""
    files = sorted((DEPLOY / "crds").iterdir())
    assert files == [CRD_PATH]
    assert [doc["kind"] for doc in load(CRD_PATH)] == ["CustomResourceDefinition"]
