"""A Hugging Face fast tokenizer loaded from its files, with the behaviour vLLM gets from transformers.

Reads a model folder (``tokenizer.json`` plus optional ``tokenizer_config.json`` and
``chat_template.jinja``) or a Hugging Face cache entry (``models--org--name/snapshots/<rev>/``,
resolved through ``refs/<revision>``). Never downloads. Encoding goes straight to the Rust
tokenizer; special tokens written in the text (``<|eot_id|>``) become their single ids, as
``transformers`` does by default.

HF semantics kept: ``add_special_tokens`` runs the post-processor (Llama-3: prepend BOS); an
explicit ``add_bos_token``/``add_eos_token`` in the config rebuilds that post-processor like
transformers >= 5; ``clean_up_tokenization_spaces`` applies to :meth:`Tokenizer.decode`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from extproc.tokenize.chat_template import ChatTemplate
from extproc.tokenize.errors import ChatTemplateLoadError, TokenIdError, TokenizerError
from extproc.tokenize.segments import EncodePlan, SegmentCache, Splitter, splitter_for

# transformers' clean_up_tokenization: undo the spaces a word-level detokenizer put before punctuation.
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


#: Texts from this length on are encoded without holding the GIL (``encode_batch`` costs a few
#: microseconds more to start, which only short texts would notice).
_RELEASE_GIL_CHARS = 2048
#: Pieces up to this long have their ids remembered (at most _SHORT_PIECES of them).
_SHORT_PIECE_CHARS = 64
_SHORT_PIECES = 4096


class Tokenizer:
    """Encode, decode and chat-template metadata of one model's tokenizer."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        name: str = "<memory>",
    ) -> None:
        cfg = dict(config or {})
        self._backend = backend
        self.name = name
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.pad_token = _token_str(cfg.get("pad_token"))
        self.unk_token = _token_str(cfg.get("unk_token"))
        max_len = cfg.get("model_max_length")
        #: None when the config does not say (transformers then uses a huge sentinel).
        self.model_max_length: int | None = max_len if isinstance(max_len, int) and max_len < 10**18 else None
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
        #: Named templates (``default``, ``tool_use``, ...), as HF stores a list of them.
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        if "add_bos_token" in cfg or "add_eos_token" in cfg:
            self._rebuild_post_processor(bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token")))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self._compiled: dict[str, ChatTemplate] = {}
        #: Set by :meth:`enable_segment_cache` (only serve uses it): where prompts are cut, and the
        #: tree of segments seen before.
        self._splitter: Splitter | None = None
        self.segment_cache: SegmentCache | None = None
        #: Ids of short pieces encoded in the calling thread: a template's role names and
        #: separators ("user", "\n\n") recur in every new turn, and each encode call costs ~20 µs.
        self._short_pieces: dict[str, list[int]] = {}

    # --- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) from a folder."""
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerError("tokenizer folder does not exist", path=folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError("no tokenizer.json in the tokenizer folder", path=tok_file)
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception for bad JSON or schema
            raise TokenizerError(f"cannot load tokenizer.json ({e})", path=tok_file) from e
        config = _read_config(folder / "tokenizer_config.json")
        templates = _chat_templates(config.get("chat_template"), folder / "tokenizer_config.json")
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            # transformers saves the template in its own file and prefers it over the config's.
            try:
                templates["default"] = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"cannot read chat_template.jinja ({e})", path=jinja_file) from e
        return cls(backend, config=config, chat_templates=templates, name=str(folder))

    @classmethod
    def from_hf_cache(cls, cache_dir: Path | str, model_id: str, *, revision: str = "main") -> Tokenizer:
        """Load ``model_id`` from a Hugging Face hub cache (``HF_HUB_CACHE`` layout) without network."""
        return cls.from_dir(hf_snapshot_dir(cache_dir, model_id, revision=revision))

    @classmethod
    def load(
        cls, name_or_path: str | Path, *, cache_dir: Path | str | None = None, revision: str = "main"
    ) -> Tokenizer:
        """A folder if ``name_or_path`` is one, else a model id looked up in the Hugging Face cache."""
        if Path(name_or_path).is_dir():
            return cls.from_dir(name_or_path)
        return cls.from_hf_cache(cache_dir or default_hf_cache(), str(name_or_path), revision=revision)

    # --- encoding --------------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (BOS for Llama-3).

        A long text goes through ``encode_batch``, which gives the same ids but releases the GIL
        while it works: ``encode`` holds it throughout (a 35k-token prompt blocked every other
        Python thread, the event loop included, for 130 ms).
        """
        if not add_special_tokens and self.segment_cache is not None and self._splitter is not None:
            return self.segment_cache.encode(self._splitter, text, self._encode_pieces)
        if len(text) >= _RELEASE_GIL_CHARS:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def enable_segment_cache(self, max_bytes: int) -> bool:
        """Encode incrementally from now on (see :mod:`extproc.tokenize.segments`), remembering up
        to ``max_bytes`` of pieces; False (and nothing changes) when this tokenizer's added tokens
        do not allow it exactly."""
        splitter = splitter_for(self._backend)
        if splitter is None:
            return False
        self._splitter, self.segment_cache = splitter, SegmentCache(max_bytes)
        return True

    def plan_encode(self, text: str) -> EncodePlan | None:
        """Encoding ``text`` (no special tokens) in steps, from its known prefix (see
        :mod:`extproc.tokenize.segments`); None without a segment cache."""
        if self.segment_cache is None or self._splitter is None:
            return None
        return self.segment_cache.plan(self._splitter, text, self._encode_pieces, self._encode_pieces_here)

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        # The same ids as encode_batch, without the character offsets (~20% faster on few pieces).
        return [e.ids for e in self._backend.encode_batch_fast(pieces, add_special_tokens=False)]

    def _encode_pieces_here(self, pieces: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        short = self._short_pieces
        for piece in pieces:
            ids = short.get(piece)
            if ids is None:
                ids = self._backend.encode(piece, add_special_tokens=False).ids
                if len(piece) <= _SHORT_PIECE_CHARS:
                    if len(short) >= _SHORT_PIECES:
                        short.clear()  # bounded whatever clients send; refills with what recurs
                    short[piece] = ids
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; unknown ids are a :class:`TokenIdError` (400) like vLLM's detokenize."""
        self._check_ids(ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string (``convert_ids_to_tokens``; byte-level, e.g. ``Ġworld``)."""
        self._check_ids(ids)
        table = self._id_to_token
        return [table[i] for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special-token variables every chat template sees (HF passes unset ones not at all)."""
        tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {k: v for k, v in tokens.items() if v is not None}

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (shared: do not reconfigure it)."""
        return self._backend

    # --- chat templates --------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """Source of the default chat template, None when the tokenizer ships none."""
        return self.chat_templates.get("default")

    def get_chat_template(self, *, tools: bool = False) -> ChatTemplate | None:
        """The compiled template transformers would pick: ``tool_use`` when tools are given, else default."""
        name = "tool_use" if tools and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            return None
        if name not in self._compiled:
            try:
                self._compiled[name] = ChatTemplate(self.chat_templates[name], name=f"{self.name}:{name}")
            except ChatTemplateLoadError as e:
                raise TokenizerError(f"invalid chat template {name!r} ({e})", path=self.name) from e
        return self._compiled[name]

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"

    # --- internals -------------------------------------------------------------------------------

    @cached_property
    def _id_to_token(self) -> list[str]:
        table = [""] * self.vocab_size
        for token, i in self._backend.get_vocab(with_added_tokens=True).items():
            if 0 <= i < len(table):
                table[i] = token
        return table

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenIdError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")

    def _rebuild_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """transformers' ``update_post_processor``: a template adding BOS and/or EOS, nothing else."""
        # A token the vocabulary lacks cannot be added (transformers >= 5 drops the flag too).
        bos, bos_id = self.bos_token, self.bos_token_id
        eos, eos_id = self.eos_token, self.eos_token_id
        single, pair_b = ["$A:0"], ["$B:1"]
        special: list[tuple[str, int]] = []
        if add_bos and bos is not None and bos_id is not None:
            single.insert(0, f"{bos}:0")
            pair_b.insert(0, f"{bos}:1")
            special.append((bos, bos_id))
        if add_eos and eos is not None and eos_id is not None:
            single.append(f"{eos}:0")
            pair_b.append(f"{eos}:1")
            special.append((eos, eos_id))
        self._backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(single + pair_b), special_tokens=special
        )


def _token_str(value: Any) -> str | None:
    """A special token from the config: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer_config.json ({e})", path=path) from e
    if not isinstance(config, dict):
        raise TokenizerError("tokenizer_config.json is not a JSON object", path=path)
    return config


def _chat_templates(value: Any, path: Path) -> dict[str, str]:
    """``chat_template`` from the config: a string (the default) or a list of ``{name, template}``."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise TokenizerError("chat_template must be a string or a list of {name, template} objects", path=path)


def default_hf_cache() -> Path:
    """Where ``huggingface_hub`` keeps models: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache``."""
    if hub := os.environ.get("HF_HUB_CACHE"):
        return Path(hub)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hf_snapshot_dir(cache_dir: Path | str, model_id: str, *, revision: str = "main") -> Path:
    """The snapshot folder of ``model_id`` at ``revision`` (a ref like ``main`` or a commit hash).

    ``refs/<revision>`` names the commit when present; without it a commit-named snapshot is used,
    and for ``main`` a lone snapshot is taken (caches copied without their ``refs``).
    """
    root = Path(cache_dir)
    repo = root / ("models--" + model_id.replace("/", "--"))
    if not repo.is_dir() and (root / "hub" / repo.name).is_dir():
        repo = root / "hub" / repo.name  # given HF_HOME instead of the hub cache
    if not repo.is_dir():
        raise TokenizerError(f"model {model_id!r} is not in the Hugging Face cache", path=repo)
    snapshots = repo / "snapshots"
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        snapshot = snapshots / commit
        if not snapshot.is_dir():
            raise TokenizerError(
                f"refs/{revision} names commit {commit} but its snapshot is missing", path=snapshot
            )
        return snapshot
    if (snapshots / revision).is_dir():
        return snapshots / revision
    found = sorted(p.name for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if revision == "main" and len(found) == 1:
        return snapshots / found[0]
    raise TokenizerError(
        f"no snapshot for revision {revision!r} of {model_id!r} (snapshots: {', '.join(found) or 'none'})",
        path=snapshots,
    )
