"""Local dataset files checked before ``datasets`` opens them: a dataset folder may come from someone else.

``datasets.load_from_disk`` opens whatever the folder's ``state.json`` names (``"_data_files": [{"filename":
"../../elsewhere.arrow"}]`` reads a file outside it) and each split ``dataset_dict.json`` names (``"../x"``), and
any reader blocks for good on a FIFO. So a ``save_to_disk`` folder must name only plain file and split names, each a
regular file or folder directly inside it (no symbolic link), with its JSON bounded; the files of a glob or a
data folder must be regular files. Errors are ``ValueError``, one line naming the file and what to do."""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 1 << 20  # state.json, dataset_info.json, dataset_dict.json: a few KB as datasets writes them
MAX_FILES = 100_000  # entries looked at in one data folder
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=-]{0,254}")  # data-00000-of-00001.arrow, train, test: no separator


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "a socket" if stat.S_ISSOCK(mode) else "a device" if not stat.S_ISDIR(mode) else "a folder"


def _entry(folder: Path, name: str, folder_wanted: bool = False) -> Path:
    """``folder/name`` when it is a plain name and a regular file (or, ``folder_wanted``, a folder) right there."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"{folder}: names {str(name)[:80]!r}, not a plain file name inside it; a save_to_disk "
                         "folder names only its own files: save the dataset again")
    path = folder / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise ValueError(f"{path} is missing; save the dataset again") from None
    if not (stat.S_ISDIR(mode) if folder_wanted else stat.S_ISREG(mode)):
        wanted = "a folder" if folder_wanted else "a regular file"
        raise ValueError(f"{path} is {_kind(mode)}, not {wanted}; a dataset folder holds no links, FIFOs or "
                         "devices: replace it with the real file")
    return path


def _json(folder: Path, name: str) -> Any:
    path = _entry(folder, name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped since the check
            raise ValueError(f"{path} is not a regular file; replace it with the real file")
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{path} is larger than datasets writes (over {MAX_JSON_BYTES} bytes); save the dataset again")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError(f"{path} is not JSON; save the dataset again") from None


def check_saved_dataset(folder: Path) -> None:
    """A ``save_to_disk`` folder (a Dataset, or a DatasetDict of split folders) that names only its own files."""
    if os.path.lexists(folder / "dataset_dict.json"):
        splits = _json(folder, "dataset_dict.json")
        splits = splits.get("splits") if isinstance(splits, dict) else None
        if not isinstance(splits, list) or not splits:
            raise ValueError(f"{folder / 'dataset_dict.json'} lists no splits; save the dataset again")
        for split in splits:
            _check_split(_entry(folder, split, folder_wanted=True))
    else:
        _check_split(folder)


def _check_split(folder: Path) -> None:
    state = _json(folder, "state.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) for f in files):
        raise ValueError(f"{folder / 'state.json'} lists no data files; save the dataset again")
    for data_file in files:
        _entry(folder, data_file.get("filename"))
    _json(folder, "dataset_info.json")


def check_data_files(source: str, path: Path) -> None:
    """Every file a glob ``source``, or a data folder ``path``, would hand to ``datasets``: a regular file (a FIFO
    would block the reader for good; a link is followed only to a regular file)."""
    if glob.has_magic(source):
        found = (Path(p) for p in glob.iglob(os.path.expanduser(source), recursive=True))
    elif path.is_dir():
        found = (Path(root, name) for root, _, names in os.walk(path) for name in names)
    else:
        return
    for count, file in enumerate(found):
        if count == MAX_FILES:
            return
        try:
            mode = os.stat(file).st_mode
        except OSError:  # a dangling link: datasets names it
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ValueError(f"task.source: {file} is {_kind(mode)}, not a regular file (reading it would block "
                             "for good); remove it or narrow task.source")
