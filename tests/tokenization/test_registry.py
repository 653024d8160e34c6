"""Per-model tokenizers for the router: flags, loading, prompt token ids per path."""

from __future__ import annotations

import pytest

from extproc.errors import BadRequest, ConfigError
from extproc.openai import ChatPrompt, CompletionPrompt
from extproc.settings import TokenizerSpec
from extproc.tokenize import shipped_chat_template, shipped_tokenizer
from extproc.tokenize.registry import SHIPPED_TOKENIZER, TokenizerRegistry

LLAMA = "meta-llama/Meta-Llama-3-8B-Instruct"
CHAT = [{"role": "user", "content": "Hi there"}]


def test_pairs_split_on_the_last_equals_sign() -> None:
    """MODEL=VALUE flags keep slashes in model names."""
    pairs = TokenizerSpec.parse_pairs("--tokenizer", [f"{LLAMA}=/models/llama", "qwen=extproc:tiny"])
    assert pairs == {LLAMA: "/models/llama", "qwen": "extproc:tiny"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["nomodel"], "expected MODEL=VALUE"),
        (["a=x", "a=y"], "model 'a' is given twice"),
        (["=x"], "MODEL=VALUE"),
    ],
    ids=["no-equals", "twice", "empty-model"],
)
def test_bad_pairs_are_config_errors(values: list[str], message: str) -> None:
    """A malformed or repeated flag names the flag and the problem."""
    with pytest.raises(ConfigError, match=message):
        TokenizerSpec.parse_pairs("--tokenizer", values)


def test_missing_tokenizer_names_the_model_and_path() -> None:
    """A tokenizer that cannot be loaded fails at startup, naming the model."""
    with pytest.raises(ConfigError, match=f"tokenizer for model '{LLAMA}'"):
        TokenizerRegistry.load([TokenizerSpec(LLAMA, "/no/such/dir")])


def test_prompt_ids_match_what_the_engine_computes() -> None:
    """Chat uses the model's template, completions add BOS, token ids are taken as given."""
    registry = TokenizerRegistry.load([TokenizerSpec(LLAMA, SHIPPED_TOKENIZER, "llama3")])
    model = registry.get(LLAMA)
    assert model is not None and registry.get("other") is None
    tokenizer, template = shipped_tokenizer(), shipped_chat_template("llama3")
    text = template.render(CHAT, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    assert model.prompt_ids(ChatPrompt(tuple(CHAT))) == tokenizer.encode(text, add_special_tokens=False)
    assert model.prompt_ids(CompletionPrompt("Hi")) == tokenizer.encode("Hi", add_special_tokens=True)
    assert list(model.prompt_ids(CompletionPrompt((5, 7))) or ()) == [5, 7]


def test_different_templates_give_different_prompts() -> None:
    """Configured with the wrong template family, the router's tokens differ from the engine's."""
    registry = TokenizerRegistry.load(
        [TokenizerSpec("a", SHIPPED_TOKENIZER, "llama3"), TokenizerSpec("b", SHIPPED_TOKENIZER, "chatml")]
    )
    a, b = registry.get("a"), registry.get("b")
    assert a is not None and b is not None
    assert a.prompt_ids(ChatPrompt(tuple(CHAT))) != b.prompt_ids(ChatPrompt(tuple(CHAT)))


def test_untokenizable_prompt_is_a_bad_request() -> None:
    """A prompt the engine would refuse (a token id outside the vocabulary) is a BadRequest here too."""
    model = TokenizerRegistry.load([TokenizerSpec(LLAMA, SHIPPED_TOKENIZER)]).get(LLAMA)
    assert model is not None
    with pytest.raises(BadRequest, match="out of vocabulary"):
        model.prompt_ids(CompletionPrompt((1, 10**9)))
