"""The tokenizer and chat templates shipped inside the package (no source checkout, no download).

``data/tiny`` is a small byte-level BPE made by ``scripts/make_tokenizer.py`` (Llama-3 special
tokens and BOS post-processor, plus the ChatML tokens); ``data/templates`` holds the two chat
template families. The simulator and the tests use them so router and engine tokenize alike.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal, TypeGuard

from extproc.tokenize.chat_template import ChatTemplate
from extproc.tokenize.tokenizer import Tokenizer

TemplateName = Literal["chatml", "llama3"]
TEMPLATE_NAMES: tuple[TemplateName, ...] = ("chatml", "llama3")

_DATA = Path(__file__).resolve().parent / "data"


def shipped_tokenizer_dir() -> Path:
    """Folder of the shipped tokenizer (``tokenizer.json``, ``tokenizer_config.json``)."""
    return _DATA / "tiny"


def is_template_name(name: str) -> TypeGuard[TemplateName]:
    """Whether a flag value names a shipped template (narrows ``str`` for :func:`shipped_template`)."""
    return name in TEMPLATE_NAMES


def shipped_template(name: TemplateName) -> Path:
    """Path of a shipped chat template: ``chatml`` (Qwen-style) or ``llama3``."""
    if name not in TEMPLATE_NAMES:
        raise ValueError(f"unknown shipped template {name!r}; choose one of {', '.join(TEMPLATE_NAMES)}")
    return _DATA / "templates" / f"{name}.jinja"


@lru_cache(maxsize=1)
def shipped_tokenizer() -> Tokenizer:
    """The shipped tokenizer, loaded once per process."""
    return Tokenizer.from_dir(shipped_tokenizer_dir())


@lru_cache(maxsize=len(TEMPLATE_NAMES))
def shipped_chat_template(name: TemplateName) -> ChatTemplate:
    """A shipped chat template, compiled once per process."""
    return ChatTemplate.from_file(shipped_template(name))
