"""Chat templates rendered exactly like Hugging Face ``transformers`` renders them for vLLM.

Same Jinja environment as ``transformers.utils.chat_template_utils`` (immutable sandbox,
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``; a ``tojson`` that does not HTML-escape;
``raise_exception`` and ``strftime_now`` globals; ``{% generation %}`` blocks accepted), the same
template variables (``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
tokens, then ``chat_template_kwargs``) and the same ``continue_final_message`` cut, so a prompt
rendered here is byte-identical to the engine's.

A :class:`ChatTemplate` parses and compiles its source once; rendering is the hot path. It also
detects vLLM's *content format* (does the template loop over ``message.content``?), which decides
how :mod:`extproc.tokenize.conversation` shapes messages before rendering.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from extproc.tokenize.errors import ChatTemplateError, ChatTemplateLoadError

#: How vLLM hands message content to a template: "string" joins text parts with "\n", "openai"
#: passes a list of ``{"type": "text", "text": ...}`` parts (strings are wrapped into one part).
ContentFormat = Literal["string", "openai"]

# chat_template_kwargs that cannot be honoured: transformers and vLLM reject (or crash on) these.
RESERVED_KWARGS = frozenset({"messages", "conversation", "chat_template", "tokenize"})


class _Raised(Exception):
    """What ``raise_exception`` throws inside Jinja; :meth:`ChatTemplate.render` names the template."""


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes '<', '>', '&' and "'"; transformers replaces it with plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlocks(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (HF's assistant-mask markers); render the body."""

    tags: ClassVar[set[str]] = {"generation"}  # type: ignore[misc]

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, its attribute check remembered per (type, attribute).

    The check (no ``_`` names, no internals of functions, frames, generators..., no method that
    mutates a list, dict, set or deque) looks only at the object's type and the attribute's name,
    so its answer for one pair holds for every object of that type. Asked for every method call a
    template makes on every message, it was a tenth of a chat prompt's rendering.
    """

    _MAX_REMEMBERED = 4096

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._safe.get(key)
        if safe is None:
            safe = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < self._MAX_REMEMBERED:  # names can come from data: stay bounded
                self._safe[key] = safe
        return safe


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


class ChatTemplate:
    """A compiled chat template; ``name`` (a file path or a label) appears in every error."""

    __slots__ = ("_compiled", "content_format", "name", "source")

    def __init__(self, source: str, *, name: str = "<string>") -> None:
        self.source = source
        self.name = name
        try:
            ast = _ENV.parse(source)
            self._compiled = _ENV.from_string(ast)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateLoadError(f"line {e.lineno}: {e.message}", name=name) from e
        self.content_format: ContentFormat = detect_content_format(ast)

    @classmethod
    def from_file(cls, path: Path | str) -> ChatTemplate:
        """Read and compile a ``.jinja`` file; a missing or undecodable file is a config error."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateLoadError(f"cannot read the template file ({e})", name=str(path)) from e
        return cls(source, name=str(path))

    @staticmethod
    @lru_cache(maxsize=64)
    def cached(source: str, name: str = "<string>") -> ChatTemplate:
        """Compile once per distinct source (e.g. per-request templates), reuse afterwards."""
        return ChatTemplate(source, name=name)

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r}, content_format={self.content_format!r})"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        bos_token: str | None,
        eos_token: str | None,
        **chat_template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to the prompt text; every failure is a :class:`ChatTemplateError` (400).

        ``bos_token``/``eos_token`` of None stay undefined in the template, as HF leaves a tokenizer's
        unset special tokens out. ``continue_final_message`` renders without the generation prompt
        and cuts right after the final (assistant) message's content so the model continues it.
        """
        if continue_final_message:
            if add_generation_prompt:
                raise self._error(
                    "continue_final_message and add_generation_prompt cannot both be true",
                    param="continue_final_message",
                )
            if not messages or messages[-1].get("role") != "assistant":
                raise self._error(
                    "continue_final_message needs a final message with role 'assistant'",
                    param="continue_final_message",
                )
        if reserved := sorted(RESERVED_KWARGS & chat_template_kwargs.keys()):
            raise self._error(
                f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs"
            )
        # HF's order: special tokens, then kwargs (which may replace them and ``documents``).
        variables: dict[str, Any] = {"bos_token": bos_token, "eos_token": eos_token, "documents": None}
        variables = {k: v for k, v in variables.items() if v is not None or k == "documents"}
        variables.update(chat_template_kwargs)
        try:
            text = self._compiled.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except _Raised as e:
            raise self._error(str(e)) from e
        except Exception as e:
            # The template is data and the messages are client input: any failure while rendering
            # is this request's fault (the engine answers it with a 400 too), never a router crash.
            raise self._error(f"{type(e).__name__}: {e}") from e
        if continue_final_message:
            text = self._cut_after_final(text, messages[-1].get("content"))
        return text

    def _cut_after_final(self, text: str, final: Any) -> str:
        """Drop everything the template added after the final message's content (HF's algorithm)."""
        if isinstance(final, list | tuple):
            texts = [p["text"] for p in final if isinstance(p, Mapping) and "text" in p]
            if not texts:
                raise self._error("continue_final_message: the final message has no text to continue")
            final = texts[-1]
        if not isinstance(final, str):
            raise self._error("continue_final_message: the final message has no text to continue")
        stripped = final.strip()
        if stripped not in text:
            raise self._error(
                "continue_final_message: the template does not reproduce the final message's text"
            )
        at = text.rindex(stripped)
        if text[at : at + len(final.lstrip())] == final:
            return text[: at + len(final.lstrip())]
        # The template trimmed trailing spaces off the message: keep what it rendered.
        return text[: at + len(stripped)]

    def _error(self, message: str, *, param: str | None = "messages") -> ChatTemplateError:
        return ChatTemplateError(message, template=self.name, param=param)


# --- content format detection (vLLM's heuristic: a for loop over a message's "content") ---------


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """ "openai" if the template iterates over ``message.content`` of a message from ``messages``."""
    message_vars = set(_loop_targets(ast, set(_derived_names(ast, "messages"))))
    for loop in ast.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, var, "content") for var in message_vars):
            return "openai"
    return "string"


def _reads(node: jinja2.nodes.Node, var: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``var`` (or ``var[key]``/``var.key``), possibly filtered, tested or sliced."""
    while (inner := _unwrap(node)) is not None:
        node = inner
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == var
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _reads(node.node, var)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _reads(node.node, var)
    return False


def _unwrap(node: jinja2.nodes.Node) -> jinja2.nodes.Node | None:
    """The expression under a filter, a test or a slice (``messages[1:] | list``), else None."""
    if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
        return node.node
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return node.node
    return None


def _derived_names(ast: jinja2.nodes.Template, var: str) -> Iterator[str]:
    """``var`` and every name assigned from it (``{% set loop_messages = messages[1:] %}``), transitively."""
    seen = {var}
    queue = deque([var])
    yield var
    while queue:
        current = queue.popleft()
        for assign in ast.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                isinstance(target, jinja2.nodes.Name)
                and target.name not in seen
                and _reads(assign.node, current)
            ):
                seen.add(target.name)
                queue.append(target.name)
                yield target.name


def _loop_targets(ast: jinja2.nodes.Template, sources: set[str]) -> Iterator[str]:
    """Names bound by ``{% for x in <source> %}`` loops."""
    for loop in ast.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_reads(loop.iter, s) for s in sources):
            yield loop.target.name
