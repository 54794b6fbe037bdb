"""Bad input: a clear error that names the culprit and says what to do, or containment by explicit policy."""

import json

import pytest

from rlvr.cli import main
from rlvr.config.loading import load_config
from rlvr.launch import train
from rlvr.rewards import RewardError
from rlvr.store.metrics import read_metrics
from tests.test_e2e import _overrides


def _cfg(model_dir, tmp_path, *extra):
    return load_config(None, _overrides(model_dir, tmp_path / "run") + ["train.steps=1", "eval.every=0", *extra])


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_row_missing_a_column(tmp_path):
    from rlvr.tasks import load_jsonl

    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}])
    with pytest.raises(ValueError) as err:
        load_jsonl(path)
    assert str(err.value) == (
        f"{path}:2: columns differ from the first row (missing ['answer'], extra []); "
        "every row needs the same columns, since reward functions receive them all"
    )


def test_prompt_longer_than_context_is_named_or_dropped(tiny_model_dir, tmp_path):
    long = {"prompt": "3 + 4 = 7 " * 200, "answer": "7"}
    short = {"prompt": "3 + 4 =", "answer": "7"}
    train_path = _jsonl(tmp_path / "train.jsonl", [short, long, short])
    eval_path = _jsonl(tmp_path / "eval.jsonl", [short, short])
    task = ["task.name=jsonl", f"task.train_path={train_path}", f"task.eval_path={eval_path}",
            "task.eval_reward=arithmetic_correct"]
    with pytest.raises(ValueError) as err:
        train(_cfg(tiny_model_dir, tmp_path, *task))
    message = str(err.value)
    assert message.startswith("train row 1 has a ")
    assert "-token prompt; with rollout.max_new_tokens the model's context leaves room for 250" in message
    assert "set task.drop_long_prompts=true" in message
    summary = train(_cfg(tiny_model_dir, tmp_path, *task, "task.drop_long_prompts=true"))
    assert summary["dropped_prompts"] == 1


def test_reward_that_raises_stops_with_its_name(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, "rewards=[{name: 'tests.helpers:failing_reward'}]")
    with pytest.raises(RewardError) as err:
        train(cfg)
    assert str(err.value).startswith(  # followed by when it was found (the check before training)
        "reward function 'tests.helpers:failing_reward' failed (RuntimeError: verifier crashed); fix it, or set "
        "on_error: none for it to score such batches as None"
    )


def test_reward_errors_and_hangs_are_contained_when_asked(tiny_model_dir, tmp_path):
    rewards = ("rewards=[{name: 'tests.helpers:length_reward'}, {name: 'tests.helpers:failing_reward', on_error: none},"
               " {name: 'tests.helpers:hanging_reward', on_error: none, timeout_s: 0.5}]")
    summary = train(_cfg(tiny_model_dir, tmp_path, rewards))
    step = read_metrics(tmp_path / "run" / "metrics.jsonl")[1]
    assert step["rollout/reward/tests.helpers:failing_reward_errors"] == 1
    assert step["rollout/reward/tests.helpers:hanging_reward_errors"] == 1
    assert step["rollout/reward/tests.helpers:hanging_reward_missing"] == 8  # 2 prompts x G=4, all None
    assert step["rollout/reward_missing_frac"] == 0.0  # length_reward still scored every completion
    assert summary["steps"] == 1


def test_hang_without_containment_is_an_error(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path, "rewards=[{name: 'tests.helpers:hanging_reward', timeout_s: 0.5}]")
    timed_out = r"'tests.helpers:hanging_reward' failed \(TimeoutError: did not return within 0.5 s\)"
    with pytest.raises(RewardError, match=timed_out):
        train(cfg)


def test_infinite_reward_is_an_error():
    from rlvr.rewards import WeightedReward, score_completions

    infinite = WeightedReward("inf", lambda prompts, completions, **kw: [0.0, float("inf")])
    message = "reward function 'inf' returned inf at index 1; rewards must be finite or None"
    with pytest.raises(RewardError, match=message):
        score_completions([infinite], ["p"] * 2, ["c"] * 2, {})


def test_cli_reports_bad_input_in_one_line(tmp_path, capsys):
    path = _jsonl(tmp_path / "bad.jsonl", [{"answer": "2"}])
    code = main(["train", "examples/demo.yaml", "task.name=jsonl", f"task.train_path={path}", f"task.eval_path={path}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    expected = ("has no column 'prompt' or 'messages' (task.prompt_column); columns present: answer; set "
                "task.prompt_column to the column holding the prompt (a question string or chat messages), or build "
                "it with task.prompt_template (docs/data.md)")
    assert err == f"rlvr: error: {path} {expected}"


def test_steps_below_one_stop_before_anything_runs(tmp_path, capsys):
    """train.steps=-1 used to evaluate twice and save an untrained adapter with rc 0."""
    out = tmp_path / "run"
    assert main(["train", "examples/demo.yaml", "train.steps=-1", f"output_dir={out}"]) == 2
    assert capsys.readouterr().err == "rlvr: error: train.steps must be >= 1; got -1\n"
    assert not out.exists()


def test_plain_string_prompts_to_a_chat_model_warn_once(tiny_model_dir, tmp_path, capsys):
    """rlvr.models.prompts sends a string as it is (no chat template): a chat model rambles on it, so load_data says so,
    in one line, unless the prompts are chat messages, already rendered, or task.chat_template=false."""
    from rlvr.run.build import load_data

    rendered = "<|im_start|>user\n3 + 4 =<|im_end|>\n<|im_start|>assistant\n"
    rows = [{"prompt": "3 + 4 =", "answer": "7"}, {"prompt": rendered, "answer": "7"},
            {"messages": [{"role": "user", "content": "2 + 2 ="}], "answer": "4"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    base = [f"model.name={tiny_model_dir}", "task.name=jsonl", f"task.train_path={path}", f"task.eval_path={path}",
            "rewards=[{name: math_correct}]"]
    load_data(load_config(None, base))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "rlvr: warning: 2 of 6 prompts are plain strings, sent as they are without the model's chat template")
    assert "prompt: [{role: user, content: ...}]" in err and "task.prompt_template='{prompt}'" in err
    assert "task.chat_template=false" in err
    load_data(load_config(None, [*base, "task.chat_template=false"]))
    strings = _jsonl(tmp_path / "s.jsonl", rows[:1])
    load_data(load_config(None, [*base, f"task.train_path={strings}", f"task.eval_path={strings}",
                                 "task.prompt_template='{prompt}'"]))  # each string becomes a user message
    load_data(load_config(None, [f"model.name={tiny_model_dir}", "task.eval_size=10"]))  # arithmetic: chat messages
    assert capsys.readouterr().err == ""


def test_reward_on_error_choice_is_validated():
    from rlvr.config.loading import ConfigError

    with pytest.raises(ConfigError, match="rewards\\[0\\].on_error must be one of raise, none; got 'ignore'"):
        load_config(None, ["rewards=[{name: format, on_error: ignore}]"])
