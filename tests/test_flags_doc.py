"""The flag reference in docs/ is generated from the parsers and must match them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import flags_doc

from extproc.cli import build_parser


def test_the_flag_reference_is_current() -> None:
    """docs/flags.md says what the parsers say; a new or changed flag needs `python scripts/flags_doc.py`."""
    assert flags_doc.OUT.read_text() == flags_doc.render(), "docs/flags.md is stale: run scripts/flags_doc.py"


def test_every_serve_flag_is_in_the_reference() -> None:
    """Every option of `extproc serve`, with its default, appears in the reference."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    page = flags_doc.render()
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            assert f"`{option}`" in page, option
