"""Kubernetes plumbing shared by ``serve --source kube`` and ``reconcile``: credentials, resource
types and the list + watch :class:`~extproc.kube.reflector.Reflector` (see README.md)."""
