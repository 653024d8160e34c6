"""Regenerate ``extproc/pb`` from ``protos/`` with the pinned grpcio-tools.

Run from the repository root: ``python scripts/gen_protos.py``. The output is committed (so a
plain ``pip install`` needs no code generator); ``tests/protos/test_generated.py`` regenerates into
a temporary folder and fails when the committed files are stale.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = Path("extproc") / "pb"


def generate(proto_root: Path, out_root: Path) -> list[Path]:
    """Compile every ``.proto`` under ``proto_root`` into ``out_root``; return the files written."""
    from grpc_tools import protoc

    protos = sorted(p.relative_to(proto_root).as_posix() for p in proto_root.rglob("*.proto"))
    include = str(resources.files("grpc_tools") / "_proto")
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    written = sorted(p for p in (out_root / PACKAGE_DIR).rglob("*") if p.is_file())
    # Generated modules import each other as packages: make every folder a regular package.
    for folder in sorted({p.parent for p in written}):
        while folder != out_root / "extproc":
            init = folder / "__init__.py"
            if not init.exists():
                init.write_text("")
                written.append(init)
            folder = folder.parent
    return sorted(written)


if __name__ == "__main__":
    files = generate(PROTO_ROOT, ROOT)
    print(f"{len(files)} files under {PACKAGE_DIR}", file=sys.stderr)
