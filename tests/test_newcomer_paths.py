"""A run directory is self-contained: its config.yaml names its model, data and run directory by absolute paths, and
the folder its own reward module came from, so `rlvr eval RUN`, `rlvr train RUN/config.yaml` and resume=auto work
from any directory."""

import json
import shutil
import sys
from pathlib import Path

import torch
import yaml

from rlvr.cli import main

ROOT = Path(__file__).resolve().parent.parent
ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]


def _settings() -> list[str]:
    return ["task.name=jsonl", "task.train_path=data/train.jsonl", "task.eval_path=data/eval.jsonl",
            "task.eval_size=2", "rewards=[{name: 'newcomer_rewards:correct'}]", "model.name=models/tiny",
            "model.lora_r=2", "task.eval_reward=newcomer_rewards:correct",
            "output_dir=runs/mine", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.prompts_per_step=2",
            "train.micro_batch_size=4", "train.steps=1", "train.threads=1", "eval.batch_size=2", "log.progress=false",
            "log.trackers=[]", "log.plot=false"]


def test_a_run_directory_works_from_any_directory(tiny_model_dir, tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (work / "data").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copytree(tiny_model_dir, work / "models" / "tiny")  # a model given by a relative path too
    for name, rows in (("train", ROWS[:7]), ("eval", ROWS[7:])):
        (work / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "newcomer_rewards.py").write_text(  # the user's reward module, beside their data
        "def correct(prompts, completions, answer, **kwargs):\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
        "    return [float(a in t) for t, a in zip(texts, answer)]\n")
    threads = torch.get_num_threads()
    try:
        monkeypatch.chdir(work)
        assert main(["train", str(ROOT / "examples" / "demo.yaml"), *_settings()]) == 0
        run = work / "runs" / "mine"
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["output_dir"] == str(run)
        assert saved["model"]["name"] == str(work / "models" / "tiny")
        assert (saved["task"]["train_path"], saved["task"]["eval_path"]) == (str(work / "data" / "train.jsonl"),
                                                                             str(work / "data" / "eval.jsonl"))
        assert saved["import_dirs"] == [str(work.resolve())]  # where newcomer_rewards came from
        capsys.readouterr()
        monkeypatch.delitem(sys.modules, "newcomer_rewards")  # as a new process from elsewhere: imported afresh,
        monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != work.resolve()])  # not found

        monkeypatch.chdir(elsewhere)  # nothing of the project is reachable by a relative path from here
        assert main(["eval", "../project/runs/mine"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["trained"] is True and result["eval_size"] == 2

        assert main(["train", "../project/runs/mine/config.yaml", "resume=auto", "train.steps=2"]) == 0
        assert f"resuming from {run / 'checkpoints' / 'step-00000001'} (step 1)" in capsys.readouterr().out
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
        assert not (elsewhere / "runs").exists()
    finally:
        torch.set_num_threads(threads)
