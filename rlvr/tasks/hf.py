"""The ``hf`` task: prompts and gold answers from any Hugging Face ``datasets`` source.

``task.source`` is a local parquet / arrow / json / jsonl / csv file or glob, a directory of such files (splits
from the file names), a directory written by ``save_to_disk``, or a Hub dataset id (only where the Hub answers).
Each source row becomes a task row: ``prompt`` plus every source column, which reward functions receive as
keyword arguments (as in TRL). With ``task.answer_column`` set, ``answer`` holds the gold answer after the
``task.answer_format`` preset:

- raw: the column's text;
- gsm8k: the text after the last ``####``, thousands separators removed ("1,234" -> "1234");
- math: the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), as the math verifier reads completions.

When a preset rewrote a column itself named ``answer``, its original text moves to ``answer_raw``. A plain-string prompt
(a column or ``task.prompt_template``) is sent as ``[system: system prompt, user: text]`` so a chat model gets its
template; chat messages are sent as they are.
"""

from __future__ import annotations

import glob
import itertools
import os
import random
import re
import string
from pathlib import Path

from rlvr.verifiers.math import last_boxed

FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
HF_SYSTEM_PROMPT = 'Solve the problem step by step, then write "The answer is" and the final answer.'
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "gsm8k" or "openai/gsm8k"
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def gold_answer(value, answer_format: str) -> str | None:
    """The gold answer in ``value`` under a preset (raw, gsm8k, math), or None when the preset finds none."""
    text = "" if value is None else str(value)
    if answer_format == "gsm8k":
        text = _THOUSANDS.sub("", text.rsplit("####", 1)[1]) if "####" in text else ""
    elif answer_format == "math":
        text = last_boxed(text) or ""
    return text.strip() or None


def hf_rows(cfg, system_prompt: str) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows from a ``TaskConfig`` with ``name: hf`` (see the module docstring)."""
    splits = _open(cfg.source, cfg.subset, cfg.streaming)
    source = _split(cfg, splits, "train_split")
    if cfg.eval_split:
        train = _first(source, cfg.train_size or None)
        held_out = _first(_split(cfg, splits, "eval_split"), cfg.eval_size)
    else:
        train, held_out = _carve(cfg, source)
    if not train:
        raise ValueError(f"{cfg.source} split {cfg.train_split!r} has no rows")
    for rows, split in ((train, cfg.train_split), (held_out, cfg.eval_split or cfg.train_split)):
        if rows:
            _check_columns(cfg, split, list(rows[0][1]))
    return (
        [_task_row(cfg, row, f"{cfg.source} split {cfg.train_split!r} row {i}", system_prompt) for i, row in train],
        [_task_row(cfg, row, f"{cfg.source} split {cfg.eval_split or cfg.train_split!r} row {i}", system_prompt)
         for i, row in held_out],
    )


def _carve(cfg, source) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """Hold out eval_size rows chosen by task.seed: of the whole split (so they do not depend on train_size), or,
    streaming, of the first train_size + eval_size rows; training keeps the first train_size of the others."""
    import datasets

    pool = source if isinstance(source, datasets.Dataset) else list(
        itertools.islice(source, cfg.train_size + cfg.eval_size))
    n = len(pool)
    if n <= cfg.eval_size:
        raise ValueError(f"holding out task.eval_size={cfg.eval_size} rows of split {cfg.train_split!r} leaves "
                         f"none to train on (it has {n}); lower task.eval_size or name task.eval_split")
    held = sorted(random.Random(cfg.seed).sample(range(n), cfg.eval_size))
    kept = set(held)
    train = [i for i in range(n) if i not in kept][: cfg.train_size or None]
    return _at(pool, train), _at(pool, held)


def _at(pool, indices: list[int]) -> list[tuple[int, dict]]:
    rows = pool.select(indices) if hasattr(pool, "select") else (pool[i] for i in indices)
    return list(zip(indices, rows))


def _open(source: str, subset: str, streaming: bool) -> dict:
    """Split name -> Dataset (or IterableDataset when streaming)."""
    import datasets

    path = Path(source).expanduser()
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        saved = datasets.load_from_disk(str(path))  # memory-mapped: reading the first rows reads only those
        return {"train": saved} if isinstance(saved, datasets.Dataset) else dict(saved)
    if path.is_file() or glob.has_magic(source):
        builder = FILE_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(f"task.source {source!r}: unknown file type {path.suffix!r}; "
                             f"use one of {', '.join(FILE_BUILDERS)}, a directory, or a Hub dataset id")
        args, kwargs = (builder,), {"data_files": str(path)}
    elif path.is_dir():
        args, kwargs = (str(path),), {"name": subset or None}
    elif _HUB_ID.match(source) and path.suffix not in FILE_BUILDERS:
        _check_hub(source)
        args, kwargs = (source,), {"name": subset or None}
    else:
        raise FileNotFoundError(f"task.source {source!r}: no such file or directory")
    try:
        return dict(datasets.load_dataset(*args, **kwargs, streaming=streaming))
    except datasets.exceptions.DatasetGenerationError as err:  # says only "an error occurred"; name the cause
        raise ValueError(f"task.source {source!r} could not be read: {err.__cause__ or err}") from err


def _check_hub(source: str) -> None:
    """Fail fast, saying what to do, when the Hub does not answer (datasets would retry for ~25 s first)."""
    offline = (os.environ.get(v, "").lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if any(value in ("1", "true", "yes", "on") for value in offline):
        return  # offline mode: datasets loads the id from the local cache or says it is not there
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        httpx.head(endpoint, timeout=5.0)
    except httpx.HTTPError as err:
        raise ConnectionError(
            f"task.source {source!r} is not a local file or directory, so it was taken for a Hub dataset id, but the "
            f"Hugging Face Hub ({endpoint}) is not reachable from this machine ({err}). Download it where the Hub "
            f"is reachable (datasets.load_dataset({source!r}).save_to_disk(DIR), or its parquet files), copy it "
            "here and set task.source to that local path; a dataset already in the Hugging Face cache loads with "
            "HF_HUB_OFFLINE=1."
        ) from None


def _split(cfg, splits: dict, key: str):
    """The split named by ``task.<key>``, as plain Python values whatever format a saved dataset kept."""
    name = getattr(cfg, key)
    if name not in splits:
        hint = (" Set task.eval_split='' to hold out task.eval_size rows of the train split (chosen by task.seed)."
                if key == "eval_split" else "")
        raise ValueError(f"task.{key}={name!r}: {cfg.source} has no such split; splits present: "
                         f"{', '.join(splits)}.{hint}")
    return splits[name].with_format(None)


def _first(split, limit: int | None) -> list[tuple[int, dict]]:
    """The first ``limit`` rows (None: all) with their indices; a stream is read no further."""
    return list(enumerate(itertools.islice(split, limit)))


def _named_columns(cfg) -> list[tuple[str, str]]:
    """(config key, column) for every column the config names."""
    if cfg.prompt_template:
        fields = [f for _, f, _, _ in string.Formatter().parse(cfg.prompt_template) if f is not None]
        if any(not f.isidentifier() for f in fields):
            raise ValueError(f"task.prompt_template {cfg.prompt_template!r}: each {{field}} must name a column "
                             "(literal braces are doubled: {{ }})")
        named = [("task.prompt_template", f) for f in fields]
    else:
        named = [("task.prompt_column", cfg.prompt_column)]
    return named + ([("task.answer_column", cfg.answer_column)] if cfg.answer_column else [])


def _check_columns(cfg, split: str, present: list[str]) -> None:
    missing = [f"{col!r} ({key})" for key, col in _named_columns(cfg) if col not in present]
    if missing:
        raise ValueError(f"{cfg.source} split {split!r} has no column {', '.join(missing)}; "
                         f"columns present: {', '.join(present)}")


def _task_row(cfg, source_row: dict, where: str, system_prompt: str) -> dict:
    if cfg.prompt_template:
        prompt = cfg.prompt_template.format_map(source_row)
    else:
        prompt = source_row[cfg.prompt_column]
    row = {**source_row, "prompt": _messages(prompt, where, system_prompt)}
    if cfg.answer_column:
        gold = gold_answer(source_row[cfg.answer_column], cfg.answer_format)
        if gold is None:
            shown = str(source_row[cfg.answer_column])[-80:]
            needs = {"raw": "a non-empty answer", "gsm8k": "'#### <answer>'", "math": "a \\boxed{...} answer"}
            raise ValueError(f"{where}: task.answer_format={cfg.answer_format} needs {needs[cfg.answer_format]} in "
                             f"column {cfg.answer_column!r}, which ends {shown!r}; fix the row or pick another "
                             "answer_format (raw, gsm8k, math)")
        if cfg.answer_column == "answer" and cfg.answer_format != "raw":
            row["answer_raw"] = source_row["answer"]
        row["answer"] = gold
    return row


def _messages(prompt, where: str, system_prompt: str) -> list[dict]:
    """A string becomes [system, user]; chat messages are kept (role and content only)."""
    if isinstance(prompt, str) and prompt.strip():
        return [{"role": "system", "content": system_prompt}] * bool(system_prompt) + [
            {"role": "user", "content": prompt}
        ]
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise ValueError(f"{where}: the prompt must be a non-empty string or chat messages [{{'role', 'content'}}, ...]; "
                     f"got {prompt!r:.80}")
