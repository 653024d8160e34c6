"""The shipped tokenizer is exactly what scripts/make_tokenizer.py produces, and has the promised shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.tokenize import Tokenizer, shipped_template, shipped_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]


def test_regenerating_gives_identical_files(tmp_path: Path) -> None:
    """A fresh run of the script writes byte-identical files (run scripts/make_tokenizer.py if not)."""
    # A child process: the single-thread setting must precede the first `import tokenizers`.
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tokenizer.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    shipped = shipped_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), f"{name} is stale"


def test_files_are_small() -> None:
    """tokenizer.json stays under 1 MB so it ships in the wheel without weight."""
    assert (shipped_tokenizer_dir() / "tokenizer.json").stat().st_size < 1_000_000


@pytest.mark.parametrize(("token_id", "token"), list(enumerate(SPECIALS)), ids=SPECIALS)
def test_special_token_ids_are_fixed(token_id: int, token: str) -> None:
    """Special tokens sit at fixed ids 0..7, in the documented order, marked special."""
    tok = Tokenizer.from_dir(shipped_tokenizer_dir())
    assert tok.token_to_id(token) == token_id
    assert token_id in tok.all_special_ids


def test_config_matches_hf_layout() -> None:
    """tokenizer_config.json names BOS/EOS, the context length and embeds the llama3 template."""
    config = json.loads((shipped_tokenizer_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|eot_id|>"
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert config["model_max_length"] == 131072
    assert config["chat_template"] == shipped_template("llama3").read_text(encoding="utf-8")
    assert [config["added_tokens_decoder"][str(i)]["content"] for i in range(len(SPECIALS))] == SPECIALS


def test_vocab_size_in_range() -> None:
    """The vocabulary is small (fast, small files) but large enough to look like a real BPE."""
    assert 4000 <= Tokenizer.from_dir(shipped_tokenizer_dir()).vocab_size <= 8000
