"""OpenAI request bodies -> the prompt token ids vLLM will compute, for the router and the simulator.

One implementation on both sides is what makes the router's prefix keys match the engine's blocks
(given the same tokenizer and template): completions add the tokenizer's special tokens (BOS) to a
text prompt and take token-id prompts as given; chat requests render the template and encode
without extra special tokens, with vLLM's request fields (``tools``, ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens``).

Every refusal is a :class:`~extproc.errors.BadRequest` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from extproc.errors import BadRequest
from extproc.tokenize.chat_template import ChatTemplate
from extproc.tokenize.pipeline import tokenize_chat
from extproc.tokenize.tokenizer import Tokenizer


def completion_prompt_ids(prompt: Any, tokenizer: Tokenizer, *, add_special_tokens: bool = True) -> list[int]:
    """A prompt as vLLM accepts it: a string, a token-id list, or a batch of exactly one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        vocab = tokenizer.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"Token id {bad} is out of vocabulary (size {vocab})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("one prompt per request is supported, got a batch", param="prompt")
    raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")


def chat_prompt_ids(body: Mapping[str, Any], tokenizer: Tokenizer, template: ChatTemplate) -> list[int]:
    """The token ids vLLM's chat path produces: template render, then encode without special tokens."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of objects", param="messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of objects", param="tools")
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    add_generation_prompt = flag(body, "add_generation_prompt", True)
    continue_final = flag(body, "continue_final_message", False)
    if add_generation_prompt and continue_final:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return tokenize_chat(
        tokenizer,
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        tools=tools,
        chat_template_kwargs=kwargs,
        add_special_tokens=flag(body, "add_special_tokens", False),
    )


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    """A boolean request field; null means the default, anything else but a bool is a 400."""
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{key}' must be true or false, got {value!r}", param=key)
    return value
