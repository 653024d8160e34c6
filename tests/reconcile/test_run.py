"""``extproc reconcile`` flags and the pod's environment -> settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from processes import run_extproc

from extproc.cli import build_parser
from extproc.errors import ConfigError
from extproc.reconcile.run import reconcile_settings
from extproc.settings import ReconcileSettings, SourceSettings


def settings(*flags: str, environ: dict[str, str] | None = None) -> ReconcileSettings:
    return reconcile_settings(build_parser().parse_args(["reconcile", *flags]), environ or {})


def test_the_pods_name_and_namespace_are_the_defaults() -> None:
    """In a pod, the downward API's POD_NAME and POD_NAMESPACE name the replica and its Lease."""
    got = settings(environ={"POD_NAME": "router-7f9-abc", "POD_NAMESPACE": "inference"})
    assert (got.identity, got.lease_namespace, got.lease_name) == (
        "router-7f9-abc",
        "inference",
        "extproc-reconciler",
    )
    assert got.namespaces is None
    assert got.serve_admin == "http://127.0.0.1:9090"


def test_flags_win_over_the_environment() -> None:
    """Explicit flags are used as given; namespaces are a comma-separated list."""
    got = settings(
        "--identity", "r1", "--lease-namespace", "ops", "--namespaces", "a, b", "--resync-interval", "10",
        environ={"POD_NAME": "pod", "POD_NAMESPACE": "ns"},
    )  # fmt: skip
    assert (got.identity, got.lease_namespace, got.namespaces, got.resync_interval) == (
        "r1",
        "ops",
        ("a", "b"),
        10,
    )


def test_outside_a_pod_the_lease_is_in_default() -> None:
    """Without POD_NAMESPACE the Lease lives in the default namespace; the host name is the identity."""
    got = settings()
    assert got.lease_namespace == "default" and got.identity


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"identity": ""}, "--identity"),
        ({"serve_admin": "127.0.0.1:9090"}, "--serve-admin"),
        ({"namespaces": ("a", "")}, "--namespaces"),
        ({"resync_interval": 0}, "--resync-interval"),
        ({"lease_duration": 6, "renew_interval": 5}, "--lease-renew-interval"),
        ({"admin_listen": "nowhere"}, "--admin-listen"),
    ],
    ids=["identity", "serve-url", "empty-namespace", "resync", "renew-vs-duration", "admin-address"],
)
def test_invalid_settings_name_the_flag(changes: dict[str, Any], flag: str) -> None:
    """Each bad value is refused with the flag to fix."""
    with pytest.raises(ConfigError, match=flag):
        ReconcileSettings(**{"identity": "r1", **changes})


async def test_bad_flags_exit_with_code_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command refuses bad flags before touching the cluster, naming the flag."""
    monkeypatch.setenv("KUBECONFIG", os.devnull)
    code, output = await run_extproc("reconcile", "--lease-duration", "3", "--lease-renew-interval", "5")
    assert code == 2
    assert "--lease-renew-interval" in output


async def test_missing_credentials_exit_with_code_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a usable kubeconfig the sidecar says where it looked and exits 2."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    missing = tmp_path / "nope"
    code, output = await run_extproc("reconcile", "--kubeconfig", str(missing), "--identity", "r1")
    assert code == 2
    assert str(missing) in output


@pytest.mark.parametrize("text", ["a,,b", " a , b ,"])
def test_namespaces_parse_as_serve_parses_them(text: str) -> None:
    """Blanks between commas are dropped, as `serve --namespaces` drops them; one parser for both."""
    assert settings("--identity", "r1", "--namespaces", text).namespaces == ("a", "b")
    assert SourceSettings.parse("kube", namespaces=text).namespaces == ("a", "b")


def test_bad_namespace_names_are_refused_like_serves() -> None:
    """A name that is no RFC 1123 label is refused by both commands alike."""
    with pytest.raises(ConfigError, match="RFC 1123"):
        settings("--identity", "r1", "--namespaces", "Bad_Name")


def test_serve_timeout_flag() -> None:
    """--serve-timeout bounds one read of serve."""
    assert settings("--identity", "r1", "--serve-timeout", "0.5").serve_timeout == 0.5
