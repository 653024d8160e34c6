"""The reconciler's writes to the Kubernetes API: a worker set's ``/status``, and its Lease.

Like :mod:`extproc.kube.client` (whose credentials and connection pool it borrows), requests go
out as raw JSON, and answers come back as plain dicts. Every call blocks: run it in a thread.
Failures become :class:`~extproc.errors.KubeApiError` with the HTTP status (0: no answer), so the
caller decides: 404 the object is gone, 409 someone else changed it, 422 the server refuses it.
"""

from __future__ import annotations

import json
from typing import Any

import urllib3

from extproc.errors import KubeApiError
from extproc.kube.client import error_message
from extproc.kube.resources import LEASES, WORKER_SETS
from extproc.kube.wire import json_object
from extproc.reconcile.lease import LeaseConflict

#: Seconds a request may take in all by default. The reconciler passes the leader's write budget
#: (:attr:`~extproc.reconcile.lease.LeaderElector.write_timeout`): a write must not land after a
#: takeover.
TIMEOUT = 5.0

MERGE_PATCH = "application/merge-patch+json"


def request_json(
    api: Any,
    method: str,
    path: str,
    *,
    body: Any = None,
    content_type: str = "application/json",
    timeout: float = TIMEOUT,
) -> dict[str, Any]:
    """Send one request with a JSON body; the JSON answer, or KubeApiError (blocking)."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    method, url, headers, serialized, _ = api.param_serialize(
        method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
    )
    try:
        # The client's own pool (TLS, proxy), but one bounded try: urllib3's default retries
        # would let a write land long after the caller gave up on it.
        response = api.rest_client.pool_manager.request(
            method,
            url,
            headers=headers,
            body=None if serialized is None else json.dumps(serialized).encode(),
            timeout=urllib3.Timeout(total=timeout),
            retries=False,
        )
        data = response.data
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise KubeApiError(0, f"{method} {path}: no answer: {exc}") from exc
    if not 200 <= response.status < 300:
        raise KubeApiError(response.status, f"{method} {path}: {error_message(response.status, data)}")
    return json_object(data, f"answer to {method} {path}")


def patch_status(
    api: Any, namespace: str, name: str, patch: dict[str, Any], *, timeout: float = TIMEOUT
) -> dict[str, Any]:
    """Merge-patch one InferenceWorkerSet's status subresource; the object as the server kept it."""
    path = WORKER_SETS.path(namespace, name) + "/status"
    return request_json(api, "PATCH", path, body=patch, content_type=MERGE_PATCH, timeout=timeout)


class KubeLeaseStore:
    """One Lease, read and written with optimistic concurrency (a :class:`LeaseStore`)."""

    def __init__(self, api: Any, *, namespace: str, name: str, timeout: float = TIMEOUT) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self.timeout = timeout

    def get(self) -> dict[str, Any] | None:
        try:
            return request_json(
                self._api, "GET", LEASES.path(self.namespace, self.name), timeout=self.timeout
            )
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": LEASES.api_version,
            "kind": LEASES.kind,
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": spec,
        }
        try:
            return request_json(
                self._api, "POST", LEASES.path(self.namespace), body=body, timeout=self.timeout
            )
        except KubeApiError as exc:
            if exc.status == 409:
                raise LeaseConflict(exc.message) from exc
            raise

    def replace(self, spec: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        body = {"apiVersion": LEASES.api_version, "kind": LEASES.kind, "metadata": metadata, "spec": spec}
        try:
            return request_json(
                self._api, "PUT", LEASES.path(self.namespace, self.name), body=body, timeout=self.timeout
            )
        except KubeApiError as exc:
            if exc.status in (404, 409):  # deleted or changed since we read it
                raise LeaseConflict(exc.message) from exc
            raise
