"""The allocator the rlvr command runs on (platform/allocator.py): what RLVR_ALLOCATOR picks, and a real `rlvr`
process that re-executes itself with mimalloc preloaded, runs on it, and hands its children the environment it was
given."""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr.platform import allocator
from rlvr.platform.allocator import SETTINGS, chosen_library, mimalloc_library, preload_environment

ROOT = Path(__file__).resolve().parent.parent
WHEEL = sys.platform.startswith("linux") and platform.machine() == "x86_64"  # where pyproject installs cmeel-mimalloc


def test_a_visible_nvidia_gpu_is_read_off_device_nodes_and_cuda_visible_devices(tmp_path, monkeypatch):
    nodes = [str(tmp_path / "nvidia0")]
    monkeypatch.setattr(allocator.glob, "glob", lambda pattern: nodes if pattern == "/dev/nvidia[0-9]*" else [])
    assert allocator.nvidia_gpu_visible({})
    assert allocator.nvidia_gpu_visible({"CUDA_VISIBLE_DEVICES": "1"})
    assert not allocator.nvidia_gpu_visible({"CUDA_VISIBLE_DEVICES": ""})
    assert not allocator.nvidia_gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"})
    nodes.clear()
    assert not allocator.nvidia_gpu_visible({})


def test_the_setting_picks_the_library(tmp_path):
    assert chosen_library("system") is None
    assert chosen_library("auto", platform="darwin") is None  # preloading is a Linux (glibc loader) matter
    assert chosen_library("auto", gpu=False) == mimalloc_library()
    assert chosen_library("auto", gpu=True) is None  # a GPU run: CUDA's allocator holds the tensors
    assert chosen_library("mimalloc", gpu=True) == mimalloc_library()  # asked for by name: wherever installed
    library = tmp_path / "libjemalloc.so.2"
    library.write_bytes(b"")
    assert chosen_library(str(library)) == library.resolve()
    with pytest.raises(ValueError, match="RLVR_ALLOCATOR='/nowhere/libx.so': not a file; set it to auto, mimalloc"):
        chosen_library("/nowhere/libx.so")


def test_the_environment_a_script_preloads_with(tmp_path):
    """``env $(python -m rlvr.platform.allocator --env) python train.py``: the library first, then what LD_PRELOAD
    held; mimalloc's settings unless the environment sets them."""
    library = tmp_path / "libmimalloc.so"
    library.write_bytes(b"")
    assert preload_environment({"RLVR_ALLOCATOR": "system"}) == {}
    got = preload_environment({"RLVR_ALLOCATOR": str(library), "LD_PRELOAD": "/x/libother.so"})
    assert got == {"LD_PRELOAD": f"{library.resolve()}:/x/libother.so", "MIMALLOC_PURGE_DELAY": "10000",
                   "MIMALLOC_ALLOW_THP": "0"}
    assert preload_environment({"RLVR_ALLOCATOR": str(library), "MIMALLOC_ALLOW_THP": "1"}) == \
        {"LD_PRELOAD": str(library.resolve()), "MIMALLOC_PURGE_DELAY": "10000"}
    env = {**os.environ, "RLVR_ALLOCATOR": str(library)}
    env.pop("LD_PRELOAD", None)
    env.pop("MIMALLOC_PURGE_DELAY", None)
    env.pop("MIMALLOC_ALLOW_THP", None)
    printed = subprocess.run([sys.executable, "-m", "rlvr.platform.allocator", "--env"], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
    assert printed == [f"LD_PRELOAD={library.resolve()}", *(f"{k}={v}" for k, v in SETTINGS.items())]


@pytest.mark.long
@pytest.mark.skipif(not WHEEL, reason="cmeel-mimalloc is installed on Linux x86-64 only")
def test_the_rlvr_command_runs_on_mimalloc_and_its_children_choose_for_themselves(tiny_model_dir, tmp_path):
    """A tiny training run through `python -m rlvr train`: its summary names mimalloc; a reward function called in
    it sees the environment the command was started with (no LD_PRELOAD, none of the re-execution's marks)."""
    assert mimalloc_library() is not None and mimalloc_library().is_file()
    (tmp_path / "seen.py").write_text(
        "import json, os\n"
        "def seen(completions, **kw):\n"
        f"    open({str(tmp_path / 'env.json')!r}, 'w').write(json.dumps(dict(os.environ)))\n"
        "    return [0.0] * len(completions)\n")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and k != "RLVR_ALLOCATOR" and
           not k.startswith("MIMALLOC_")}
    args = ["examples/demo.yaml", f"model.name={tiny_model_dir}", f"output_dir={out}", "train.steps=1",
            "train.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "task.eval_size=2",
            "eval.every=0", "log.progress=false", "log.plot=false", "log.trackers=[]", f"import_dirs=[{tmp_path}]",
            "rewards=[{name: 'seen:seen'}]"]
    done = subprocess.run([sys.executable, "-m", "rlvr", "train", *args], check=False, cwd=ROOT,
                          env={**env, "MIMALLOC_VERBOSE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # mimalloc read rlvr's settings (its verbose mode prints every option it runs with)
    assert "option 'purge_delay': 10000" in done.stderr and "option 'allow_thp': 0" in done.stderr
    assert json.loads((out / "summary.json").read_text())["allocator"] == "mimalloc"
    inherited = json.loads((tmp_path / "env.json").read_text())
    assert "LD_PRELOAD" not in inherited and not any(k.startswith("_RLVR") for k in inherited)
    # RLVR_ALLOCATOR=system: no re-execution, glibc's malloc
    system = subprocess.run([sys.executable, "-m", "rlvr", "train", *args, f"output_dir={tmp_path / 'system'}"],
                            check=False, cwd=ROOT, env={**env, "RLVR_ALLOCATOR": "system"}, capture_output=True,
                            text=True, timeout=300)
    assert system.returncode == 0, system.stderr[-3000:]
    assert json.loads((tmp_path / "system" / "summary.json").read_text())["allocator"] == "the system's"
