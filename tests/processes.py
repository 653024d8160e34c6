"""Checks on processes tests started (shared by the demo and Envoy tests)."""

from __future__ import annotations

import os


def pid_gone(pid: int) -> bool:
    """True once no process has ``pid`` (signal 0 checks existence without signalling)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
