"""Prompt text and token ids for a request, computed the way vLLM's OpenAI server computes them.

Chat: shape messages and tools like vLLM (:mod:`extproc.tokenize.conversation`), render the chat
template with the tokenizer's special tokens plus ``chat_template_kwargs``, then encode with
``add_special_tokens=False`` (vLLM's chat default: the template already wrote BOS). Completions:
encode the prompt with ``add_special_tokens=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, Unpack

from extproc.tokenize.chat_template import ChatTemplate
from extproc.tokenize.conversation import prepare_messages, prepare_tools
from extproc.tokenize.errors import ChatTemplateError
from extproc.tokenize.tokenizer import Tokenizer


def render_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text vLLM renders; ``template`` None means the tokenizer's own template."""
    if template is None:
        template = tokenizer.get_chat_template(tools=tools is not None)
        if template is None:
            raise ChatTemplateError(
                "the tokenizer has no chat template and none was configured",
                template=tokenizer.name,
                param=None,
            )
    # vLLM merges chat_template_kwargs over its own template arguments, so they may override
    # add_generation_prompt, continue_final_message and tools (passed as given) too.
    variables: dict[str, Any] = {**tokenizer.special_tokens_map, **(chat_template_kwargs or {})}
    template_tools = variables.pop("tools") if "tools" in variables else prepare_tools(tools)
    return template.render(
        prepare_messages(messages, content_format=template.content_format),
        add_generation_prompt=bool(variables.pop("add_generation_prompt", add_generation_prompt)),
        continue_final_message=bool(variables.pop("continue_final_message", continue_final_message)),
        tools=template_tools,
        bos_token=variables.pop("bos_token", None),
        eos_token=variables.pop("eos_token", None),
        **variables,
    )


class ChatOptions(TypedDict, total=False):
    """The request fields :func:`render_chat` takes besides the messages (its keyword arguments)."""

    add_generation_prompt: bool
    continue_final_message: bool
    tools: Sequence[Mapping[str, Any]] | None
    chat_template_kwargs: Mapping[str, Any] | None


def tokenize_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_special_tokens: bool = False,
    **options: Unpack[ChatOptions],
) -> list[int]:
    """Prompt token ids of a chat request: :func:`render_chat`, then encode."""
    text = render_chat(tokenizer, template, messages, **options)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenize_prompt(tokenizer: Tokenizer, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
    """Prompt token ids of a completions request (BOS added, as vLLM does by default)."""
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
