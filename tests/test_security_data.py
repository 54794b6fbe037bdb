"""Security review (issue 39), task.name=hf over a dataset folder someone else wrote: a save_to_disk folder whose
state.json or dataset_dict.json names files outside it, links and FIFOs among its files, and a FIFO among the files
of a glob or a data folder. Each is one line naming the file; none is opened (a FIFO would block for good)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pytest

from rlvr.config.schema import TaskConfig
from rlvr.tasks import load_task
from rlvr.tasks.local_data import check_data_files, check_saved_dataset

ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
SECRET = [{"question": "the operator's private row", "answer": "42"}] * 6


def _task(source) -> TaskConfig:
    return TaskConfig(name="hf", source=str(source), prompt_column="question", eval_split="", eval_size=1)


def _saved(folder: Path, rows: list[dict], splits: bool = False) -> Path:
    data = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({"train": data}) if splits else data).save_to_disk(folder)
    return folder


def _edit_json(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_saved_dataset_still_loads(tmp_path):
    train, held_out, _ = load_task(_task(_saved(tmp_path / "mine", ROWS)))
    assert len(train) + len(held_out) == 6


def test_state_json_naming_an_arrow_file_outside_is_refused(tmp_path):
    _saved(tmp_path / "outside", SECRET)
    mine = _saved(tmp_path / "mine", ROWS)
    (outside_file,) = (tmp_path / "outside").glob("*.arrow")
    _edit_json(mine / "state.json", _data_files=[{"filename": f"../outside/{outside_file.name}"}])
    with pytest.raises(ValueError, match=rf"^{mine}: names '\.\./outside/{outside_file.name}', not a plain file "
                                         r"name inside it; a save_to_disk folder names only its own files"):
        load_task(_task(mine))  # before the fix: the training rows were the secret ones


def test_dataset_dict_naming_a_split_outside_is_refused(tmp_path):
    _saved(tmp_path / "outside", SECRET)
    mine = _saved(tmp_path / "mine", ROWS, splits=True)
    _edit_json(mine / "dataset_dict.json", splits=["../outside"])
    with pytest.raises(ValueError, match=r"names '\.\./outside', not a plain file name inside it"):
        load_task(_task(mine))


def test_a_linked_arrow_file_is_refused(tmp_path):
    _saved(tmp_path / "outside", SECRET)
    mine = _saved(tmp_path / "mine", ROWS)
    (arrow,) = mine.glob("*.arrow")
    arrow.unlink()
    arrow.symlink_to(next((tmp_path / "outside").glob("*.arrow")))
    with pytest.raises(ValueError, match=rf"^{arrow} is a symbolic link, not a regular file"):
        load_task(_task(mine))


def test_a_fifo_arrow_file_is_refused_unopened(tmp_path):
    mine = _saved(tmp_path / "mine", ROWS)
    (arrow,) = mine.glob("*.arrow")
    arrow.unlink()
    os.mkfifo(arrow)  # before the fix, loading blocked here for good
    with pytest.raises(ValueError, match=rf"^{arrow} is a FIFO, not a regular file"):
        check_saved_dataset(mine)
    with pytest.raises(ValueError, match=rf"^{arrow} is a FIFO"):
        load_task(_task(mine))


def test_a_fifo_state_json_is_refused_unopened(tmp_path):
    mine = _saved(tmp_path / "mine", ROWS)
    (mine / "dataset_info.json").unlink()
    os.mkfifo(mine / "dataset_info.json")
    with pytest.raises(ValueError, match=r"dataset_info\.json is a FIFO"):
        load_task(_task(mine))


def test_a_fifo_among_a_globs_or_a_folders_files_is_refused(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    os.mkfifo(folder / "test.jsonl")
    for source in (f"{folder}/*.jsonl", str(folder)):
        with pytest.raises(ValueError, match=rf"^task\.source: {folder / 'test.jsonl'} is a FIFO, not a regular "
                                             r"file \(reading it would block for good\)"):
            check_data_files(source, Path(source))
        with pytest.raises(ValueError, match=r"test\.jsonl is a FIFO"):
            load_task(_task(source))
