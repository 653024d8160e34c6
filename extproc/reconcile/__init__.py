"""The status reconciler sidecar (``extproc reconcile``); see README.md in this folder."""
