"""A request's prompt -> the prompt token ids vLLM will compute, for the router and the simulator.

One implementation on both sides is what makes the router's prefix keys match the engine's blocks
(given the same tokenizer and template): completions add the tokenizer's special tokens (BOS) to a
text prompt and take token-id prompts as given; chat requests render the template and encode
without extra special tokens, with vLLM's request fields (``tools``, ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``), read once by
:mod:`extproc.openai` into :class:`~extproc.openai.ChatPrompt`.

Every refusal is a :class:`~extproc.errors.BadRequest` naming the field.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

from extproc.errors import BadRequest
from extproc.openai import ChatPrompt, CompletionPrompt
from extproc.tokenize.chat_template import ChatTemplate
from extproc.tokenize.pipeline import render_chat
from extproc.tokenize.segments import EncodePlan
from extproc.tokenize.tokenizer import Tokenizer


def completion_prompt_ids(
    prompt: CompletionPrompt, tokenizer: Tokenizer, *, add_special_tokens: bool = True
) -> Sequence[int]:
    """Text is encoded (BOS added by default, as vLLM does); token ids must be in the vocabulary
    (given ids come back as they are: a tuple, not copied, as long prompts cost a copy each)."""
    if isinstance(prompt.prompt, str):
        return tokenizer.encode(prompt.prompt, add_special_tokens=add_special_tokens)
    vocab = tokenizer.vocab_size
    ids = prompt.prompt
    try:  # one C pass (half of a min() and a max()); find the culprit only when there is one
        msgspec.convert(ids, _vocabulary_ids(vocab))
    except msgspec.ValidationError:
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise BadRequest(f"Token id {bad} is out of vocabulary (size {vocab})", param="prompt") from None
    return ids


@functools.cache
def _vocabulary_ids(vocab_size: int) -> Any:
    """The msgspec type of a token-id sequence of a vocabulary of ``vocab_size``."""
    return tuple[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)], ...]


def chat_prompt_text(prompt: ChatPrompt, tokenizer: Tokenizer, template: ChatTemplate) -> str:
    """The prompt text vLLM's chat path renders (encoded without special tokens unless asked)."""
    return render_chat(
        tokenizer,
        template,
        prompt.messages,
        add_generation_prompt=prompt.add_generation_prompt,
        continue_final_message=prompt.continue_final_message,
        tools=prompt.tools,
        chat_template_kwargs=prompt.chat_template_kwargs,
    )


def chat_prompt_ids(prompt: ChatPrompt, tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    """The token ids vLLM's chat path produces: template render, then encode without special tokens."""
    text = chat_prompt_text(prompt, tokenizer, template)
    return tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens)


def chat_prompt_plan(prompt: ChatPrompt, tokenizer: Tokenizer, template: ChatTemplate) -> EncodePlan | None:
    """:func:`chat_prompt_ids` in steps, from the prompt's known prefix (see
    :mod:`extproc.tokenize.segments`); None when the tokenizer cannot (no segment cache, or the
    request asks for special tokens)."""
    if prompt.add_special_tokens or tokenizer.segment_cache is None:
        return None
    return tokenizer.plan_encode(chat_prompt_text(prompt, tokenizer, template))
