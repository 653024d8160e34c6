"""The ``kube_env`` fixture: one real etcd + kube-apiserver per test session (see kubeenv.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .kubeenv import KubeEnv


@pytest.fixture(scope="session")
def kube_env() -> Iterator[KubeEnv]:
    env = KubeEnv()
    try:
        env.start()
        yield env
    finally:
        env.stop()


@pytest.fixture
def namespace(kube_env: KubeEnv) -> str:
    """A fresh namespace for one test."""
    return kube_env.new_namespace()
