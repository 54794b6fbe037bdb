"""End to end on a tiny random Llama: the library loop and the CLI write every promised output."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlvr.cli import main
from rlvr.config.loading import load_config
from rlvr.launch import train
from rlvr.store.metrics import read_metrics
from tests.helpers import assert_parts_add_up

STEP_KEYS = {"step", "time/step_s"} | {f"rollout/{k}" for k in (
    "reward_mean", "reward_std", "reward/tests.helpers:length_reward_mean", "zero_variance_frac", "completion_len_mean",
    "completion_len_max", "truncated_frac", "time_generate_s", "time_reward_s", "gen_tokens_per_s")} | {
    f"update/{k}" for k in ("kl", "clip_low", "clip_high", "entropy", "time_s", "tokens_per_s", "loss", "grad_norm")
} | {"sampler/time_s"}
SYNC_PARTS = ("rollout/time_generate_s", "rollout/time_reward_s", "update/time_s", "sampler/time_s")


def _overrides(model_dir, out, lora=True):
    return [
        f"model.name={model_dir}", f"model.lora={str(lora).lower()}", "model.lora_r=4",
        "model.lora_targets=[q_proj, v_proj]",
        f"output_dir={out}", "task.eval_size=6", "rewards=[{name: 'tests.helpers:length_reward'}]",
        "rollout.group_size=4", "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.micro_batch_size=3",
        "train.steps=3", "eval.every=2", "eval.batch_size=4", "algo.beta=0.05", "train.lr=0.01", "log.progress=false",
    ]


@pytest.mark.parametrize("lora", [True, False])
def test_train_writes_everything(tiny_model_dir, tmp_path, lora):
    out = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_model_dir, out, lora))
    from rlvr.models.policy import load_policy

    initial, _ = load_policy(str(tiny_model_dir), None)
    summary = train(cfg)

    assert set(summary) >= {"eval_accuracy_before", "eval_accuracy_after", "steps", "wall_time_s"}
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["steps"] == 3
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[2] and "eval/accuracy" in records[3]
    assert_parts_add_up(records[1:], SYNC_PARTS)
    for r in records[1:]:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert all(torch.isfinite(torch.tensor(float(r[k])))
                   for k in ("update/loss", "update/kl", "update/grad_norm", "rollout/reward_mean"))
    assert (out / "config.yaml").is_file() and (out / "plot.png").stat().st_size > 1000
    assert any((out / "tensorboard").iterdir())
    assert load_config(out / "config.yaml", ["import_dirs=[]"]) == cfg  # the resolved config reproduces the run

    if lora:
        weights = load_file(out / "adapter" / "adapter_model.safetensors")
        assert any(torch.count_nonzero(w) for k, w in weights.items() if "lora_B" in k)  # B starts at zero
        from peft import PeftModel

        PeftModel.from_pretrained(initial, out / "adapter")
    else:
        from rlvr.models.policy import load_causal_lm

        trained = load_causal_lm(out / "model")
        changed = [n for n, p in trained.named_parameters() if not torch.equal(p, dict(initial.named_parameters())[n])]
        assert changed


def test_cli_train_and_eval(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text("train:\n  steps: 2\n")
    assert main(["train", str(cfg_path), *_overrides(tiny_model_dir, out), "train.steps=2"]) == 0
    printed = capsys.readouterr().out
    assert "held-out accuracy:" in printed and str(out) in printed
    assert main(["eval", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["trained"] and result["eval_size"] == 6 and 0.0 <= result["eval_accuracy"] <= 1.0


def test_cli_rejects_unknown_key(tmp_path, capsys):
    assert main(["train", "examples/demo.yaml", "train.stepz=3"]) == 2
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err


def test_rerun_moves_the_earlier_run_aside(tmp_path):
    from rlvr.launch import fresh_run_dir

    run = tmp_path / "run"
    assert fresh_run_dir(run) == run and run.is_dir()
    (run / "metrics.jsonl").write_text("{}\n")
    fresh_run_dir(run)
    assert (tmp_path / "run.prev-1" / "metrics.jsonl").read_text() == "{}\n"
    assert run.is_dir() and not any(run.iterdir())


def test_gradient_checkpointing_trains(tiny_model_dir, tmp_path):
    extra = ["model.gradient_checkpointing=true", "train.steps=1"]
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path / "gc") + extra)
    summary = train(cfg)
    weights = load_file(tmp_path / "gc" / "adapter" / "adapter_model.safetensors")
    assert summary["steps"] == 1 and any(torch.count_nonzero(w) for k, w in weights.items() if "lora_B" in k)


def test_bf16_autocast_trains(tiny_model_dir, tmp_path):
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path / "bf16") + ["model.autocast=bf16", "train.steps=1"])
    summary = train(cfg)
    step = read_metrics(tmp_path / "bf16" / "metrics.jsonl")[1]
    assert summary["steps"] == 1 and math.isfinite(step["update/loss"]) and math.isfinite(step["update/kl"])
