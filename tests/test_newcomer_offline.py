"""Importing rlvr leaves the process's Hugging Face settings alone; rlvr's own loading finds a Hub id in the local
Hugging Face cache (or the built-in alias of that model) without the network, and says what to do otherwise."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.cli import main
from rlvr.models import resolve_model_dir

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
