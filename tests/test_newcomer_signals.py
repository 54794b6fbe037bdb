"""SIGTERM (schedulers), SIGHUP (a closed terminal) and Ctrl-C stop a run after the current step, checkpoint it and
exit with 128 + the signal's number and one line; resume=auto continues from that checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlvr.run.lifecycle import stop_on_interrupt

ROOT = Path(__file__).resolve().parent.parent


def _overrides(model_dir: Path, out: Path) -> list[str]:
    return [f"model.name={model_dir}", "model.lora_r=4", f"output_dir={out}", "task.eval_size=4",
            "rewards=[{name: 'tests.helpers:length_reward'}]", "rollout.group_size=4", "rollout.max_new_tokens=6",
            "train.prompts_per_step=2", "train.micro_batch_size=4", "train.threads=1", "train.checkpoint_every=0",
            "eval.batch_size=4", "log.progress=false", "log.trackers=[]", "log.plot=false"]


def _logged(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.long
def test_sigterm_checkpoints_says_so_exits_143_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = ["examples/demo.yaml", *_overrides(tiny_model_dir, out), "train.steps=200"]
    proc = subprocess.Popen([sys.executable, "-m", "rlvr", "train", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_logged(out)) < 2:  # the evaluation before training (step 0) and step 1
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM == 143, stderr[-2000:]
    step = _logged(out)[-1]["step"]
    checkpoint = out / "checkpoints" / f"step-{step:08d}"
    assert sorted((out / "checkpoints").glob("step-*")) == [checkpoint]  # the last logged step, and only it
    assert "rlvr: SIGTERM: stopping after this step to save a checkpoint" in stdout
    assert (f"rlvr: interrupted; saved {checkpoint} (SIGTERM at step {step}, exit status 143). Continue with "
            "resume=auto.") in stdout
    assert "Traceback" not in stderr

    resumed = subprocess.run([sys.executable, "-m", "rlvr", "train", *args, f"train.steps={step + 1}", "resume=auto"],
                             cwd=ROOT, capture_output=True, text=True, check=False, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {checkpoint} (step {step})" in resumed.stdout
    assert [r["step"] for r in _logged(out)] == list(range(step + 2))  # 0 (before training) .. step + 1, once each
    assert json.loads((out / "summary.json").read_text())["steps"] == step + 1


def test_sighup_and_a_repeated_sigterm_ask_the_same_stop(capsys):
    outside = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal starts it (pytest may run under nohup)
    try:
        with stop_on_interrupt() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)  # already stopping: changes nothing
            assert stop.requested and stop.signum == signal.SIGHUP
        assert capsys.readouterr().out == "\nrlvr: SIGHUP: stopping after this step to save a checkpoint\n"
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # the handlers before the run are back
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # started under nohup: a hang-up stays ignored
        with stop_on_interrupt() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            assert not stop.requested
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, outside)
