"""Load prompts and answer columns from JSON Lines files.

Each line is an object with either ``prompt`` (a string, used as is) or ``messages`` (chat messages,
rendered with the tokenizer's chat template); every other key is a column handed to reward functions.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict]:
    """Rows of a JSONL file, validated: a prompt, the same columns on every line, the ``required`` ones."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    rows = []
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
            if "messages" in row and "prompt" not in row:
                row["prompt"] = row.pop("messages")
            prompt = row.get("prompt")
            if isinstance(prompt, str):
                ok = bool(prompt.strip())
            else:
                ok = isinstance(prompt, list) and bool(prompt) and all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in prompt
                )
            if not ok:
                raise ValueError(
                    f"{path}:{lineno}: needs a non-empty 'prompt' string or 'messages' list of "
                    "{'role', 'content'} objects"
                )
            missing_required = [c for c in required if c not in row]
            if missing_required:
                raise ValueError(f"{path}:{lineno}: missing required column(s) {missing_required} for this task")
            if rows and set(row) != set(rows[0]):
                missing, extra = sorted(set(rows[0]) - set(row)), sorted(set(row) - set(rows[0]))
                raise ValueError(
                    f"{path}:{lineno}: columns differ from the first row (missing {missing}, extra {extra}); "
                    "every row needs the same columns, since reward functions receive them all"
                )
            rows.append(row)
    if not rows:
        raise ValueError(f"dataset file {path} has no rows")
    return rows
