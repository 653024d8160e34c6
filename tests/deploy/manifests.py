"""Reading the shipped manifests as plain dicts (what kubectl would send)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
EXAMPLES = DEPLOY / "examples"
Manifest = dict[str, Any]


def load(path: Path) -> list[Manifest]:
    """Every document of a YAML file, empty documents skipped."""
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def kustomization_resources(root: Path = DEPLOY) -> list[Path]:
    """The files ``kubectl apply -k ROOT`` applies, in order (directories are kustomizations)."""
    (kustomization,) = load(root / "kustomization.yaml")
    files: list[Path] = []
    for name in kustomization["resources"]:
        path = (root / name).resolve()
        files += kustomization_resources(path) if path.is_dir() else [path]
    return files


def base() -> list[Manifest]:
    """Every object ``kubectl apply -k deploy/`` creates."""
    return [doc for path in kustomization_resources() for doc in load(path)]


def of_kind(docs: Iterable[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc.get("kind") == kind]


def one(docs: Iterable[Manifest], kind: str, name: str | None = None) -> Manifest:
    """The single object of ``kind`` (named ``name`` when given)."""
    found = [d for d in of_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
