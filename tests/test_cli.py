"""``extproc serve`` as a user runs it: a real process, real signals, clear errors."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from ports import free_port
from processes import run_extproc
from prometheus_client import CollectorRegistry

from extproc.admin import admin_app, start_admin
from extproc.scheduling.profiles import Profile, parse_profiles, render_profiles

DATA = Path(__file__).resolve().parent / "data" / "catalog.yaml"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--source", "file:/nonexistent/catalog.yaml"], 1, "/nonexistent/catalog.yaml"),
        (["--source", "http://x"], 2, "--source: expected file:PATH"),
        (["--source", f"file:{DATA}", "--listen", "nonsense"], 2, "--listen: expected HOST:PORT"),
        (["--source", f"file:{DATA}", "--max-fallbacks", "-1"], 2, "--max-fallbacks must be 0 or more"),
        (["--source", f"file:{DATA}", "--tokenize-threads", "-1"], 2, "--tokenize-threads must be 0"),
        (
            ["--source", f"file:{DATA}", "--tokenize-budget-ms", "0"],
            2,
            "--tokenize-budget-ms must be positive",
        ),
        (["--source", f"file:{DATA}", "--tokenize-queue", "0"], 2, "--tokenize-queue must be at least 1"),
        (
            [
                *("--source", f"file:{DATA}", "--listen", "127.0.0.1:9", "--workers", "2"),
                *("--peer-listen", "127.0.0.1:0", "--peers", "127.0.0.2:9003"),
            ],
            2,
            "the workers publish on 2 ports from the one given, which must be fixed (not 0)",
        ),
    ],
    ids=[
        "missing-file",
        "bad-source",
        "bad-listen",
        "bad-fallbacks",
        "threads",
        "budget",
        "queue",
        "workers",
    ],
)
async def test_serve_refuses_bad_setup_clearly(args: list[str], code: int, message: str) -> None:
    """Bad flags or an unreadable source exit non-zero with a message naming the problem."""
    returncode, output = await run_extproc("serve", *args)
    assert returncode == code, output
    assert message in output
    assert "Traceback" not in output


async def test_peer_key_prints_a_key_serve_accepts(tmp_path: Path) -> None:
    """``extproc peer-key > FILE`` makes a key file ``--peer-key-file`` reads (a Kubernetes Secret's)."""
    from extproc.peers.curve import read_key

    code, output = await run_extproc("peer-key")
    assert code == 0, output
    key = tmp_path / "key"
    key.write_text(output)
    assert read_key(key).secret == output.strip().encode()
    second = await run_extproc("peer-key")
    assert second[1] != output, "a new key each time"


async def test_serve_runs_and_stops_on_sigterm() -> None:
    """serve becomes ready on its admin port and exits 0 on SIGTERM."""
    admin = free_port()
    args = ["serve", "--source", f"file:{DATA}", "--listen", f"127.0.0.1:{free_port()}"]
    args += ["--admin-listen", f"127.0.0.1:{admin}", "--drain-seconds", "0"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "extproc",
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("serve never became ready")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_fitted_profiles_prints_what_serve_fitted_as_a_profiles_file() -> None:
    """``extproc fitted-profiles`` reads a running serve's ``/debug/profiles`` and prints it as is."""
    fitted = render_profiles({"h100": Profile(prefill_tokens_per_s=12_345.5)}, {"h100": "fitted on x"})
    app = admin_app(registry=CollectorRegistry(), state=dict, profiles=lambda: fitted)
    runner, port = await start_admin(app, "127.0.0.1:0")
    try:
        returncode, output = await run_extproc("fitted-profiles", "--admin", f"127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    assert returncode == 0, output
    assert output == fitted
    assert parse_profiles(yaml.safe_load(output))["h100"].prefill_tokens_per_s == 12_345.5


async def test_fitted_profiles_says_when_nothing_answers() -> None:
    returncode, output = await run_extproc("fitted-profiles", "--admin", f"127.0.0.1:{free_port()}")
    assert returncode == 1
    assert "cannot read http://127.0.0.1:" in output and "is serve running there?" in output
    assert "Traceback" not in output


def test_flags_left_out_give_the_settings_defaults() -> None:
    """`extproc serve` with no optional flag runs with exactly the settings' own defaults (one place
    states each default; the flags and the generated reference read it from there)."""
    import dataclasses

    from extproc.cli import build_parser
    from extproc.scheduling.registry import DEFAULT_POLICY
    from extproc.serve.run import serve_settings
    from extproc.settings import PrefixSettings, ServeSettings, SourceSettings

    args = build_parser().parse_args(["serve", "--source", "kube"])
    settings = serve_settings(args)
    assert settings.prefix == PrefixSettings()
    # The settings leave the policy to the registry; the flag names the registry's one default.
    assert settings.policy == DEFAULT_POLICY
    assert dataclasses.replace(settings, policy=None) == ServeSettings(source=SourceSettings.parse("kube"))
