"""A trace file's rows in Mooncake's form, whichever shared trace it is (standard library only).

- Mooncake ``.jsonl``: as they are (``timestamp`` in ms, ``input_length``, ``output_length``,
  ``hash_ids``, one id per 512-token block, equal leading ids = a shared prefix).
- Azure LLM inference 2023 ``.csv`` (``TIMESTAMP,ContextTokens,GeneratedTokens``): no prefix
  information, so every row gets ids of its own (no two prompts share a block), and timestamps
  become milliseconds since the file's first row. What such a trace measures is load balancing.

Dynamo's mocker replay reads Mooncake rows too: ``bench/dynamo_replay.py`` imports this from its own
venv, hence no dependency beyond the standard library.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

#: Tokens per hash id (Mooncake's block size).
TRACE_BLOCK = 512
#: The columns of an Azure LLM inference trace.
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceFormatError(ValueError):
    """A trace file this module cannot read, with where and why."""


def trace_rows(path: Path) -> Iterator[dict[str, Any]]:
    """``path``'s rows as Mooncake dicts, in file order (blank lines skipped)."""
    if path.suffix == ".csv":
        yield from azure_rows(path)
        return
    with path.open(encoding="utf-8") as source:
        for line in source:
            if line.strip():
                yield json.loads(line)


def azure_rows(path: Path) -> Iterator[dict[str, Any]]:
    """An Azure trace's rows as Mooncake rows, each prompt with block ids no other row has."""
    with path.open(encoding="utf-8", newline="") as source:
        reader = csv.DictReader(source)
        if tuple(reader.fieldnames or ()) != AZURE_COLUMNS:
            expected = ",".join(AZURE_COLUMNS)
            raise TraceFormatError(f"{path}: expected the columns {expected}, got {reader.fieldnames}")
        first: datetime | None = None
        next_id = 0
        for line, row in enumerate(reader, start=2):
            try:
                at = datetime.fromisoformat(row["TIMESTAMP"])
                prompt, answer = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise TraceFormatError(f"{path}:{line}: {exc}") from None
            first = at if first is None else first
            blocks = max(1, -(-prompt // TRACE_BLOCK))
            yield {
                "timestamp": round((at - first).total_seconds() * 1000, 3),
                "input_length": prompt,
                "output_length": answer,
                "hash_ids": list(range(next_id, next_id + blocks)),
            }
            next_id += blocks
