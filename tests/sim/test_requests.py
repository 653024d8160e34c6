"""OpenAI bodies -> Generation, refused the way vLLM refuses them (pure, no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from extproc.sim.requests import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Generation,
    Limits,
    ServedModel,
    SimRequestError,
    parse_chat,
    parse_completion,
)
from extproc.tokenize import shipped_chat_template, shipped_tokenizer

TOKENIZER = shipped_tokenizer()
LLAMA3 = shipped_chat_template("llama3")
BASE = ServedModel("llama", "meta-llama/Meta-Llama-3-8B-Instruct")
LORA = ServedModel("sql-lora", BASE.root, lora_name="sql-lora", lora_id=1)
MODELS = {"llama": BASE, "sql-lora": LORA}
LIMITS = Limits(max_model_len=64, default_output_tokens=10)


def completion(body: Any) -> Generation:
    return parse_completion(body, models=MODELS, tokenizer=TOKENIZER, limits=LIMITS)


def chat(body: Any) -> Generation:
    return parse_chat(body, models=MODELS, tokenizer=TOKENIZER, template=LLAMA3, limits=LIMITS)


def test_text_prompt_is_tokenized_with_bos() -> None:
    """A text prompt gets the tokenizer's BOS, as vLLM's completions path adds special tokens."""
    gen = completion({"model": "llama", "prompt": "hello world"})
    assert gen.prompt_token_ids == tuple(TOKENIZER.encode("hello world", add_special_tokens=True))
    assert gen.prompt_token_ids[0] == TOKENIZER.bos_token_id


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]], ids=["ids", "batch-of-one"])
def test_token_id_prompts_pass_through_unchanged(prompt: Any) -> None:
    """Token-id prompts are used as given (no BOS added)."""
    assert completion({"model": "llama", "prompt": prompt}).prompt_token_ids == (5, 6, 7)


def test_completions_default_to_16_tokens_and_chat_to_the_configured_default() -> None:
    """Without max_tokens: 16 for completions (vLLM's default), the configured length for chat."""
    assert completion({"model": "llama", "prompt": "hi"}).output_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    gen = chat({"model": "llama", "messages": [{"role": "user", "content": "hi"}]})
    assert (gen.output_tokens, gen.finish_reason) == (10, "stop")


def test_max_tokens_sets_the_length_and_finish_reason() -> None:
    """max_tokens is produced exactly and reported as finish_reason length."""
    gen = chat(
        {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    )
    assert (gen.output_tokens, gen.finish_reason) == (3, "length")


def test_chat_prompt_is_the_rendered_template_tokens() -> None:
    """Chat prompts are the template's text encoded without extra special tokens."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    gen = chat({"model": "llama", "messages": messages})
    text = LLAMA3.render(messages, bos_token=TOKENIZER.bos_token, eos_token=TOKENIZER.eos_token)
    assert gen.prompt_token_ids == tuple(TOKENIZER.encode(text, add_special_tokens=False))


def test_lora_model_carries_its_namespace() -> None:
    """Naming a LoRA adapter selects it (its blocks live in their own cache namespace)."""
    gen = completion({"model": "sql-lora", "prompt": "select"})
    assert (gen.model.lora_name, gen.model.lora_id) == ("sql-lora", 1)


def test_missing_model_uses_the_first_served_one() -> None:
    """vLLM serves the first model when the body names none."""
    assert completion({"prompt": "hi"}).model == BASE


def test_stream_options_include_usage() -> None:
    """stream_options.include_usage is honoured on streams."""
    gen = completion({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}})
    assert gen.stream and gen.include_usage


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "nope", "prompt": "hi"}, 404, "The model `nope` does not exist."),
        ({"model": 3, "prompt": "hi"}, 400, "'model' must be a string"),
        ({"prompt": ""}, 400, "must not be empty"),
        ({"prompt": {"a": 1}}, 400, "string or a list of token ids"),
        ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
        ({"prompt": [1, 999_999]}, 400, "out of vocabulary"),
        ({"prompt": [1, -2]}, 400, "Token id -2 is out of vocabulary"),
        ({"prompt": [1, 2, True]}, 400, "Expected `int`, got `bool` - at `$[2]`"),
        ({"prompt": [1, 2.5]}, 400, "Expected `int`, got `float` - at `$[1]`"),
        ({"prompt": list(range(10, 80))}, 400, "maximum context length is 64 tokens"),
        (
            {"prompt": "hi", "max_tokens": 100},
            400,
            "'max_tokens' or 'max_completion_tokens' is too large: 100",
        ),
        ({"prompt": "hi", "max_tokens": 0}, 400, "must be a positive integer"),
        ({"prompt": "hi", "n": 2}, 400, "n=1 only"),
        ({"prompt": "hi", "stream": "yes"}, 400, "'stream' must be true or false"),
        (
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "only be defined when `stream=True`",
        ),
        ([1, 2], 400, "must be a JSON object"),
    ],
    ids=[
        "unknown-model",
        "model-not-string",
        "empty-prompt",
        "prompt-object",
        "batch",
        "bad-token-id",
        "negative-token-id",
        "bool-token-id",
        "float-token-id",
        "prompt-too-long",
        "max-tokens-too-large",
        "max-tokens-zero",
        "n-2",
        "stream-not-bool",
        "usage-without-stream",
        "not-object",
    ],
)
def test_completion_refusals_name_the_problem(body: Any, status: int, fragment: str) -> None:
    """Each bad completion body gets vLLM's status and a message naming what is wrong."""
    with pytest.raises(SimRequestError) as info:
        completion(body)
    assert info.value.status == status
    assert fragment in info.value.message


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "'tools' must be a list"),
        ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []}, "must be an object"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
            "Cannot set both",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
    ],
    ids=["empty", "string", "tools-object", "kwargs-list", "continue-and-generation", "template-raises"],
)
def test_chat_refusals_are_400_with_the_reason(body: dict[str, Any], fragment: str) -> None:
    """Bad chat bodies, including ones the template rejects, are 400s naming the problem."""
    with pytest.raises(SimRequestError) as info:
        chat({"model": "llama", **body})
    assert info.value.status == 400
    assert fragment in info.value.message


def test_error_json_has_vllms_shape() -> None:
    """Errors serialise as {"error": {message, type, param, code}} with the status as code."""
    err = SimRequestError(404, "The model `x` does not exist.", param="model")
    assert err.as_json() == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
