"""OpenAI request bodies -> what the simulated engine generates, validated the way vLLM does.

Pure: no sockets, no engine. :func:`parse_completion` and :func:`parse_chat` turn a decoded JSON
body into a :class:`Generation` (prompt token ids, how many tokens to produce, which model or LoRA
adapter, streaming options) or raise :class:`SimRequestError` with the status and message vLLM
would answer (400 for bad bodies and context overflows, 404 for unknown models).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extproc.errors import BadRequest
from extproc.openai import ChatPrompt, CompletionPrompt, flag
from extproc.tokenize import ChatTemplate, Tokenizer
from extproc.tokenize.prompts import chat_prompt_ids, completion_prompt_ids


class SimRequestError(Exception):
    """A request the simulated engine refuses; ``status`` and ``error_type`` as vLLM answers them."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return "NotFoundError" if self.status == 404 else "BadRequestError"

    def as_json(self) -> dict[str, Any]:
        """vLLM's error body (0.10+): OpenAI's shape with the status as ``code``."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A name clients may ask for: a base model name, or a LoRA adapter on top of the base."""

    name: str
    root: str
    #: For a LoRA adapter: its name (the cache namespace) and vLLM's 1-based integer id.
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class Generation:
    """One request as the engine sees it."""

    model: ServedModel
    prompt_token_ids: tuple[int, ...]
    #: Exactly how many tokens to produce.
    output_tokens: int
    #: ``length`` when ``output_tokens`` is what the client's max_tokens allowed, else ``stop``.
    finish_reason: str
    stream: bool
    include_usage: bool
    #: ``cache_salt``: this prompt's blocks are cached apart from every other salt's.
    cache_salt: str | None = None


def vllm_cache_salt(body: Mapping[str, Any]) -> str | None:
    """vLLM's rule: ``cache_salt``, when given, is a non-empty string."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise SimRequestError(
            400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt"
        )
    return salt


def sglang_cache_salt(body: Mapping[str, Any]) -> str | None:
    """SGLang's rule: a string or a list of them (one per prompt of a batch: the first one's here);
    ``""`` is no salt."""
    salt = body.get("cache_salt")
    if isinstance(salt, list):
        if not all(isinstance(s, str) for s in salt):
            raise SimRequestError(400, "Every cache_salt should be a string.", param="cache_salt")
        salt = salt[0] if salt else None
    if salt is not None and not isinstance(salt, str):
        raise SimRequestError(400, "cache_salt should be a list or a string.", param="cache_salt")
    return salt or None


#: vLLM's ``CompletionRequest.max_tokens`` default.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def resolve_model(models: Mapping[str, ServedModel], body: Mapping[str, Any]) -> ServedModel:
    """The served model named by ``body["model"]``; vLLM takes the first one when it is missing."""
    name = body.get("model")
    if name is None:
        return next(iter(models.values()))
    if not isinstance(name, str):
        raise SimRequestError(400, "'model' must be a string", param="model")
    served = models.get(name)
    if served is None:
        raise SimRequestError(404, f"The model `{name}` does not exist.", param="model")
    return served


def sglang_resolve_model(models: Mapping[str, ServedModel], body: Mapping[str, Any]) -> ServedModel:
    """SGLang's reading of ``model`` (``serving_base._parse_model_parameter``): ``base:adapter``
    picks a loaded adapter; any other name is served by the base model (names are not checked)."""
    name = body.get("model")
    base = next(iter(models.values()))
    if not isinstance(name, str) or ":" not in name or name == base.name:
        return base
    # The full base name first: it may hold colons itself (an object-storage URI).
    prefix = f"{base.name}:"
    adapter = (name[len(prefix) :] if name.startswith(prefix) else name.split(":", 1)[1]).strip()
    served = models.get(adapter)
    if served is None or served.lora_name is None:
        raise SimRequestError(400, f"LoRA adapter {adapter!r} is not loaded.", param="model")
    return served


@dataclass(frozen=True, slots=True)
class Limits:
    """The engine's rules for reading a request."""

    max_model_len: int
    #: Tokens produced for a chat request without ``max_tokens`` (a real model stops at EOS).
    default_output_tokens: int
    #: How the engine reads ``cache_salt`` (vLLM and SGLang differ).
    cache_salt: Callable[[Mapping[str, Any]], str | None] = vllm_cache_salt
    #: How the engine finds the model a request names (vLLM and SGLang differ).
    resolve_model: Callable[[Mapping[str, ServedModel], Mapping[str, Any]], ServedModel] = resolve_model


def parse_completion(
    body: Any, *, models: Mapping[str, ServedModel], tokenizer: Tokenizer, limits: Limits
) -> Generation:
    """``POST /v1/completions``: one prompt, as text or token ids."""
    body = _object(body)
    model = limits.resolve_model(models, body)
    with refusals():
        prompt_ids = completion_prompt_ids(CompletionPrompt.from_body(body), tokenizer)
        max_tokens = _max_tokens(body, ("max_tokens",), default=COMPLETIONS_DEFAULT_MAX_TOKENS)
        return _generation(body, model, prompt_ids, max_tokens, limits)


def parse_chat(
    body: Any,
    *,
    models: Mapping[str, ServedModel],
    tokenizer: Tokenizer,
    template: ChatTemplate,
    limits: Limits,
) -> Generation:
    """``POST /v1/chat/completions``: messages rendered with the chat template, then tokenized."""
    body = _object(body)
    model = limits.resolve_model(models, body)
    with refusals():
        prompt_ids = chat_prompt_ids(ChatPrompt.from_body(body), tokenizer, template)
        max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), default=None)
        return _generation(body, model, prompt_ids, max_tokens, limits)


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """The shared prompt code's BadRequest (bad field, template error) becomes vLLM's 400."""
    try:
        yield
    except BadRequest as exc:
        raise SimRequestError(400, exc.message, param=exc.param) from None


def _generation(
    body: Mapping[str, Any],
    model: ServedModel,
    prompt_ids: Sequence[int],
    max_tokens: int | None,
    limits: Limits,
) -> Generation:
    if body.get("n", 1) != 1:
        raise SimRequestError(400, "the simulator serves n=1 only", param="n")
    prompt_len = len(prompt_ids)
    if prompt_len >= limits.max_model_len:
        raise SimRequestError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input messages.",
            param="messages" if "messages" in body else "prompt",
        )
    room = limits.max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise SimRequestError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {limits.max_model_len} tokens and your request has {prompt_len} input "
            f"tokens ({max_tokens} > {limits.max_model_len} - {prompt_len}).",
            param="max_tokens",
        )
    if max_tokens is None:
        output, reason = min(limits.default_output_tokens, room), "stop"
    else:
        output, reason = max_tokens, "length"
    stream = flag(body, "stream", False)
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise SimRequestError(400, "'stream_options' must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage", False))
    if include_usage and not stream:
        raise SimRequestError(400, "Stream options can only be defined when `stream=True`.")
    salt = limits.cache_salt(body)
    return Generation(model, tuple(prompt_ids), output, reason, stream, include_usage, salt)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise SimRequestError(400, "the request body must be a JSON object")
    return body


def _max_tokens(body: Mapping[str, Any], keys: Sequence[str], *, default: int | None) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise SimRequestError(400, f"'{key}' must be a positive integer, got {value!r}", param=key)
        return value
    return default
