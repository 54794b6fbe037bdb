"""The ``hf`` task: prompts and gold answers from any Hugging Face ``datasets`` source.

``task.source`` is a local parquet / arrow / json / jsonl / csv file or glob, a directory of such files (splits
from the file names), a directory written by ``save_to_disk``, or a Hub dataset id (only where the Hub answers).
Each source row becomes a task row through the column map of ``rlvr.tasks.columns``, the same one the JSONL tasks
use: ``prompt`` plus every source column, which reward functions receive as keyword arguments (as in TRL), and
``answer``, the gold answer read from ``task.answer_column`` by the ``task.answer_format`` preset (raw, gsm8k, math).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path

from rlvr.tasks.columns import STEP_BY_STEP_SYSTEM_PROMPT, ColumnMap, eval_fraction_count, gold_answer, held_out_indices
from rlvr.tasks.local_data import check_data_files, check_saved_dataset

FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
HF_SYSTEM_PROMPT = STEP_BY_STEP_SYSTEM_PROMPT
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "gsm8k" or "openai/gsm8k"


def hf_rows(cfg, system_prompt: str) -> tuple[list[dict], list[dict]]:
    """Train and held-out rows from a ``TaskConfig`` with ``name: hf`` (see the module docstring)."""
    columns = ColumnMap.of(cfg, system_prompt, answer_required=True)
    splits = _open(cfg.source, cfg.subset, cfg.streaming)
    source = _split(cfg, splits, "train_split")
    eval_split = cfg.eval_split if cfg.eval_split and not cfg.eval_fraction else cfg.train_split
    if cfg.eval_fraction:
        train, held_out = _carve(cfg, source, fraction=True)
        held_out = held_out[: cfg.eval_size]
    elif cfg.eval_split:
        train = _first(source, cfg.train_size or None)
        held_out = _first(_split(cfg, splits, "eval_split"), cfg.eval_size)
    else:
        train, held_out = _carve(cfg, source)
    if not train:
        raise ValueError(f"{cfg.source} split {cfg.train_split!r} has no rows")
    for rows, split in ((train, cfg.train_split), (held_out, eval_split)):
        if rows:
            columns.check_columns(f"{cfg.source} split {split!r}", list(rows[0][1]))
    return (
        [columns.row(row, f"{cfg.source} split {cfg.train_split!r} row {i}") for i, row in train],
        [columns.row(row, f"{cfg.source} split {eval_split!r} row {i}") for i, row in held_out],
    )


def _carve(cfg, source, fraction: bool = False) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """Hold out rows of the train split chosen by task.seed: task.eval_size of them, or with ``fraction``
    round(task.eval_fraction x rows); of the whole split (so they do not depend on train_size), or, streaming, of the
    first train_size + eval_size rows. Training keeps the first train_size of the others."""
    import datasets

    if fraction and not isinstance(source, datasets.Dataset):
        raise ValueError("task.eval_fraction needs the length of the split, which streaming does not know; set "
                         "task.eval_split='' and task.eval_size instead")
    pool = source if isinstance(source, datasets.Dataset) else list(
        itertools.islice(source, cfg.train_size + cfg.eval_size))
    n = len(pool)
    if fraction:
        count = eval_fraction_count(cfg.eval_fraction, n, f"{cfg.source} split {cfg.train_split!r}")
    elif n <= cfg.eval_size:
        raise ValueError(f"holding out task.eval_size={cfg.eval_size} rows of split {cfg.train_split!r} leaves "
                         f"none to train on (it has {n}); lower task.eval_size or name task.eval_split")
    else:
        count = cfg.eval_size
    held = held_out_indices(n, count, cfg.seed)
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
    offline = False  # True: a Hub id the unreachable Hub cannot serve, loaded from the datasets cache
    if path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
        check_saved_dataset(path)  # names only its own regular files: no "../", no link, no FIFO
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
    elif _HUB_ID.match(source) and path.suffix not in FILE_BUILDERS and not _mistyped_path(path):
        offline = _check_hub(source)
        args, kwargs = (source,), {"name": subset or None}
    else:
        raise FileNotFoundError(f"task.source {source!r}: no such file or directory{_did_you_mean(path)}")
    check_data_files(source, path)  # no FIFO among the files of a glob or a folder
    try:
        with _hub_offline(offline):
            return dict(datasets.load_dataset(*args, **kwargs, streaming=streaming))
    except datasets.exceptions.DatasetGenerationError as err:  # says only "an error occurred"; name the cause
        raise ValueError(f"task.source {source!r} could not be read: {err.__cause__ or err}") from err


def _mistyped_path(path: Path) -> bool:
    """Whether a source that is no file or directory was meant as a local path rather than a Hub id: its folder
    exists here (data/gsm8_train where data/ does), or its name is close to something in the working directory."""
    if path.parent != Path(".") and path.parent.is_dir():
        return True
    return bool(_did_you_mean(path))


def _did_you_mean(path: Path) -> str:
    """'; did you mean ...?' naming the entry of the path's folder closest to its name, or '' when none is close."""
    import difflib

    try:
        names = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names[:1000], n=1, cutoff=0.8)
    return f"; did you mean {str(path.parent / close[0])!r}?" if close else ""


def _check_hub(source: str) -> bool:
    """Whether to load Hub id ``source`` offline, from the datasets cache: when the Hub does not answer and the
    cache holds it. Neither: fail fast, saying what to do (datasets would retry for ~25 s first)."""
    offline = (os.environ.get(v, "").lower() for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    if any(value in ("1", "true", "yes", "on") for value in offline):
        return False  # the user's offline mode: datasets loads the id from the local cache or says it is not there
    import httpx

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        httpx.head(endpoint, timeout=5.0)
    except httpx.HTTPError as err:
        if _in_datasets_cache(source):
            return True
        raise ConnectionError(
            f"task.source {source!r} is not a local file or directory, so it was taken for a Hub dataset id, but the "
            f"Hugging Face Hub ({endpoint}) is not reachable from this machine ({err}). Download it where the Hub "
            f"is reachable (datasets.load_dataset({source!r}).save_to_disk(DIR), or its parquet files), copy it "
            "here and set task.source to that local path (a dataset already in the datasets cache loads from "
            "there; this one is not in it)."
        ) from None
    return False


def _in_datasets_cache(source: str) -> bool:
    """Whether the datasets cache (HF_DATASETS_CACHE) holds a prepared copy of Hub dataset ``source``."""
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    *namespace, name = source.split("/")
    folder = "___".join([*namespace, camelcase_to_snakecase(name)])
    return any(p.is_dir() for p in (Path(datasets.config.HF_DATASETS_CACHE).expanduser() / folder).glob("*/*/*"))


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """datasets and huggingface_hub in offline mode for rlvr's own load only (their settings restored after)."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    kept = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = kept


def _split(cfg, splits: dict, key: str):
    """The split named by ``task.<key>``, as plain Python values whatever format a saved dataset kept."""
    name = getattr(cfg, key)
    if name not in splits:
        hint = (" Set task.eval_split='' to hold out task.eval_size rows of the train split (chosen by task.seed), "
                "or task.eval_fraction to hold out that share of them." if key == "eval_split" else "")
        raise ValueError(f"task.{key}={name!r}: {cfg.source} has no such split; splits present: "
                         f"{', '.join(splits)}.{hint}")
    return splits[name].with_format(None)


def _first(split, limit: int | None) -> list[tuple[int, dict]]:
    """The first ``limit`` rows (None: all) with their indices; a stream is read no further."""
    return list(enumerate(itertools.islice(split, limit)))


__all__ = ["HF_SYSTEM_PROMPT", "gold_answer", "hf_rows"]
