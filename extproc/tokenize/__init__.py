"""Tokenizers and chat templates shared by the router and the engine simulator.

The router tokenizes a request exactly as vLLM will, and ``extproc sim`` tokenizes with this same
code, so router and simulated engine agree on token ids (or disagree exactly as real ones do when
configured with different templates). See ``README.md`` in this folder for the module map.
"""

from __future__ import annotations

from extproc.tokenize.chat_template import ChatTemplate, ContentFormat, detect_content_format
from extproc.tokenize.conversation import prepare_messages, prepare_tools
from extproc.tokenize.errors import ChatTemplateError, ChatTemplateLoadError, TokenIdError, TokenizerError
from extproc.tokenize.pipeline import render_chat, tokenize_chat, tokenize_prompt
from extproc.tokenize.shipped import (
    TEMPLATE_NAMES,
    TemplateName,
    is_template_name,
    shipped_chat_template,
    shipped_template,
    shipped_tokenizer,
    shipped_tokenizer_dir,
)
from extproc.tokenize.tokenizer import Tokenizer, default_hf_cache, hf_snapshot_dir

__all__ = [
    "TEMPLATE_NAMES",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateLoadError",
    "ContentFormat",
    "TemplateName",
    "TokenIdError",
    "Tokenizer",
    "TokenizerError",
    "default_hf_cache",
    "detect_content_format",
    "hf_snapshot_dir",
    "is_template_name",
    "prepare_messages",
    "prepare_tools",
    "render_chat",
    "shipped_chat_template",
    "shipped_template",
    "shipped_tokenizer",
    "shipped_tokenizer_dir",
    "tokenize_chat",
    "tokenize_prompt",
]
