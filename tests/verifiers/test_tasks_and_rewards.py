"""The code and math JSONL tasks, their rewards, and both from the CLI on a tiny model."""

import json

import pytest

from rlvr.cli import main
from rlvr.rewards import build_reward
from rlvr.rewards.code import extract_code
from rlvr.store.metrics import read_metrics
from rlvr.tasks import load_jsonl, validate_code_rows

PROMPT = [{"role": "user", "content": "Write add(a, b)."}]
TESTS = [{"input": [1, 2], "output": 3}, {"input": [-1, 1], "output": 0}]


def test_extract_code_prefers_the_last_python_block():
    text = "Here:\n```\nprint(1)\n```\nand\n```python\ndef f():\n    return 1\n```\nthanks"
    assert extract_code(text) == "def f():\n    return 1\n"
    assert extract_code("```js\nx\n```") == "x\n"
    assert extract_code("def f(): return 2") == "def f(): return 2"


def test_code_reward_scores_by_hidden_tests():
    reward = build_reward("code_tests", {"timeout_s": 3})
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return abs(a) + b\n```",  # passes the first test only
        "print('PASSED')",
    ]
    scores = reward([PROMPT] * 3, completions, entry_point=["add"] * 3, tests=[TESTS] * 3)
    assert scores == [1.0, 0.0, 0.0]
    partial = build_reward("code_tests", {"timeout_s": 3, "partial_credit": True})
    assert partial([PROMPT] * 2, completions[:2], entry_point=["add"] * 2, tests=[TESTS] * 2) == [1.0, 0.5]


def test_code_rows_are_validated(tmp_path):
    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"prompt": "x", "entry_point": "add", "tests": [{"input": 1, "output": 2}]}) + "\n")
    with pytest.raises(ValueError, match=r"code.jsonl: row 1: code rows need one of: 'entry_point' \+ 'tests'"):
        validate_code_rows(str(path), load_jsonl(path))
    path.write_text(json.dumps({"prompt": "x", "tests": [{"input": [1], "output": 2}]}) + "\n")
    with pytest.raises(ValueError, match="row 1: input/output tests need 'entry_point'"):
        validate_code_rows(str(path), load_jsonl(path))


def test_code_reward_reads_every_format_from_the_columns():
    reward = build_reward("code_tests", {"timeout_s": 3, "partial_credit": True})
    prompt = 'def mul(a, b):\n    """a times b"""\n'
    completions = ["    return a * b\n", "```python\ndef mul(a, b):\n    return 0\n```"]
    humaneval = reward([prompt] * 2, completions, entry_point=["mul"] * 2,
                       test=["def check(candidate):\n    assert candidate(2, 3) == 6\n"] * 2)
    assert humaneval == [1.0, 0.0]
    mbpp = reward(["Write mul."], ["```python\ndef mul(a, b):\n    return a * b if a else 1\n```"],
                  test_list=[["assert mul(2, 3) == 6", "assert mul(0, 3) == 0"]], test_setup_code=[""])
    assert mbpp == [0.5]
    program = reward(["Read two ints, print their sum."], ["```python\nprint(sum(map(int, input().split())))\n```"],
                     tests=[[{"stdin": "1 2", "stdout": "3"}, {"stdin": "5 5", "stdout": "10\n"}]])
    assert program == [1.0]


def _cli_run(tiny_model_dir, tmp_path, *overrides):
    out = tmp_path / "run"
    args = [f"model.name={tiny_model_dir}", "model.lora_r=4", f"output_dir={out}", "train.steps=1",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "train.prompts_per_step=2", "eval.batch_size=4",
            "log.progress=false", *overrides]
    assert main(["train", "examples/demo.yaml", *args]) == 0
    return read_metrics(out / "metrics.jsonl")


def test_code_task_from_the_cli(tiny_model_dir, tmp_path):
    records = _cli_run(tiny_model_dir, tmp_path, "task.name=code_jsonl",
                       "task.train_path=examples/data/code_train.jsonl",
                       "task.eval_path=examples/data/code_eval.jsonl", "task.eval_size=2",
                       "rewards=[{name: code_tests, kwargs: {timeout_s: 3}}]")
    assert records[1]["rollout/reward/code_tests_missing"] == 0  # every completion was executed and graded
    assert records[-1]["eval/accuracy"] == 0.0  # a random model writes no working code


@pytest.mark.parametrize("config", ["examples/code_humaneval.yaml", "examples/code_mbpp.yaml"])
def test_humaneval_and_mbpp_examples_from_the_cli(tiny_model_dir, tmp_path, config):
    out = tmp_path / "run"
    args = [f"model.name={tiny_model_dir}", "model.lora_r=4", f"output_dir={out}", "train.steps=1",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "train.prompts_per_step=2", "eval.batch_size=4",
            "task.eval_size=2", "log.progress=false"]
    assert main(["train", config, *args]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert records[1]["rollout/reward/code_tests_missing"] == 0 and records[-1]["eval/accuracy"] == 0.0


def test_math_task_from_the_cli(tiny_model_dir, tmp_path):
    records = _cli_run(tiny_model_dir, tmp_path, "task.name=math_jsonl",
                       "task.train_path=examples/data/word_problems_train.jsonl",
                       "task.eval_path=examples/data/word_problems_eval.jsonl", "task.eval_size=4",
                       "rewards=[{name: math_correct, kwargs: {timeout_s: 3}}, {name: format, weight: 0.1}]")
    assert records[1]["rollout/reward/math_correct_missing"] == 0 and "rollout/reward/format_mean" in records[1]


def test_extra_eval_set_of_a_jsonl_task_reads_like_its_eval_path(tmp_path):
    """eval.extra_path with a JSONL task: the rows come through the task's column map (the question column and
    the step-by-step system message, GSM8K's answer format); any other task refuses it."""
    from rlvr.config.loading import load_config
    from rlvr.tasks import load_extra_eval

    extra = tmp_path / "extra.jsonl"
    extra.write_text('{"question": "What is 2 + 3?", "answer": "Add them.\\n#### 5"}\n')
    cfg = load_config(None, ["task.name=math_jsonl", "task.train_path=examples/data/math_train.jsonl",
                             "task.eval_path=examples/data/math_eval.jsonl", "task.prompt_column=question",
                             "task.answer_column=answer", "task.answer_format=gsm8k",
                             "rewards=[{name: math_correct}]"])
    (row,) = load_extra_eval(cfg.task, str(extra))
    assert row["prompt"][-1] == {"role": "user", "content": "What is 2 + 3?"} and row["answer"] == "5"
    assert row["prompt"][0]["role"] == "system"
    arithmetic = load_config(None, [])
    with pytest.raises(ValueError, match="eval.extra_path works with task.name word_problems or a JSONL task"):
        load_extra_eval(arithmetic.task, str(extra))
