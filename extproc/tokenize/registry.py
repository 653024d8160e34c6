"""Which tokenizer and chat template the router uses for each upstream model.

Configured per model (``--tokenizer MODEL=PATH``, ``--chat-template MODEL=FILE``), loaded once at
startup so a typo fails fast with the path in the message, then read on the request path without
I/O. A model with no tokenizer is not an error: routing falls back to approximate prefix affinity
for it, and the metrics say so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc.errors import ConfigError
from extproc.openai import ChatPrompt, Prompt
from extproc.settings import TokenizerSpec
from extproc.tokenize.chat_template import ChatTemplate
from extproc.tokenize.prompts import chat_prompt_ids, chat_prompt_plan, completion_prompt_ids
from extproc.tokenize.segments import EncodePlan
from extproc.tokenize.shipped import is_template_name, shipped_template, shipped_tokenizer_dir
from extproc.tokenize.tokenizer import Tokenizer

#: ``--tokenizer MODEL=extproc:tiny`` names the tokenizer shipped with extproc (the simulator's).
SHIPPED_TOKENIZER = "extproc:tiny"


@dataclass(frozen=True, slots=True)
class ModelTokenizer:
    """A loaded tokenizer + chat template: turns a request body into the engine's prompt token ids."""

    tokenizer: Tokenizer
    template: ChatTemplate | None

    def prompt_ids(self, prompt: Prompt) -> Sequence[int] | None:
        """The prompt's token ids; None for a chat prompt when no chat template is known.

        Raises :class:`~extproc.errors.BadRequest` when the prompt cannot be tokenized the way the
        engine would (the engine would refuse it too).
        """
        if isinstance(prompt, ChatPrompt):
            if self.template is None:
                return None
            return chat_prompt_ids(prompt, self.tokenizer, self.template)
        return completion_prompt_ids(prompt, self.tokenizer)

    def prompt_plan(self, prompt: Prompt) -> EncodePlan | None:
        """The prompt's encoding in steps, from its known prefix; None when only :meth:`prompt_ids`
        can (not a chat prompt, no chat template, or no segment cache). Renders the template here."""
        if not isinstance(prompt, ChatPrompt) or self.template is None:
            return None
        return chat_prompt_plan(prompt, self.tokenizer, self.template)


class TokenizerRegistry:
    """Upstream model name -> :class:`ModelTokenizer`, everything loaded up front."""

    def __init__(self, models: Mapping[str, ModelTokenizer] | None = None) -> None:
        self._models = dict(models or {})

    @classmethod
    def load(
        cls, specs: Iterable[TokenizerSpec], *, hf_cache: Path | None = None, segment_cache_bytes: int = 0
    ) -> TokenizerRegistry:
        """Load every spec; ConfigError names the model and the path that failed.

        ``segment_cache_bytes`` > 0 makes each tokenizer encode incrementally where it can
        (:mod:`extproc.tokenize.segments`), remembering that many bytes of pieces.
        """
        loaded: dict[str, ModelTokenizer] = {}
        for spec in specs:
            try:
                tokenizer = _load_tokenizer(spec.tokenizer, hf_cache)
                template = _load_template(spec.chat_template, tokenizer)
            except ConfigError as exc:
                raise ConfigError(f"tokenizer for model {spec.model!r}: {exc}") from None
            if segment_cache_bytes > 0:
                tokenizer.enable_segment_cache(segment_cache_bytes)
            loaded[spec.model] = ModelTokenizer(tokenizer, template)
        return cls(loaded)

    def get(self, model: str) -> ModelTokenizer | None:
        return self._models.get(model)

    def models(self) -> list[str]:
        return sorted(self._models)


def _load_tokenizer(source: str, hf_cache: Path | None) -> Tokenizer:
    if source == SHIPPED_TOKENIZER:
        return Tokenizer.from_dir(shipped_tokenizer_dir())
    return Tokenizer.load(source, cache_dir=hf_cache)


def _load_template(spec: str | None, tokenizer: Tokenizer) -> ChatTemplate | None:
    if spec is None:
        return tokenizer.get_chat_template()
    if is_template_name(spec):
        return ChatTemplate.from_file(shipped_template(spec))
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"chat template {spec!r} is neither a file nor a shipped template (chatml, llama3)")
    return ChatTemplate.from_file(path)
