"""Every tensor the train step, the reference and proximal passes, the top-entropy pass and PPO's update create
follows the model's device: run under a non-CPU *default* device ("meta"), a tensor made without an explicit device
lands on meta and the first operation that meets the CPU model fails loudly (CPU bookkeeping says device="cpu").
The step's results must be the same as without the meta default (it changes where factories put tensors, nothing
else). Still to cover (the accelerator issue): the samplers, the episode driver and rlvr serve's engine."""

import copy

import pytest
import torch

from rlvr.core import LossSettings, PPOSettings
from rlvr.models import LoraSpec, ReferencePolicy, add_lora
from rlvr.rollout import SamplingParams
from rlvr.train.batch import StepBatch
from rlvr.train.step import train_step
from tests.conftest import make_model, sample_tiny

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]


def _setup(tokenizer, lora):
    base = make_model(len(tokenizer))
    groups = sample_tiny(base, tokenizer, PROMPTS, 4, SamplingParams(max_new_tokens=8), 0, eos_every=6)
    model = make_model(len(tokenizer), seed=1)
    if lora:
        model = add_lora(model, LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    adv = torch.randn(8, generator=torch.Generator().manual_seed(0))
    return model, StepBatch.from_groups(groups, adv)


def _grpo(model, reference, batch, knobs, iterations):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return train_step(model, opt, None, batch, LossSettings(**knobs), reference=reference,
                      num_iterations=iterations, micro_batch_size=3, max_completion_tokens=8)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("knobs, iterations", [
    ({"beta": 0.04}, 1),  # the reference pass
    ({"beta": 0.0, "top_entropy_quantile": 0.5, "entropy_coef": 0.01}, 1),  # the entropy pass, entropy gradients
    ({"beta": 0.04, "objective": "gspo", "is_level": "sequence"}, 2),  # the proximal pass
], ids=["kl", "entropy", "proximal"])
def test_train_step_makes_every_tensor_on_the_models_device(tokenizer, lora, knobs, iterations):
    model, batch = _setup(tokenizer, lora)
    twin = copy.deepcopy(model)
    want = _grpo(twin, ReferencePolicy(twin), batch, knobs, iterations)
    reference = ReferencePolicy(model)  # the run's objects are built before the step, as rlvr train builds them
    with torch.device("meta"):
        got = _grpo(model, reference, batch, knobs, iterations)
    assert got == want
    assert all(p.device.type == "cpu" and torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_ppo_step_makes_every_tensor_on_the_models_device(tokenizer):
    from rlvr.baselines.ppo import Critic, ppo_step

    def build(model):
        torch.manual_seed(0)
        critic = Critic(model)
        opt = torch.optim.SGD(critic.trainable_parameters(model), lr=0.1)
        return critic, opt, ReferencePolicy(model)

    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.5])  # from the reward functions, on the CPU

    def run(model, critic, opt, reference, batch):
        return ppo_step(model, critic, opt, None, batch, rewards, LossSettings(), PPOSettings(kl_coef=0.05),
                        reference=reference, micro_batch_size=3, max_completion_tokens=8)

    model, batch = _setup(tokenizer, lora=True)
    twin = copy.deepcopy(model)
    want = run(twin, *build(twin), batch)
    parts = build(model)
    with torch.device("meta"):
        got = run(model, *parts, batch)
    assert got == want
