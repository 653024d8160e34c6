"""Errors of the tokenize package, split by who must act.

::

    ConfigError (extproc.errors)
    +-- TokenizerError          tokenizer files missing or unreadable: fix the flag or the files
    +-- ChatTemplateLoadError   a template file missing or not valid Jinja: fix and restart
    BadRequest (extproc.errors, HTTP 400)
    +-- ChatTemplateError       this request's messages cannot be rendered (the template raised,
    |                           bad role order, continue_final_message misuse, ...)
    +-- TokenIdError            token ids outside the vocabulary (detokenize of client ids)

Render errors are 400s because the engine answers the same request with a 400 too: the router can
reject it early with the same message instead of routing a request that is bound to fail.
"""

from __future__ import annotations

from pathlib import Path

from extproc.errors import BadRequest, ConfigError


class TokenizerError(ConfigError):
    """A tokenizer folder or file cannot be loaded; ``path`` names what was read."""

    def __init__(self, message: str, *, path: Path | str) -> None:
        super().__init__(f"{message}: {path}")
        self.path = Path(path)


class ChatTemplateLoadError(ConfigError):
    """A chat template cannot be read or compiled; ``name`` is its file path or given name."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(f"chat template {name!r}: {message}")
        self.name = name


class ChatTemplateError(BadRequest):
    """A conversation cannot be rendered with a template (a client error, answered with 400)."""

    def __init__(self, message: str, *, template: str, param: str | None = "messages") -> None:
        super().__init__(f"chat template {template!r}: {message}", param=param)
        self.template = template
        #: The message alone, e.g. exactly what the template passed to ``raise_exception``.
        self.detail = message


class TokenIdError(BadRequest):
    """Token ids that the tokenizer does not know (a client error, answered with 400)."""
