"""The repository stays a house a newcomer can live in: a README read in one sitting, no large files
in git, every benchmark module named where a maintainer looks for it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout: {exc}")
    return [REPO / name for name in out.decode().split("\0") if name]


def test_the_readme_reads_in_one_sitting() -> None:
    """The README is a front door of at most 300 lines; depth lives in docs/."""
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move depth to docs/"


def test_no_large_files_are_tracked() -> None:
    """No tracked file over 1 MB and at most 20 MB in all: raw outputs go to bench/results/raw/."""
    sizes = {p: p.stat().st_size for p in _tracked() if p.is_file()}
    large = sorted(str(p.relative_to(REPO)) for p, size in sizes.items() if size > 1_000_000)
    assert not large, f"tracked files over 1 MB: {large}"
    assert sum(sizes.values()) <= 20_000_000


def test_every_bench_module_is_named_in_a_bench_readme() -> None:
    """A maintainer finds every benchmark module in a README under bench/."""
    readmes = "\n".join(p.read_text() for p in (REPO / "bench").rglob("README.md"))
    unnamed = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "bench").rglob("*.py"))
        if p.name not in readmes and str(p.relative_to(REPO / "bench")) not in readmes
    ]
    assert not unnamed, f"name these in a README under bench/: {unnamed}"
