"""Credentials as kubectl picks them, and loading them into a client."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.errors import ConfigError
from extproc.kube.client import ConfigOrigin, KubeSettings, api_client, config_origin, error_message

HOME = Path("/home/me")


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        (
            Path("/etc/kc"),
            {"KUBERNETES_SERVICE_HOST": "10.96.0.1"},
            ConfigOrigin("kubeconfig", (Path("/etc/kc"),)),
        ),
        (None, {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBECONFIG": "/x"}, ConfigOrigin("in-cluster")),
        (None, {"KUBECONFIG": "/a:/b"}, ConfigOrigin("kubeconfig", (Path("/a"), Path("/b")))),
        (None, {"KUBECONFIG": ""}, ConfigOrigin("kubeconfig", (HOME / ".kube" / "config",))),
        (None, {}, ConfigOrigin("kubeconfig", (HOME / ".kube" / "config",))),
    ],
    ids=["flag-wins", "in-a-pod", "kubeconfig-list", "empty-env", "home"],
)
def test_config_origin(flag: Path | None, environ: dict[str, str], expected: ConfigOrigin) -> None:
    """--kubeconfig first, then a pod's service account, then $KUBECONFIG, then ~/.kube/config."""
    assert config_origin(flag, environ, HOME) == expected


def test_missing_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    """A kubeconfig that is not there stops serve at start with the path in the message."""
    with pytest.raises(ConfigError, match=r"kubeconfig .*nothere: not found"):
        api_client(KubeSettings(kubeconfig=tmp_path / "nothere"))


def test_broken_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    """A kubeconfig without a usable context is refused with the client's reason."""
    path = tmp_path / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n")
    with pytest.raises(ConfigError, match=str(path)):
        api_client(KubeSettings(kubeconfig=path))


def test_in_cluster_without_a_service_account_is_a_config_error() -> None:
    """In a pod with no mounted token, the error says it was the in-cluster credentials that failed."""
    with pytest.raises(ConfigError, match="in-cluster service account"):
        api_client(
            KubeSettings(), environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
        )


def test_kubeconfig_with_token_and_ca(tmp_path: Path) -> None:
    """A kubeconfig like kubectl's gives a client for its server, with its token (nothing is contacted)."""
    ca = tmp_path / "ca.crt"
    ca.write_text("not checked until a connection is made\n")
    path = tmp_path / "kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:6443", certificate-authority: {ca}}}}}]
users: [{{name: u, user: {{token: secret-token}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""
    )
    client = api_client(KubeSettings(kubeconfig=path))
    try:
        assert client.configuration.host == "https://127.0.0.1:6443"
        assert client.configuration.auth_settings()["BearerToken"]["value"] == "Bearer secret-token"
    finally:
        client.close()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            b'{"kind":"Status","message":"services is forbidden: User \\"x\\" cannot list"}',
            'HTTP 403: services is forbidden: User "x" cannot list',
        ),
        (b"<html>bad gateway</html>", "HTTP 403"),
        (b'{"kind":"Status"}', "HTTP 403"),
    ],
    ids=["status", "not-json", "no-message"],
)
def test_error_message(body: bytes, expected: str) -> None:
    """The API server's own explanation is kept when it sent one."""
    assert error_message(403, body) == expected


def test_settings_reject_a_zero_timeout() -> None:
    """A connect timeout of zero would fail every request."""
    with pytest.raises(ConfigError, match="timeout"):
        KubeSettings(connect_timeout=0)
