"""The real Llama 3 and Qwen 3 tokenizers for tests, fetched (pinned, cached) on first use.

``bash scripts/check`` fetches them before the tests run; a test run on its own fetches what is
missing. A machine that cannot fetch them fails the tests that need them, saying why.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from fetch_tokenizers import FetchError, ensure


def real_tokenizer(name: str) -> Path:
    """The folder of the pinned ``llama3`` or ``qwen3`` tokenizer (``--tokenizer MODEL=FOLDER``)."""
    try:
        return ensure(name)
    except FetchError as exc:
        pytest.fail(f"the real {name} tokenizer is not available: {exc}")
