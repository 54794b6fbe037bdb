"""examples/tools.yaml runs end to end (2 steps) on the tiny model: episodes with the calculator, their metrics, the
held-out evaluation with tools, and the outputs."""

import json
from pathlib import Path

from rlvr.config.loading import load_config
from rlvr.launch import train
from rlvr.store.metrics import read_metrics

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tools.yaml"


def test_the_tools_example_runs_two_steps_on_the_tiny_model(tiny_long_model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(EXAMPLE, [
        f"model.name={tiny_long_model_dir}", "model.lora_r=4", "model.lora_targets=[q_proj, v_proj]",
        f"output_dir={out}", "task.eval_size=4", "task.train_size=16", "train.steps=2", "train.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "env.max_episode_tokens=24", "eval.every=2",
        "eval.batch_size=4", "log.progress=false"])
    assert cfg.env.tools == ("calculator",) and cfg.task.name == "tool_problems"
    summary = train(cfg)
    assert summary["steps"] == 2
    records = read_metrics(out / "metrics.jsonl")
    for r in records[1:]:
        assert r["episode/turns_mean"] >= 1 and 0 <= r["episode/tool_use_frac"] <= 1
        assert r["episode/model_tokens"] > 0 and "episode/errors/_all/malformed" in r
        assert r["episode/truncated/turn_tokens"] + r["episode/truncated/episode_tokens"] <= 4
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert {"text", "rewards", "columns"} <= set(sample) and "arithmetic_correct" in sample["rewards"]
