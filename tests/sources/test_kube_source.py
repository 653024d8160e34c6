"""Setting up the cluster source: flags, settings, credentials (no API server needed here).

Its behaviour against a real API server is in ``tests/kube/test_source.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from processes import run_extproc

from extproc.errors import ConfigError
from extproc.settings import SourceSettings
from extproc.sources.kube import RESOURCE_TYPES, KubeSource


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


def test_watches_worker_sets_services_and_slices() -> None:
    """The catalog is built from exactly these three resource types, in these API versions."""
    assert [(r.api_version, r.plural) for r in RESOURCE_TYPES] == [
        ("kinference.buoyant.io/v1alpha1", "inferenceworkersets"),
        ("v1", "services"),
        ("discovery.k8s.io/v1", "endpointslices"),
    ]
