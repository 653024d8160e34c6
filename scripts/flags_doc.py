"""Write the flag reference (``docs/flags.md``) from the CLI's own argparse parsers.

    python scripts/flags_doc.py           # rewrite docs/flags.md
    python scripts/flags_doc.py --check   # exit 1 when docs/flags.md is stale

The reference is generated, never edited by hand: ``tests/test_flags_doc.py`` fails when it
differs from what the parsers say, so a flag's default and help live in one place (``cli.py`` and
the subcommands' ``add_*_parser``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from extproc.cli import build_parser

OUT = Path(__file__).resolve().parents[1] / "docs" / "flags.md"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if action.default is False else "on"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    if isinstance(action.default, list | tuple):
        return ", ".join(str(v) for v in action.default) or ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) or not action.option_strings:
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.metavar and not isinstance(action.metavar, tuple):
            names += f" `{action.metavar}`"
        elif action.choices is not None:
            names += " `{" + ",".join(str(c) for c in action.choices) + "}`"
        rows.append(f"| {names} | {_default(action)} | {_cell(action.help or '')} |")
    return rows


def render() -> str:
    parser = build_parser()
    lines = [
        "# Flag reference",
        "",
        "Generated from the command's own parsers by `python scripts/flags_doc.py`; do not edit by hand",
        "(`tests/test_flags_doc.py` fails when this page is stale). Global flags go before the subcommand:",
        "`extproc --log-level debug serve ...`.",
        "",
        "## `extproc`",
        "",
        *_flags(parser),
    ]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help or "" for c in subparsers._choices_actions}
    for name, sub in subparsers.choices.items():
        lines += ["", f"## `extproc {name}`", "", _cell(helps.get(name, "")), "", *_flags(sub)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    if args.parse_args(argv).check:
        stale = not OUT.is_file() or OUT.read_text() != render()
        if stale:
            print(f"{OUT} is stale: run python scripts/flags_doc.py", file=sys.stderr)
        return int(stale)
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
