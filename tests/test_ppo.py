"""The PPO baseline end to end on the tiny model: the critic trains (LoRA critic adapter or a full copy), its
state is checkpointed and resumed exactly, the policy samples with its own adapter, and bad settings are errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlvr.cli import main
from rlvr.config.loading import ConfigError, load_config
from rlvr.launch import train
from tests.test_e2e import _overrides
from tests.test_resume import _records

PPO = ["algo.name=ppo", "train.steps=3", "train.checkpoint_every=1", "train.keep_last=5", "log.trackers=[]",
       "log.plot=false"]


@pytest.mark.parametrize("lora", [pytest.param(True, marks=pytest.mark.long), False])
def test_ppo_trains_policy_and_critic(tiny_model_dir, tmp_path, lora):
    out = tmp_path / "run"
    train(load_config(None, _overrides(tiny_model_dir, out, lora) + PPO + ["algo.beta=0"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(f"update/{k}" in records[0]
               for k in ("value_loss", "explained_variance", "value_mean", "return_mean", "kl"))
    ckpt = {"step-00000001": None, "step-00000003": None}
    for name in ckpt:
        ckpt[name] = load_file(out / "checkpoints" / name / "weights.safetensors")
    first, last = ckpt["step-00000001"], ckpt["step-00000003"]
    critic = [k for k in last if (".critic." in k if lora else k.startswith("critic.body."))]
    head = [k for k in last if "critic.weight" in k or "critic.head.weight" in k]
    policy = [k for k in last if k.startswith("policy.") and ".critic." not in k]
    assert critic and head and policy
    assert any(not torch.equal(first[k], last[k]) for k in critic)  # the critic's body learns
    assert any(not torch.equal(first[k], last[k]) for k in head)
    assert any(not torch.equal(first[k], last[k]) for k in policy)


def test_ppo_resume_is_exact(tiny_model_dir, tmp_path):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    base = _overrides(tiny_model_dir, straight, True) + PPO + ["algo.beta=0", "train.threads=1"]
    train(load_config(None, base))
    args = _overrides(tiny_model_dir, resumed, True) + PPO + ["algo.beta=0", "train.threads=1"]
    train(load_config(None, args + ["train.steps=2"]))
    train(load_config(None, args + ["resume=auto"]))
    assert _records(straight, "metrics.jsonl") == _records(resumed, "metrics.jsonl")


def test_ppo_policy_samples_with_its_own_adapter(tiny_model_dir, tmp_path):
    from rlvr.learn.ppo import Critic
    from rlvr.models.policy import LoraSpec, load_policy

    model, _ = load_policy(str(tiny_model_dir), LoraSpec(r=4, target_modules=("q_proj", "v_proj")))
    critic = Critic(model)
    assert model.active_adapters == ["default"]
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # both adapters train
    names = {n for n, _ in model.named_parameters()}
    assert any(".critic." in n for n in names) and any(".default." in n for n in names)
    assert len(critic.trainable_parameters(model)) == len({id(p) for p in critic.trainable_parameters(model)})


def test_ppo_from_the_cli_and_its_errors(tiny_model_dir, tmp_path, capsys):
    args = _overrides(tiny_model_dir, tmp_path / "cli", True) + ["algo.name=ppo", "train.steps=1"]
    assert main(["train", "examples/demo.yaml", *args]) == 2  # these overrides set algo.beta=0.05
    assert "use algo.preset=ppo, or set algo.beta=0" in capsys.readouterr().err
    assert main(["train", "examples/demo.yaml", *args, "algo.beta=0"]) == 0
    with pytest.raises(ConfigError, match="puts the KL penalty in the reward"):
        load_config(None, ["algo.name=ppo", "algo.beta=0.04"])
    with pytest.raises(ConfigError, match="algo.name must be one of grpo, ppo"):
        load_config(None, ["algo.name=reinforce"])


def test_the_reference_pass_leaves_the_critics_adapter_clipped_with_the_rest(tokenizer):
    """With the reward's KL term the reference pass runs first (peft's disable_adapter), which turns requires_grad
    off for the critic's adapter; what is clipped (and, under torchrun, summed) is still everything the optimizer
    steps: the global gradient norm after clipping is the clip."""
    from rlvr.core import LossSettings, PPOSettings
    from rlvr.learn.batch import StepBatch
    from rlvr.learn.learner import Learner
    from rlvr.learn.ppo import Critic, ppo_step
    from rlvr.learn.step import StepOptions
    from rlvr.models.policy import LoraSpec, ReferencePolicy, add_lora
    from rlvr.rollout import SamplingParams
    from tests.conftest import make_model, sample_tiny

    prompts = [[{"role": "user", "content": f"{i} + 4 ="}] for i in range(2)]
    groups = sample_tiny(make_model(len(tokenizer)), tokenizer, prompts, 4, SamplingParams(max_new_tokens=8), 0,
                         eos_every=6)
    torch.manual_seed(0)
    model = add_lora(make_model(len(tokenizer), seed=1), LoraSpec(r=4, alpha=8))
    critic = Critic(model)
    optimizer = torch.optim.SGD(critic.trainable_parameters(model), lr=0.0)
    ppo_step(Learner(model, optimizer, None, ReferencePolicy(model)), critic,
             StepBatch.from_groups(groups, torch.zeros(8)), torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 2.0, 0.0, 1.0]),
             LossSettings(), PPOSettings(kl_coef=0.05),
             StepOptions(micro_batch_size=3, max_completion_tokens=8, max_grad_norm=1e-3))
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    assert any("critic" in n and p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters())
    assert float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
        == pytest.approx(1e-3, rel=1e-4)
