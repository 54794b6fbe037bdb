"""The gaming check (rlvr/run/gaming.py): a trained reward up while a measure the run never trains on went down,
from evaluation records by hand; in a real run on the tiny model (the log, metrics.jsonl and summary.json say so, a
flat measure keeps it quiet); and `rlvr eval`'s held-out measures, replies and base-model comparison."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlvr.config.loading import load_config
from rlvr.launch import train
from rlvr.rewards import WeightedReward
from rlvr.run.gaming import evaluation_record, gaming_alarm, measures, valid_record
from tests.test_e2e import _overrides


def _record(step, metrics, judge, answers):
    replies = [{"prompt": [{"role": "user", "content": f"m{i}"}], "reply": f"r{i}@{step}",
                "scores": {"reward/judge": j, "metric/answers": a}} for i, (j, a) in enumerate(zip(judge, answers))]
    return evaluation_record(step, metrics, replies, list(metrics))


THEN = _record(0, {"eval/reward/judge": 0.6, "eval/reward/length": 0.5, "eval/metric/answers": 0.9,
                   "eval/accuracy": 0.5}, judge=[0.5, 0.7, 0.6, 0.4], answers=[1, 1, 1, 0])


def test_the_alarm_names_the_largest_rise_and_fall_and_the_replies_that_rose_most():
    now = _record(20, {"eval/reward/judge": 0.9, "eval/reward/length": 0.65, "eval/metric/answers": 0.3,
                       "eval/accuracy": 0.8}, judge=[0.9, 0.8, 1.0, 0.9], answers=[0, 1, 0, None])
    alarm = gaming_alarm(20, THEN, now, ["eval/reward/judge", "eval/reward/length"],
                         ["eval/metric/answers", "eval/accuracy"], rise=0.1, fall=0.1)
    assert (alarm.reward, alarm.reward_then, alarm.reward_now) == ("eval/reward/judge", 0.6, 0.9)
    assert (alarm.measure, alarm.measure_then, alarm.measure_now) == ("eval/metric/answers", 0.9, 0.3)
    # rises by row: +0.4, +0.1, +0.4, +0.5 -> rows 3, then 0 and 2 (a stable sort keeps their order)
    assert [e["prompt"] for e in alarm.examples] == ["m3", "m0", "m2"]
    assert alarm.examples[0] == {"prompt": "m3", "then": "r3@0", "now": "r3@20", "reward_then": 0.4,
                                 "reward_now": 0.9, "measure_then": 0, "measure_now": None}
    assert "may be gaming its reward" in alarm.line() and "eval/metric/answers" in alarm.line()
    assert json.loads(json.dumps(alarm.as_dict()))["step"] == 20


@pytest.mark.parametrize("judge, answers", [(0.65, 0.3), (0.9, 0.85), (0.9, 0.95)])
def test_no_alarm_without_both_a_rise_and_a_fall(judge, answers):
    """A reward up less than rise; a measure down less than fall; a measure that rose too."""
    now = _record(20, {"eval/reward/judge": judge, "eval/metric/answers": answers}, [0.5] * 4, [1] * 4)
    assert gaming_alarm(20, THEN, now, ["eval/reward/judge"], ["eval/metric/answers"], 0.1, 0.1) is None


def test_what_counts_as_trained_and_as_independent():
    def r(name, weight=1.0):
        return WeightedReward(name, lambda **_: [], weight)

    trained, independent = measures([r("judge"), r("tone", 0.0)], [r("answers")], "tone:positive")
    assert trained == ["eval/reward/judge"]
    assert independent == ["eval/metric/answers", "eval/reward/tone", "eval/accuracy"]
    trained, independent = measures([r("math_correct")], [], "math_correct")  # accuracy is what the run trains
    assert (trained, independent) == (["eval/reward/math_correct"], [])
    trained, _ = measures([r("judge"), r("similarity"), r("tone", 0.0)], [], "", watched=("judge",))
    assert trained == ["eval/reward/judge"]  # a relevance term rising at warmth's cost is a trade-off, not gaming


def test_the_watched_rewards_must_be_trained_ones():
    from rlvr.config.loading import ConfigError

    base = ["rewards=[{name: judge_a, weight: 1.0}, {name: tone, weight: 0.0}]"]
    assert load_config(None, [*base, "eval.gaming_rewards=[judge_a]"]).eval.gaming_rewards == ("judge_a",)
    with pytest.raises(ConfigError, match="eval.gaming_rewards names 'tone'.*some of 'judge_a'"):
        load_config(None, [*base, "eval.gaming_rewards=[tone]"])


@pytest.mark.parametrize("bad", [
    None, [], {"step": "0", "metrics": {}, "replies": []}, {"step": 0, "metrics": {"a": float("nan")}, "replies": []},
    {"step": 0, "metrics": {}, "replies": [{"prompt": "p", "reply": 3, "scores": {}}]},
    {"step": 0, "metrics": {}, "replies": [{"prompt": "p", "reply": "r", "scores": {"a": "1"}}]},
])
def test_a_saved_record_is_checked(bad):
    assert valid_record(THEN) and not valid_record(bad)


def _run(model_dir, out, measure: str, *extra: str) -> tuple[list[dict], dict]:
    cfg = load_config(None, [
        *_overrides(model_dir, out),
        "rewards=[{name: 'tests.helpers:length_reward'}, {name: 'tests.helpers:rising_reward'}]",
        f"eval.metrics=[{{name: 'tests.helpers:{measure}'}}]", "eval.every=1", "train.steps=3", *extra])
    train(cfg)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((out / "summary.json").read_text())


def test_a_run_whose_reward_rises_while_a_measure_falls_says_so(tiny_model_dir, tmp_path, capsys):
    metrics, summary = _run(tiny_model_dir, tmp_path / "run", "falling_measure")
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1, 2, 3]
    for m in evals:  # every evaluation: the run's rewards and eval.metrics on the held-out replies, and their shape
        assert {"eval/reward/tests.helpers:rising_reward", "eval/metric/tests.helpers:falling_measure",
                "eval/reward", "eval/length_mean", "eval/truncated_frac", "eval/refusal_frac"} <= set(m)
        assert 1 <= m["eval/length_mean"] <= 6 and 0 <= m["eval/truncated_frac"] <= 1
    assert "eval/gaming" not in evals[0]  # the first evaluation is what later ones are compared with
    fired = [m["step"] for m in evals[1:] if m["eval/gaming"] == 1.0]
    assert fired and fired[-1] == 3
    alarm = summary["gaming"]
    assert alarm["measure"] == "eval/metric/tests.helpers:falling_measure" and alarm["step"] == 3
    assert alarm["measure_now"] < alarm["measure_then"] - 0.1 and alarm["reward_now"] > alarm["reward_then"] + 0.1
    assert len(alarm["examples"]) == 3 and all(e["now"] is not None for e in alarm["examples"])
    assert "may be gaming its reward" in capsys.readouterr().err


def test_a_flat_measure_keeps_the_check_quiet_and_a_resumed_run_compares_with_the_first(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    _run(tiny_model_dir, out, "flat_measure", "train.steps=2", "train.checkpoint_every=1")
    metrics, summary = _run(tiny_model_dir, out, "flat_measure", "resume=auto")
    assert summary["gaming"] is None
    checked = [m for m in metrics if "eval/gaming" in m]
    assert [m["step"] for m in checked] == [1, 2, 3] and all(m["eval/gaming"] == 0.0 for m in checked)
    state = json.loads(max((out / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["eval_first"]["step"] == 0 and len(state["eval_first"]["replies"]) == 6


@pytest.mark.long
def test_rlvr_eval_reports_the_measures_the_replies_and_the_comparison_with_the_base(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    _run(tiny_model_dir, out, "falling_measure", "train.steps=1")
    replies = tmp_path / "replies.jsonl"
    done = subprocess.run([sys.executable, "-m", "rlvr", "eval", str(out), "--replies", str(replies),
                           "--against-base"], capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["trained"] and result["eval_size"] == 6
    assert {"eval/reward/tests.helpers:rising_reward", "eval/metric/tests.helpers:falling_measure",
            "eval/length_mean", "eval/refusal_frac"} <= set(result) and "eval/accuracy" not in result
    assert set(result["base"]) >= {"eval_accuracy", "eval/metric/tests.helpers:falling_measure"}
    assert result["gaming"] is None  # outside a run no optimizer step is taken: the scripted measures stay put
    lines = [json.loads(line) for line in replies.read_text().splitlines()]
    assert len(lines) == 6 and all({"prompt", "reply", "scores", "base_reply", "base_scores"} <= set(r) for r in lines)
    assert all(r["scores"]["metric/tests.helpers:falling_measure"] == pytest.approx(0.9) for r in lines)
