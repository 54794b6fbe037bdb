"""PPO with a critic: the baseline that shows, measured, what GRPO saves by dropping the value model.

The critic is initialised from the policy with a scalar value head on its final hidden states:
- policy with LoRA: a second LoRA adapter ("critic") on the policy's own frozen base - no second copy of the
  base weights, only the adapter, its gradients and optimizer states, and the critic's activations;
- full fine-tuning: a full trainable copy of the policy (weights, gradients and two AdamW moments again).
Per step: the critic values every completion token (no gradient), per-token rewards are the verifiable reward
at the last token minus ``kl_coef`` times the k1 KL estimate to the reference on every token, GAE gives
advantages [N, T] and returns, the policy takes the same clipped loss as GRPO (advantages per token) and the
critic the clipped value loss; one optimizer step updates both. The policy loss runs through rlvr's fused
output layer over the same length-ordered micro-batches as GRPO's (``micro_batches``), so the two differ only
by what the critic costs. ``PPOUpdate`` is the update the loop calls (rlvr/run/loop.py); the batch source
computes no advantages for it: they come from the critic here.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from rlvr.config.schema import RunConfig
from rlvr.core import LossSettings
from rlvr.core.ppo import PPOSettings, gae, token_rewards, value_loss, whiten
from rlvr.learn.batch import StepBatch
from rlvr.learn.collected import Collected
from rlvr.learn.forward import completion_hidden
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, chunk_for_vocab, frozen_logprobs, micro_batches, step_batch, train_step
from rlvr.models.policy import autocast, backbone_and_head, is_lora
from rlvr.platform.devices import model_device

CRITIC_ADAPTER = "critic"


class Critic(nn.Module):
    def __init__(self, policy: nn.Module):
        super().__init__()
        hidden = policy.config.hidden_size
        self._policy = [policy]  # not a submodule: under LoRA its base is shared, never owned
        if is_lora(policy):
            from peft import LoraConfig

            spec = policy.peft_config["default"]
            config = LoraConfig(r=spec.r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                                target_modules=list(spec.target_modules), task_type="CAUSAL_LM")
            policy.add_adapter(CRITIC_ADAPTER, config)
            self.body = None
            self._trainable()
        else:
            self.body = copy.deepcopy(policy).requires_grad_(True)
        self.head = nn.Linear(hidden, 1, device="cpu")  # drawn on the CPU (the same start on every device), then moved
        with torch.no_grad():
            self.head.weight.normal_(0.0, 1.0 / math.sqrt(hidden + 1))
            self.head.bias.zero_()
        self.head.to(model_device(policy))

    def _trainable(self) -> None:
        """peft makes only the active adapter trainable; both of ours are, always."""
        for name, p in self._policy[0].named_parameters():
            if "lora_" in name:
                p.requires_grad_(True)

    @contextlib.contextmanager
    def _body(self) -> Iterator[nn.Module]:
        if self.body is not None:
            yield self.body
            return
        policy = self._policy[0]
        policy.set_adapter(CRITIC_ADAPTER)
        try:
            yield policy
        finally:
            policy.set_adapter("default")
            self._trainable()

    def values(self, batch: StepBatch, rows: torch.Tensor, share_prompt: bool = True) -> torch.Tensor:
        """V [n, T]: the value of the state before each completion token of ``rows``."""
        with self._body() as body:
            hidden = completion_hidden(body, batch, rows, share_prompt)  # [n, T, H]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)

    def parameters_to_train(self) -> list[nn.Parameter]:
        if self.body is not None:
            return [p for p in self.parameters() if p.requires_grad]
        own = [p for n, p in self._policy[0].named_parameters() if f".{CRITIC_ADAPTER}." in n]
        return own + list(self.head.parameters())

    def trainable_parameters(self, policy: nn.Module) -> list[nn.Parameter]:
        """Policy and critic parameters to optimise, each once (under LoRA the critic adapter is in the policy)."""
        both = [*policy.parameters(), *self.parameters_to_train()]
        return list({id(p): p for p in both if p.requires_grad}.values())

    def trainable_module(self) -> nn.Module:
        """What checkpoints hold of the critic (the adapter lives in the policy and is saved with it)."""
        return self if self.body is not None else self.head


def ppo_step(learner: Learner, critic: Critic, batch: StepBatch, rewards: torch.Tensor, settings: LossSettings,
             ppo: PPOSettings, options: StepOptions) -> dict[str, float]:
    """One PPO update: values and rewards (no gradient), GAE, then GRPO's step (``train_step``) with the critic's
    clipped value loss as its extra loss, both in one optimizer step.

    ``rewards`` [N] are the completions' verifiable rewards (NaN: not trained, like GRPO's excluded rows).
    Several learners (torchrun): the values, the reference and GAE's whitening cover the whole batch on every
    learner (no gradient: the same numbers as one process), the update its own groups.
    """
    policy, reference, share_prompt = learner.model, learner.reference, options.share_prompt
    device = model_device(policy)
    batch, rewards = batch.to(device), rewards.to(device)  # the step's tensors cross to the model's device once
    # what the optimizer steps, all of it clipped (and summed over learners): read from the optimizer, not from
    # requires_grad, which the reference pass (peft's disable_adapter) turns off for the critic's adapter
    trained = [p for group in learner.optimizer.param_groups for p in group["params"]]
    mask = batch.loss_mask
    micro_rows = micro_batches(batch, options.micro_batch_size, skip_zero_advantage=False)  # rows with a trained token
    chunk_tokens = chunk_for_vocab(options.chunk_tokens, backbone_and_head(policy)[1].weight.shape[0])
    with torch.no_grad():
        old_values = torch.zeros(mask.shape, device=mask.device)  # [N, T]; rows no micro-batch covers: no trained token
        for rows in micro_rows:
            old_values[rows] = critic.values(batch, rows, share_prompt).float()
        kl = None
        if ppo.kl_coef:
            if reference is None:
                raise ValueError("ppo.kl_coef != 0 needs a reference policy")
            with reference.active() as ref_model:
                ref_logp = frozen_logprobs(ref_model, batch, micro_rows, chunk_tokens, share_prompt)
            kl = (batch.behaviour_logp - ref_logp) * mask  # k1 on the sampled tokens
        r = token_rewards(torch.nan_to_num(rewards.float()), mask, kl, ppo.kl_coef)
        adv, returns = gae(r, old_values, mask, ppo.gamma, ppo.lam)
        if ppo.whiten:
            adv = whiten(adv, mask)
    tokens = max(float(mask.sum()), 1.0)
    value_losses: list[float] = []

    def critic_loss(rows: torch.Tensor) -> torch.Tensor:
        values = critic.values(batch, rows, share_prompt)
        v_loss = (value_loss(values, old_values[rows], returns[rows], ppo.value_clip) * mask[rows]).sum() / tokens
        value_losses.append(v_loss.item())
        return ppo.vf_coef * v_loss

    metrics = train_step(learner, replace(batch, adv=adv.to(batch.behaviour_logp.dtype)),
                         replace(settings, beta=0.0),  # the KL penalty is in the reward
                         options, params=trained, extra_loss=critic_loss)
    m = mask.bool()
    metrics.update({
        "value_loss": learner.team.sum_loss(sum(value_losses)),
        "value_mean": float(old_values[m].mean()) if m.any() else 0.0,
        "return_mean": float(returns[m].mean()) if m.any() else 0.0,
        "explained_variance": _explained_variance(old_values[m], returns[m]),
    })
    if kl is not None:
        metrics["kl"] = float(kl.sum() / tokens)
    return metrics


class PPOUpdate:
    """PPO's update for the loop: the critic's GAE advantages, the clipped policy loss and the value loss."""

    def __init__(self, cfg: RunConfig):
        self.settings, self.ppo, self.options = cfg.algo.loss_settings(), cfg.ppo, StepOptions.of(cfg)
        self.mask_truncated, self.autocast = cfg.algo.mask_truncated, cfg.model.autocast
        self.needs_reference = self.ppo.kl_coef != 0.0
        self.critic: Critic | None = None

    def attach(self, model: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        """The critic, on the policy; checkpoints hold both (the critic's LoRA adapter lives in the policy)."""
        self.critic = Critic(model)
        held = nn.ModuleDict({"policy": model, "critic": self.critic.trainable_module()})
        return held, self.critic.trainable_parameters(model)

    def __call__(self, learner: Learner, batch: Collected) -> dict[str, float]:
        n = batch.groups.completion_ids.shape[0]
        placeholder = torch.zeros(n, device="cpu")  # [N], like the groups: replaced by GAE in ppo_step
        with autocast(learner.model, self.autocast):
            return ppo_step(learner, self.critic, step_batch(batch, placeholder, self.mask_truncated),
                            batch.scores.total, self.settings, self.ppo, self.options)


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    if returns.numel() < 2 or float(returns.var()) == 0.0:
        return 0.0
    return float(1.0 - (returns - values).var() / returns.var())

