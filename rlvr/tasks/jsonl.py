"""Load prompts and answer columns from JSON Lines files.

Each line is a JSON object; every line has the same keys. Lines become task rows through the column map of
``rlvr.tasks.columns``, the same one the ``hf`` task uses: by default the prompt is the ``prompt`` key (a string,
sent as it is, or chat messages) or ``messages``; ``task.prompt_column`` / ``task.prompt_template`` name another
column (GSM8K's ``question``), ``task.answer_column`` / ``task.answer_format`` the gold answer. Every key is a
column handed to reward functions.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlvr.tasks.columns import ColumnMap


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line, checked: valid JSON objects, the same keys on every line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    rows: list[tuple[int, dict]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")  # noqa: TRY004 (bad input)
            if rows and _keys(row) != _keys(rows[0][1]):
                first = _keys(rows[0][1])
                missing, extra = sorted(first - _keys(row)), sorted(_keys(row) - first)
                raise ValueError(
                    f"{path}:{lineno}: columns differ from the first row (missing {missing}, extra {extra}); "
                    "every row needs the same columns, since reward functions receive them all"
                )
            rows.append((lineno, row))
    if not rows:
        raise ValueError(f"dataset file {path} has no rows")
    return rows


def _keys(row: dict) -> set[str]:
    """A row's columns, ``messages`` counted as ``prompt`` where it stands for it (rows may mix the two)."""
    keys = set(row)
    return keys - {"messages"} | {"prompt"} if "messages" in keys and "prompt" not in keys else keys


def load_jsonl(path: str | Path, required: tuple[str, ...] = (), columns: ColumnMap | None = None) -> list[dict]:
    """Task rows of a JSONL file through ``columns`` (default: ``prompt`` or ``messages``, an ``answer`` passed on as
    it is); ``required``: further columns every row must have."""
    columns = columns or ColumnMap()
    rows = read_jsonl(path)
    lineno, first = rows[0]
    columns.check_columns(str(path), list(first))
    missing = [c for c in required if c not in first]
    if missing:
        raise ValueError(f"{path}:{lineno}: missing required column(s) {missing} for this task")
    return [columns.row(row, f"{path}:{lineno}") for lineno, row in rows]
