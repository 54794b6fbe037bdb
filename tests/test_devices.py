"""Every tensor the train step (reference, proximal and top-entropy passes), PPO's update, the local sampler and the
in-process episode driver create follows the model's device: run under a non-CPU *default* device ("meta"), a tensor
made without an explicit device lands on meta and the first operation that meets the CPU model fails loudly (CPU
bookkeeping says device="cpu"). The results must equal a plain run (the default device changes where factories put
tensors, nothing else). Still to cover (the accelerator issue): the remote sampler and rlvr serve's engine."""

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


def _same_groups(a, b):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behaviour_logp", "truncated",
                 "version", "temperature", "sampled_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.device.type == "cpu" and torch.equal(x, y), name
    assert a.texts == b.texts


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=8), SamplingParams(temperature=0.0, max_new_tokens=8),
                                    SamplingParams(max_new_tokens=8, stop=("1",), top_k=5)],
                         ids=["sampled", "greedy", "stop-top-k"])
def test_the_local_sampler_makes_every_tensor_on_the_models_device(tokenizer, params):
    """LocalSampler (folded LoRA decoding weights, KV cache, a prefix common to the prompts): the groups come back on
    the CPU, the same as without the meta default."""
    from rlvr.rollout import LocalSampler

    model, _ = _setup(tokenizer, lora=True)
    sampler = LocalSampler(model, tokenizer)
    want = sampler.sample(PROMPTS, 4, params, seed=3)
    with torch.device("meta"):
        got = sampler.sample(PROMPTS, 4, params, seed=3)
    _same_groups(got, want)


def test_the_episode_driver_makes_every_tensor_on_the_models_device(tokenizer):
    """Episodes in process: model turns, observation tokens appended, per-episode generators."""
    from rlvr.prompts import prompt_token_ids
    from rlvr.rollout import LocalSampler
    from rlvr.rollout.episodes import EpisodeLimits
    from tests.test_episodes import Scripted

    model, _ = _setup(tokenizer, lora=True)
    model.generation_config.eos_token_id = list(range(0, len(tokenizer), 5))  # turns end at varied lengths
    prompt_ids = [prompt_token_ids(tokenizer, p) for p in PROMPTS]

    def run():
        envs = [Scripted(calls=2) for _ in range(4)]
        return LocalSampler(model, tokenizer).sample_episodes(prompt_ids, envs, 2, SamplingParams(max_new_tokens=16),
                                                              0, EpisodeLimits(max_turns=3, max_episode_tokens=80))

    want = run()
    with torch.device("meta"):
        got = run()
    _same_groups(got.groups, want.groups)
    assert got.messages == want.messages
