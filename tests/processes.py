"""Checks on processes tests started (shared by the demo and Envoy tests)."""

from __future__ import annotations

import asyncio
import os
import sys


def pid_gone(pid: int) -> bool:
    """True once no process has ``pid`` (signal 0 checks existence without signalling)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def run_extproc(*args: str, timeout: float = 20.0) -> tuple[int, str]:  # noqa: ASYNC109
    """Run ``python -m extproc ARGS`` to completion; (exit code, stdout and stderr together)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode()
