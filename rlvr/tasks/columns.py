"""The column map: how a source row (a JSONL line, a Hugging Face dataset row) becomes a task row.

One mechanism for every task that reads rows (``jsonl``, ``math_jsonl``, ``code_jsonl``, ``hf``), configured by the
same keys: ``task.prompt_column`` / ``task.prompt_template``, ``task.answer_column``, ``task.answer_format`` and
``task.system_prompt``. A task row is the source row (every column, which reward functions receive as keyword
arguments, as in TRL) plus:

- ``prompt``: from the column ``prompt`` (or ``messages`` when there is no ``prompt``), as TRL reads it: a string is
  the prompt text, sent as it is; chat messages ``[{role, content}, ...]`` are sent as they are (role and content
  only). From any other column, or from ``task.prompt_template``, a string is a question, sent as the chat messages
  ``[{system: system prompt}, {user: text}]`` so a chat model gets its template; chat messages are sent as they are.
- ``answer``: the gold answer read from ``task.answer_column`` by the ``task.answer_format`` preset:

  - raw: the column's text;
  - gsm8k: the text after the last ``####``, thousands separators removed ("1,234" -> "1234");
  - math: the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), as the math verifier reads completions.

  When a preset rewrote a column itself named ``answer``, its original text moves to ``answer_raw``. The answer
  column must exist and hold an answer on every row when the task needs one (``math_jsonl``, ``hf``) or the config
  names it (a column other than ``answer``, or a preset other than raw); otherwise an ``answer`` column is passed on
  as it is, and a row without one has none.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from rlvr.verifiers.math import last_boxed

# The system message of a question column's prompts when task.system_prompt is left at its (arithmetic) default.
STEP_BY_STEP_SYSTEM_PROMPT = 'Solve the problem step by step, then write "The answer is" and the final answer.'
ANSWER_FORMATS = ("raw", "gsm8k", "math")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NEEDS = {"raw": "a non-empty answer", "gsm8k": "'#### <answer>'", "math": "a \\boxed{...} answer"}


def gold_answer(value, answer_format: str) -> str | None:
    """The gold answer in ``value`` under a preset (raw, gsm8k, math), or None when the preset finds none."""
    text = "" if value is None else str(value)
    if answer_format == "gsm8k":
        text = _THOUSANDS.sub("", text.rsplit("####", 1)[1]) if "####" in text else ""
    elif answer_format == "math":
        text = last_boxed(text) or ""
    return text.strip() or None


@dataclass(frozen=True)
class ColumnMap:
    """Which source columns hold the prompt and the gold answer, and how they are read (module docstring)."""

    prompt_column: str = "prompt"
    prompt_template: str = ""
    answer_column: str = "answer"
    answer_format: str = "raw"
    system_prompt: str = ""
    answer_required: bool = False  # the task needs a gold answer (math_jsonl, hf)

    @classmethod
    def of(cls, task, system_prompt: str, answer_required: bool) -> ColumnMap:
        """The column map of a ``TaskConfig``."""
        return cls(task.prompt_column, task.prompt_template, task.answer_column, task.answer_format, system_prompt,
                   answer_required)

    @property
    def reads_answer(self) -> bool:
        """Whether the answer column is read (required on every row) rather than passed on as it is."""
        return bool(self.answer_column) and (
            self.answer_required or self.answer_column != "answer" or self.answer_format != "raw")

    def named_columns(self) -> list[tuple[str, str]]:
        """(config key, column) for every column the map needs."""
        if self.prompt_template:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.prompt_template) if f is not None]
            if any(not f.isidentifier() for f in fields):
                raise ValueError(f"task.prompt_template {self.prompt_template!r}: each {{field}} must name a column "
                                 "(literal braces are doubled: {{ }})")
            named = [("task.prompt_template", f) for f in fields]
        else:
            named = [("task.prompt_column", self.prompt_column)]
        return named + ([("task.answer_column", self.answer_column)] if self.reads_answer else [])

    def check_columns(self, where: str, present: list[str]) -> None:
        """A one-line error naming each needed column that ``where`` lacks, the columns it has, and the keys to set."""
        missing, fixes = [], []
        for key, col in self.named_columns():
            if key == "task.prompt_column" and col == "prompt":
                if "prompt" not in present and "messages" not in present:
                    missing.append(f"'prompt' or 'messages' ({key})")
            elif col not in present:
                missing.append(f"{col!r} ({key})")
            else:
                continue
            fixes.append("set task.answer_column to the column holding the gold answer ('' for none)"
                         if key == "task.answer_column" else
                         "set task.prompt_column to the column holding the prompt (a question string or chat "
                         "messages), or build it with task.prompt_template")
        if missing:
            raise ValueError(f"{where} has no column {', '.join(missing)}; columns present: {', '.join(present)}; "
                             f"{'; '.join(dict.fromkeys(fixes))} (docs/data.md)")

    def row(self, source_row: dict, where: str) -> dict:
        """The task row of one source row (module docstring); ``where`` names it in errors."""
        row = dict(source_row)
        if self.prompt_template:
            try:
                prompt, question = self.prompt_template.format_map(source_row), True
            except KeyError as err:
                raise ValueError(f"{where}: task.prompt_template {self.prompt_template!r} names column {err}, which "
                                 f"this row lacks; columns present: {', '.join(source_row)}") from None
        elif self.prompt_column == "prompt" and "prompt" not in row and "messages" in row:
            prompt, question = row.pop("messages"), False  # TRL's conversational column, under its SFT name
        else:
            prompt, question = row[self.prompt_column], self.prompt_column != "prompt"
        row["prompt"] = _prompt(prompt, question, self.system_prompt, where)
        if self.reads_answer:
            value = source_row[self.answer_column]
            gold = gold_answer(value, self.answer_format)
            if gold is None:
                raise ValueError(f"{where}: task.answer_format={self.answer_format} needs {_NEEDS[self.answer_format]} "
                                 f"in column {self.answer_column!r}, which ends {str(value)[-80:]!r}; fix the row or "
                                 f"pick another answer_format ({', '.join(ANSWER_FORMATS)})")
            if self.answer_column == "answer" and self.answer_format != "raw":
                row["answer_raw"] = value
            row["answer"] = gold
        return row


def _prompt(prompt, question: bool, system_prompt: str, where: str):
    """A question string becomes [system, user]; a prompt string stays as it is; chat messages keep role and
    content only."""
    if isinstance(prompt, str) and prompt.strip():
        if not question:
            return prompt
        return [{"role": "system", "content": system_prompt}] * bool(system_prompt) + [
            {"role": "user", "content": prompt}
        ]
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ValueError(f"{where}: the prompt must be a non-empty string or chat messages [{{'role', 'content'}}, ...]; "
                     f"got {prompt!r:.80}")


def held_out_indices(num_rows: int, count: int, seed: int) -> list[int]:
    """``count`` of ``num_rows`` row indices, chosen by ``seed`` (task.seed), in ascending order."""
    return sorted(random.Random(seed).sample(range(num_rows), count))


def eval_fraction_count(fraction: float, num_rows: int, where: str) -> int:
    """How many of ``num_rows`` rows ``task.eval_fraction`` holds out: round(fraction x rows); an error when that
    leaves either side empty."""
    count = round(fraction * num_rows)
    if count < 1 or count >= num_rows:
        fix = "raise task.eval_fraction" if count < 1 else "lower task.eval_fraction"
        raise ValueError(f"task.eval_fraction={fraction} of the {num_rows} rows of {where} holds out {count} and "
                         f"leaves {num_rows - count} to train on; each side needs at least one row: {fix}, or add "
                         "rows")
    return count
