"""Tokenizer loading and encoding: what the router and the simulator see from a tokenizer folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from extproc.errors import BadRequest, ConfigError
from extproc.tokenize import (
    TokenIdError,
    Tokenizer,
    TokenizerError,
    default_hf_cache,
    shipped_tokenizer,
    shipped_tokenizer_dir,
    tokenize_prompt,
)

BOS, EOT = 0, 4
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return shipped_tokenizer()


def _copy_shipped(dest: Path, *, config: Mapping[str, object] | None = None) -> Path:
    """A tokenizer folder with the shipped tokenizer.json and an optional tokenizer_config.json."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(shipped_tokenizer_dir() / "tokenizer.json", dest / "tokenizer.json")
    if config is not None:
        (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return dest


@pytest.mark.parametrize(("add", "starts_with_bos"), [(True, True), (False, False)], ids=["with", "without"])
def test_bos_only_with_add_special_tokens(tok: Tokenizer, add: bool, starts_with_bos: bool) -> None:
    """BOS is prepended exactly when add_special_tokens is true, and never EOS."""
    ids = tok.encode("Hello world", add_special_tokens=add)
    assert (ids[0] == BOS) is starts_with_bos
    assert ids.count(BOS) == int(starts_with_bos)
    assert ids[-1] != tok.eos_token_id


def test_completion_prompt_gets_bos(tok: Tokenizer) -> None:
    """tokenize_prompt (completions) adds BOS, like vLLM's default for /v1/completions."""
    assert tokenize_prompt(tok, "Hi") == [BOS, *tok.encode("Hi", add_special_tokens=False)]


@pytest.mark.parametrize(
    ("token", "token_id"),
    [
        ("<|begin_of_text|>", 0),
        ("<|end_of_text|>", 1),
        ("<|start_header_id|>", 2),
        ("<|end_header_id|>", 3),
        ("<|eot_id|>", 4),
        ("<|im_start|>", 5),
        ("<|im_end|>", 6),
        ("<|endoftext|>", 7),
    ],
    ids=lambda v: str(v),
)
def test_special_tokens_are_single_ids(tok: Tokenizer, token: str, token_id: int) -> None:
    """A special token written in text encodes to its one id, also amid other text."""
    assert tok.encode(token, add_special_tokens=False) == [token_id]
    ids = tok.encode(f"a{token}b", add_special_tokens=False)
    assert ids.count(token_id) == 1 and len(ids) == 3


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The cache router picks an endpoint.",
        "café naïve Zürich Ångström crème brûlée",
        "東京 北京 こんにちは 서울 Привет مرحبا",
        "emoji 🙂🚀 and a family 👨‍👩‍👧 and a flag 🇫🇷",
        'def f(x):\n    return {"a": [1, 2, 3]}\n\t\ttabs  and   spaces ',
        "rare bytes: \u0000\u0007 \U0001f9ec \u2603 ℵ",
        "",
    ],
    ids=["ascii", "accents", "cjk-cyrillic-arabic", "emoji", "code-whitespace", "rare-bytes", "empty"],
)
def test_decode_round_trips(tok: Tokenizer, text: str) -> None:
    """decode(encode(text)) gives the text back, byte-level fallback included; BOS is skipped."""
    ids = tok.encode(text, add_special_tokens=True)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_token_strs_match_ids(tok: Tokenizer) -> None:
    """token_strs gives one byte-level token string per id (vLLM's return_token_strs)."""
    ids = tok.encode("Hello world café 🚀", add_special_tokens=True)
    strs = tok.token_strs(ids)
    assert len(strs) == len(ids)
    assert strs[0] == "<|begin_of_text|>"
    assert "Ġworld" in strs
    assert [tok.token_to_id(s) for s in strs] == ids


@pytest.mark.parametrize("bad", [[-1], [5000], [1, 2, 10**9]], ids=["negative", "vocab-size", "huge"])
def test_unknown_ids_are_400(tok: Tokenizer, bad: list[int]) -> None:
    """Ids outside the vocabulary raise TokenIdError, a 400 naming the id."""
    for call in (tok.decode, tok.token_strs):
        with pytest.raises(TokenIdError, match="outside the vocabulary") as info:
            call(bad)
        assert isinstance(info.value, BadRequest) and info.value.status == 400


def test_metadata_from_config(tok: Tokenizer) -> None:
    """BOS/EOS, their ids, context length and the template variables come from tokenizer_config.json."""
    assert (tok.bos_token, tok.bos_token_id) == ("<|begin_of_text|>", BOS)
    assert (tok.eos_token, tok.eos_token_id) == ("<|eot_id|>", EOT)
    assert tok.model_max_length == 131072
    assert tok.vocab_size == 5000
    assert tok.chat_template is not None and "<|start_header_id|>" in tok.chat_template
    assert tok.special_tokens_map == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<|end_of_text|>",
    }


def test_without_config(tmp_path: Path) -> None:
    """tokenizer.json alone loads: no special-token names, no template, post-processor kept."""
    tok = Tokenizer.from_dir(_copy_shipped(tmp_path / "m"))
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id, tok.chat_template) == (None, None, None, None)
    assert tok.model_max_length is None
    assert tok.encode("x", add_special_tokens=True)[0] == BOS


@pytest.mark.parametrize(
    ("flags", "expect_bos", "expect_eos"),
    [
        ({"add_bos_token": False}, False, False),
        ({"add_bos_token": True, "add_eos_token": True}, True, True),
        ({"add_eos_token": True}, False, True),
    ],
    ids=["no-bos", "bos-and-eos", "eos-only"],
)
def test_add_bos_eos_flags_rebuild_post_processor(
    tmp_path: Path, flags: dict[str, object], expect_bos: bool, expect_eos: bool
) -> None:
    """Explicit add_bos_token/add_eos_token replace tokenizer.json's post-processor (transformers 5)."""
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", **flags}
    tok = Tokenizer.from_dir(_copy_shipped(tmp_path / "m", config=config))
    ids = tok.encode("hi", add_special_tokens=True)
    assert (ids[0] == BOS) is expect_bos
    assert (ids[-1] == EOT) is expect_eos
    assert len(ids) == len(tok.encode("hi", add_special_tokens=False)) + expect_bos + expect_eos


def test_clean_up_tokenization_spaces(tmp_path: Path) -> None:
    """With clean_up_tokenization_spaces, decode drops spaces before punctuation like transformers."""
    tok = Tokenizer.from_dir(_copy_shipped(tmp_path / "m", config={"clean_up_tokenization_spaces": True}))
    assert (
        tok.decode(tok.encode("Yes , really . I do n't !", add_special_tokens=False))
        == "Yes, really. I don't!"
    )


def test_chat_template_sources(tmp_path: Path) -> None:
    """A list of named templates picks tool_use with tools; chat_template.jinja beats the config."""
    config = {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}
    folder = _copy_shipped(tmp_path / "m", config=config)
    tok = Tokenizer.from_dir(folder)
    assert tok.chat_template == "D"
    templates = (tok.get_chat_template(), tok.get_chat_template(tools=True))
    assert [t.source for t in templates if t is not None] == ["D", "T"]
    (folder / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert Tokenizer.from_dir(folder).chat_template == "J"


def _hf_cache(root: Path, model_id: str, *, ref: str | None = COMMIT, commit: str = COMMIT) -> Path:
    """A Hugging Face hub cache entry: blobs, a snapshot of symlinks, and refs/main."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        blob = repo / "blobs" / f"blob-{name}"
        shutil.copy(shipped_tokenizer_dir() / name, blob)
        (snapshot / name).symlink_to(blob)
    if ref is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(ref, encoding="utf-8")
    return repo


@pytest.mark.parametrize(
    ("layout", "revision"),
    [("refs-main", "main"), ("no-refs", "main"), ("commit", COMMIT), ("hf-home", "main")],
    ids=["refs-main", "lone-snapshot", "commit-hash", "hf-home-root"],
)
def test_hf_cache_layout(tmp_path: Path, layout: str, revision: str) -> None:
    """A model id resolves to its snapshot in the HF cache (via refs/main when present), offline."""
    hub = tmp_path / "hub"
    _hf_cache(hub, "org/tiny", ref=None if layout == "no-refs" else COMMIT)
    if layout == "refs-main":
        # A second, older snapshot: refs/main must decide, not the folder listing.
        (hub / "models--org--tiny" / "snapshots" / ("f" * 40)).mkdir()
    root = tmp_path if layout == "hf-home" else hub
    tok = Tokenizer.from_hf_cache(root, "org/tiny", revision=revision)
    assert tok.name.endswith(COMMIT)
    assert tok.encode("hi", add_special_tokens=True)[0] == BOS


def test_load_dir_or_model_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizer.load takes a folder, or a model id found in HF_HUB_CACHE."""
    assert Tokenizer.load(shipped_tokenizer_dir()).vocab_size == 5000
    _hf_cache(tmp_path, "org/tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert default_hf_cache() == tmp_path
    assert Tokenizer.load("org/tiny").name.endswith(COMMIT)


def _corrupt_tokenizer_json(folder: Path) -> Path:
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    return folder / "tokenizer.json"


def _corrupt_config(folder: Path) -> Path:
    (folder / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    return folder / "tokenizer_config.json"


def _config_not_object(folder: Path) -> Path:
    (folder / "tokenizer_config.json").write_text("[1, 2]", encoding="utf-8")
    return folder / "tokenizer_config.json"


def _bad_template_type(folder: Path) -> Path:
    (folder / "tokenizer_config.json").write_text('{"chat_template": 3}', encoding="utf-8")
    return folder / "tokenizer_config.json"


def _no_tokenizer_json(folder: Path) -> Path:
    (folder / "tokenizer.json").unlink()
    return folder / "tokenizer.json"


@pytest.mark.parametrize(
    ("breaker", "match"),
    [
        (_corrupt_tokenizer_json, "cannot load tokenizer.json"),
        (_corrupt_config, "cannot read tokenizer_config.json"),
        (_config_not_object, "not a JSON object"),
        (_bad_template_type, "chat_template must be"),
        (_no_tokenizer_json, "no tokenizer.json"),
    ],
    ids=[
        "corrupt-tokenizer-json",
        "corrupt-config",
        "config-not-object",
        "bad-template-type",
        "missing-json",
    ],
)
def test_broken_folder_errors_name_the_file(tmp_path: Path, breaker: object, match: str) -> None:
    """A broken tokenizer folder raises TokenizerError (a ConfigError) naming the offending file."""
    folder = _copy_shipped(tmp_path / "m", config={})
    bad = breaker(folder)  # type: ignore[operator]
    with pytest.raises(TokenizerError, match=match) as info:
        Tokenizer.from_dir(folder)
    assert isinstance(info.value, ConfigError)
    assert info.value.path == bad and str(bad) in str(info.value)


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("missing-dir", "does not exist"),
        ("missing-model", "not in the Hugging Face cache"),
        ("dangling-ref", "missing"),
    ],
    ids=["missing-dir", "missing-model", "dangling-ref"],
)
def test_missing_locations_are_config_errors(tmp_path: Path, setup: str, match: str) -> None:
    """A folder, model or snapshot that is not there is a TokenizerError with the path."""
    if setup == "dangling-ref":
        _hf_cache(tmp_path, "org/tiny", ref="f" * 40)
    load: Callable[[], Tokenizer] = {
        "missing-dir": lambda: Tokenizer.from_dir(tmp_path / "nope"),
        "missing-model": lambda: Tokenizer.from_hf_cache(tmp_path, "org/absent"),
        "dangling-ref": lambda: Tokenizer.from_hf_cache(tmp_path, "org/tiny"),
    }[setup]
    with pytest.raises(TokenizerError, match=match):
        load()
