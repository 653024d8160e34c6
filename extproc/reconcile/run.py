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

from extproc.settings import ReconcileSettings, parse_namespaces

#: Where the flags take their defaults from (the identity has none: see reconcile_settings).
_DEFAULTS = ReconcileSettings(identity="-")


def add_reconcile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``extproc reconcile`` to the CLI; :func:`run_reconcile` is its handler."""
    d = _DEFAULTS
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
    p.add_argument("--serve-admin", default=d.serve_admin, help="serve's admin URL")
    p.add_argument(
        "--serve-poll-interval",
        type=float,
        default=d.serve_poll_interval,
        help="seconds between reads of serve",
    )
    p.add_argument(
        "--serve-timeout",
        type=float,
        default=d.serve_timeout,
        help="seconds one read of serve may take",
    )
    p.add_argument("--lease-name", default=d.lease_name, help="Lease name")
    p.add_argument(
        "--lease-namespace", default=None, help="Lease namespace (default: $POD_NAMESPACE, else default)"
    )
    p.add_argument(
        "--lease-duration",
        type=float,
        default=d.lease_duration,
        help="seconds a lease lasts unrenewed",
    )
    p.add_argument(
        "--lease-renew-interval",
        type=float,
        default=d.renew_interval,
        help="seconds between renewals",
    )
    p.add_argument(
        "--lease-retry-interval",
        type=float,
        default=d.retry_interval,
        help="seconds between tries to lead",
    )
    p.add_argument(
        "--identity", default=None, help="this replica in the Lease (default: $POD_NAME, else hostname)"
    )
    p.add_argument("--admin-listen", default=d.admin_listen, help="/healthz, /metrics, /debug/state")
    p.add_argument(
        "--resync-interval",
        type=float,
        default=d.resync_interval,
        help="seconds between full passes",
    )
    p.set_defaults(handler=run_reconcile)


def reconcile_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> ReconcileSettings:
    """Flags (and the pod's environment for two defaults) -> validated settings."""
    # An empty --namespaces means all, as leaving it out does.
    namespaces = parse_namespaces(args.namespaces or None)
    return ReconcileSettings(
        identity=args.identity or environ.get("POD_NAME") or socket.gethostname(),
        kubeconfig=args.kubeconfig,
        namespaces=namespaces,
        serve_admin=args.serve_admin,
        serve_poll_interval=args.serve_poll_interval,
        serve_timeout=args.serve_timeout,
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace or environ.get("POD_NAMESPACE") or "default",
        lease_duration=args.lease_duration,
        renew_interval=args.lease_renew_interval,
        retry_interval=args.lease_retry_interval,
        admin_listen=args.admin_listen,
        resync_interval=args.resync_interval,
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
