"""Importing rlvr leaves the process's Hugging Face settings alone; rlvr's own loading finds a Hub id in the local
Hugging Face cache (or the built-in alias of that model) without the network, and says what to do otherwise."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlvr.cli import main
from rlvr.models.policy import resolve_model_dir

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import json, os
{imports}
import datasets.config, huggingface_hub.constants
print(json.dumps([os.environ.get("HF_HUB_OFFLINE"), os.environ.get("HF_DATASETS_OFFLINE"),
                  huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE]))
"""


def _probe(imports: str) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_rlvr_changes_no_offline_setting():
    untouched = [None, None, False, False]  # the user set nothing: the Hub clients are online
    assert _probe("") == untouched
    assert _probe("import rlvr\nfrom rlvr import GRPOTrainer, GRPOConfig") == untouched


def _cache_snapshot(cache: Path, repo: str, model_dir: Path) -> Path:
    """The Hugging Face cache layout of one downloaded revision: models--ORG--NAME/{refs/main, snapshots/REV/}."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0123abcd")
    snapshot = folder / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    return snapshot


def test_a_hub_id_in_the_hugging_face_cache_loads_from_there(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = _cache_snapshot(tmp_path / "hub", "someone/tiny-llama", tiny_model_dir)
    assert resolve_model_dir("someone/tiny-llama") == snapshot.resolve()


def test_a_hub_id_of_an_alias_falls_back_to_the_alias(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "rlvr"))
    converted = tmp_path / "rlvr" / "models" / "smollm2-135m-instruct"  # as offline_models leaves a converted alias
    shutil.copytree(tiny_model_dir, converted)
    assert resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct") == converted
    assert "using the built-in alias 'smollm2-135m-instruct'" in capsys.readouterr().out


def test_a_hub_id_nowhere_on_disk_is_one_line_saying_what_to_do(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    config = tmp_path / "c.yaml"
    config.write_text("model: {name: nobody/no-such-model}\n")
    assert main(["eval", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("rlvr: error: model 'nobody/no-such-model' is neither a built-in alias")
    assert "hf download nobody/no-such-model" in err


@pytest.mark.parametrize("source", ["gsm_dat", "data/gsm_dat"])
def test_a_mistyped_local_source_folder_is_one_line(tmp_path, monkeypatch, capsys, source):
    (tmp_path / "data" / "gsm_data").mkdir(parents=True)
    (tmp_path / "gsm_data").mkdir()
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(f"task: {{name: hf, source: {source}, answer_format: gsm8k}}\n"
                      "rewards: [{name: math_correct}]\n")
    assert main(["eval", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (f"rlvr: error: task.source {source!r}: no such file or directory; did you mean "
                   f"{source.replace('gsm_dat', 'gsm_data')!r}?\n")


def _cached_hub_dataset(cache: Path, repo: str, rows: list[dict], work: Path) -> None:
    """A Hub dataset as datasets caches it once loaded: CACHE/ORG___NAME/CONFIG/VERSION/HASH/NAME-SPLIT.arrow."""
    import datasets

    (work / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = datasets.load_dataset_builder("json", data_files={"train": str(work / "rows.jsonl")},
                                            cache_dir=str(work / "built"))
    builder.download_and_prepare()
    built = Path(builder.cache_dir)
    org, name = repo.split("/")
    target = cache / f"{org}___{name}" / "default" / "0.0.0" / built.name
    target.mkdir(parents=True)
    shutil.copy(built / "dataset_info.json", target)
    shutil.copy(built / "json-train.arrow", target / f"{name}-train.arrow")


def test_a_hub_dataset_in_the_cache_loads_while_the_hub_is_unreachable(tmp_path, monkeypatch, capsys):
    import datasets.config
    import huggingface_hub.constants

    from rlvr.config.loading import load_config
    from rlvr.tasks import load_task

    rows = [{"question": f"What is {a} + 1?", "answer": f"so #### {a + 1}"} for a in range(4)]
    _cached_hub_dataset(tmp_path / "datasets", "someone/sums", rows, tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the Hub is unreachable
    online = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    task = ["task.name=hf", "task.prompt_column=question", "task.answer_format=gsm8k", "task.eval_size=1",
            "task.eval_split=", "rewards=[{name: math_correct}]"]
    train, held_out, _ = load_task(load_config(None, [*task, "task.source=someone/sums"]).task)
    assert sorted(r["answer"] for r in train + held_out) == ["1", "2", "3", "4"]
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == online  # restored

    config = tmp_path / "c.yaml"  # not in the cache: one line saying what to do
    fields = dict(t.removeprefix("task.").split("=", 1) for t in task[:-1])
    fields["source"] = "nobody/none"
    config.write_text(yaml.safe_dump({"task": fields, "rewards": [{"name": "math_correct"}]}))
    capsys.readouterr()
    assert main(["eval", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlvr: error: task.source 'nobody/none' is not a local file")
    assert "this one is not in it" in err
