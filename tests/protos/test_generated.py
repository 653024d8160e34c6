"""The committed generated code in extproc/pb matches what protos/ compiles to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    """Regenerating from protos/ gives byte-identical files (run scripts/gen_protos.py if not)."""
    gen = _generator()
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in gen.generate(ROOT / "protos", tmp_path)}
    committed = {
        p.relative_to(ROOT): p.read_bytes()
        for p in (ROOT / "extproc" / "pb").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sorted(map(str, fresh)) == sorted(map(str, committed)), "files differ: run scripts/gen_protos.py"
    stale = [str(path) for path, data in fresh.items() if committed[path] != data]
    assert not stale, f"stale generated files (run scripts/gen_protos.py): {stale}"
