"""The ``extproc reconcile`` flags -> :class:`~extproc.settings.ReconcileSettings` -> the sidecar.

Defaults that depend on where it runs (a pod's name and namespace from the downward API) are read
here, from the environment, and nowhere below.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from extproc.flags import flag_values, setting_flag
from extproc.settings import ReconcileSettings, parse_namespaces


def add_reconcile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``extproc reconcile`` to the CLI; :func:`run_reconcile` is its handler."""
    p = sub.add_parser(
        "reconcile",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="run the status reconciler sidecar (writes InferenceWorkerSet status; leader-elected)",
        description="Keeps the status of every InferenceWorkerSet true: endpoints, models and context "
        "windows, KV-event subscriptions, referencing HTTPRoutes, conditions. Runs beside `extproc serve` "
        "and reads its /debug/worker-sets; one replica writes at a time (a coordination.k8s.io Lease).",
    )
    p.add_argument(
        "--kubeconfig", type=Path, default=None, help="kubeconfig (default: in-cluster, $KUBECONFIG)"
    )
    p.add_argument(
        "--namespaces", default="", help="comma-separated namespaces to reconcile (default: all namespaces)"
    )
    s = ReconcileSettings
    setting_flag(p, "--serve-admin", s, "serve_admin", "serve's admin URL")
    setting_flag(p, "--serve-poll-interval", s, "serve_poll_interval", "seconds between reads of serve")
    setting_flag(p, "--serve-timeout", s, "serve_timeout", "seconds one read of serve may take")
    setting_flag(p, "--lease-name", s, "lease_name", "Lease name")
    p.add_argument(
        "--lease-namespace", default=None, help="Lease namespace (default: $POD_NAMESPACE, else default)"
    )
    setting_flag(p, "--lease-duration", s, "lease_duration", "seconds a lease lasts unrenewed")
    setting_flag(p, "--lease-renew-interval", s, "renew_interval", "seconds between renewals")
    setting_flag(p, "--lease-retry-interval", s, "retry_interval", "seconds between tries to lead")
    p.add_argument(
        "--identity", default=None, help="this replica in the Lease (default: $POD_NAME, else hostname)"
    )
    setting_flag(p, "--admin-listen", s, "admin_listen", "/healthz, /metrics, /debug/state")
    setting_flag(p, "--resync-interval", s, "resync_interval", "seconds between full passes")
    p.set_defaults(handler=run_reconcile)


def reconcile_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> ReconcileSettings:
    """Flags (and the pod's environment for two defaults) -> validated settings."""
    # An empty --namespaces means all, as leaving it out does.
    namespaces = parse_namespaces(args.namespaces or None)
    return ReconcileSettings(
        **flag_values(args, ReconcileSettings),
        identity=args.identity or environ.get("POD_NAME") or socket.gethostname(),
        kubeconfig=args.kubeconfig,
        namespaces=namespaces,
        lease_namespace=args.lease_namespace or environ.get("POD_NAMESPACE") or "default",
    )


async def run_reconcile(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Run the sidecar until ``stop`` is set (ConfigError for bad flags or credentials)."""
    from extproc.kube.client import KubeSettings, api_client
    from extproc.reconcile.controller import Reconciler

    settings = reconcile_settings(args, os.environ)
    api = await asyncio.to_thread(api_client, KubeSettings(kubeconfig=settings.kubeconfig))
    try:
        await Reconciler(settings, api).run(stop)
    finally:
        api.close()  # type: ignore[no-untyped-call]
