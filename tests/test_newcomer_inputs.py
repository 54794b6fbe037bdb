"""Bad input a newcomer meets is one line, and what a run records is what it did: an environment whose reset raises,
malformed YAML, resume=auto with nothing to resume, the system prompt an hf run sent."""

import json
import re
from pathlib import Path

import torch

from rlvr.cli import main
from rlvr.config.loading import load_config
from rlvr.run.files import config_yaml, sent_system_prompt
from rlvr.tasks import load_task
from rlvr.tasks.columns import STEP_BY_STEP_SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parent.parent


class BrokenReset:
    """An environment whose reset fails on every row."""

    def reset(self, **row) -> str:
        raise KeyError("question")

    def look(self, text: str) -> str:
        """Look something up.

        Args:
            text: what to look up
        """
        return text


def _tiny(model_dir: Path, out: Path) -> list[str]:
    return [f"model.name={model_dir}", "model.lora_r=2", f"output_dir={out}", "task.eval_size=2",
            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.prompts_per_step=2", "train.micro_batch_size=4",
            "train.steps=1", "train.threads=1", "eval.batch_size=2", "log.progress=false", "log.trackers=[]",
            "log.plot=false"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rlvr: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_an_environment_whose_reset_raises_is_one_line(tiny_long_model_dir, tmp_path, capsys):
    code = main(["train", str(ROOT / "examples" / "demo.yaml"), *_tiny(tiny_long_model_dir, tmp_path / "r"),
                 "env.factory=tests.test_newcomer_inputs:BrokenReset"])
    assert code == 2
    assert "BrokenReset.reset raised KeyError" in _one_line_error(capsys)
    assert not (tmp_path / "r").exists()  # stopped before the run directory was made: nothing to lose


class LongReset:
    """reset returns 4,000 characters: the prompt it makes cannot fit the tiny model's 2,048-token context."""

    def reset(self, **row) -> str:
        return " observation" * 350

    def look(self, where: str) -> str:
        """Look somewhere.

        Args:
            where: the place
        """
        return where

    def get_reward(self) -> float:
        return 0.0


def test_a_reset_text_too_long_for_the_context_is_one_line(tiny_long_model_dir, tmp_path, capsys):
    """The security review's finding: reset's text joined the prompt after the prompt-length check."""
    code = main(["train", str(ROOT / "examples" / "demo.yaml"), *_tiny(tiny_long_model_dir, tmp_path / "r"),
                 "env.factory=tests.test_newcomer_inputs:LongReset"])
    assert code == 2
    assert re.search(r"LongReset\.reset's text makes a prompt of \d+ tokens, more than the \d+ the model's "
                     r"context leaves after env.max_episode_tokens", _one_line_error(capsys))
    assert not (tmp_path / "r").exists()  # refused before the run directory was made


def test_malformed_yaml_is_one_line_naming_the_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: smollm2-135m-instruct\n lora: true\n")
    assert main(["train", str(path)]) == 2
    assert _one_line_error(capsys).startswith(f"rlvr: error: {path} is not valid YAML at line 3, column 2: ")


def test_resume_auto_with_nothing_to_resume_says_so(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "fresh"
    threads = torch.get_num_threads()
    try:
        assert main(["train", str(ROOT / "examples" / "demo.yaml"), *_tiny(tiny_model_dir, out), "resume=auto"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (f"rlvr: resume=auto: no complete checkpoint in {out / 'checkpoints'}; starting from step 0"
            in capsys.readouterr().out)


def test_an_hf_run_records_the_system_prompt_it_sent(tmp_path):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "What is 2 + 3?", "answer": "so #### 5"}) + "\n"
                                      + json.dumps({"question": "What is 1 + 1?", "answer": "so #### 2"}) + "\n")
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"prompt": chat, "answer": "so #### 5"}) + "\n"
                                              for _ in range(2)))
    for source, column, sent in (("q.jsonl", "question", STEP_BY_STEP_SYSTEM_PROMPT), ("c.jsonl", "prompt", "")):
        cfg = load_config(None, ["task.name=hf", f"task.source={tmp_path / source}", f"task.prompt_column={column}",
                                 "task.answer_format=gsm8k", "task.eval_size=1", "task.eval_split=",
                                 "rewards=[{name: math_correct}]"])
        train, _, _ = load_task(cfg.task)
        recorded = sent_system_prompt(cfg, train)
        assert recorded.task.system_prompt == sent
        assert (train[0]["prompt"][0] == {"role": "system", "content": sent}) == bool(sent)  # what the model saw
        text = config_yaml(recorded)
        assert "does not send" not in text and load_config(None, []).task.system_prompt not in text
        assert load_task(recorded.task)[0] == train  # the recorded config sends the same prompts
