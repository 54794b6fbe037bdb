"""One GRPO update on a batch of scored groups; shared by the synchronous loop and async learners.

The step is blind to the algorithm variant: everything variant-specific arrives in ``LossSettings``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlvr.core import (
    LossSettings,
    fused_head_loss,
    loss_normaliser,
    policy_loss,
    token_logprobs,
    token_objective,
    token_weights,
)
from rlvr.models import ReferencePolicy, backbone_and_head


@dataclass
class StepBatch:
    """Everything the update needs; completion row i belongs to prompt i // group_size."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [N, T] right-padded, N = B * G
    completion_mask: torch.Tensor  # [N, T]; rows excluded from the update are all zero
    adv: torch.Tensor  # [N]
    group_size: int


class _PrefixLayer(DynamicLayer):
    """A cache layer holding a fixed prompt prefix that never grows: attention reads prefix + new keys
    without storing them, so gradient checkpointing may replay the layer and read the same prefix."""

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@contextlib.contextmanager
def _layer_flags(backbone: nn.Module, **flags) -> Iterator[None]:
    """Temporarily set attributes on every decoder layer (checkpointing behaviour around the prompt cache)."""
    layers = [m for m in backbone.modules() if hasattr(m, "_can_checkpoint_with_cache")]
    saved = [{k: getattr(m, k) for k in flags} for m in layers]
    for m in layers:
        for k, v in flags.items():
            setattr(m, k, v)
    try:
        yield
    finally:
        for m, old in zip(layers, saved):
            for k, v in old.items():
                setattr(m, k, v)


def completion_hidden(model: nn.Module, batch: StepBatch, rows: torch.Tensor, share_prompt: bool) -> torch.Tensor:
    """Final hidden states [n, T, H] at the positions that predict the completion tokens of ``rows``.

    With ``share_prompt`` each distinct prompt among ``rows`` runs through the model once and its keys and
    values are indexed out to every completion of its group (gradients flow back into the one prompt pass);
    otherwise every row runs its own copy of the prompt. Works with gradient checkpointing: the prompt
    pass is not checkpointed (it writes the cache), the completion pass only reads a frozen prefix cache.
    """
    backbone, _ = backbone_and_head(model)
    prompt_of_row = rows // batch.group_size  # [n]
    completion_ids = batch.completion_ids[rows]  # [n, T]
    completion_mask = batch.completion_mask[rows]
    p, t = batch.prompt_ids.shape[1], completion_ids.shape[1]
    if not share_prompt:
        ids = torch.cat([batch.prompt_ids[prompt_of_row], completion_ids], dim=1)  # [n, P + T]
        mask = torch.cat([batch.prompt_mask[prompt_of_row], completion_mask], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        full = backbone(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        return full[:, p - 1 : p + t - 1]  # state j predicts token j + 1
    prompts, local = torch.unique(prompt_of_row, return_inverse=True)
    prompt_mask = batch.prompt_mask[prompts]  # [u, P]
    cache = DynamicCache()
    with _layer_flags(backbone, gradient_checkpointing=False):
        prefix = backbone(
            input_ids=batch.prompt_ids[prompts],
            attention_mask=prompt_mask,
            position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
        ).last_hidden_state  # [u, P, H]
    cache.batch_select_indices(local)  # keys/values [u, ...] -> [n, ...], differentiable
    for layer in cache.layers:
        layer.__class__ = _PrefixLayer
    mask = torch.cat([prompt_mask[local], completion_mask], dim=1)  # [n, P + T]
    positions = prompt_mask.sum(-1)[local, None] + torch.arange(t)  # [n, T]
    with _layer_flags(backbone, _can_checkpoint_with_cache=True):
        suffix = backbone(
            input_ids=completion_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        ).last_hidden_state  # [n, T, H]
    # the last prompt state predicts completion token 0; completion state j predicts token j + 1
    return torch.cat([prefix[local, -1:], suffix[:, :-1]], dim=1)


def completion_logprobs(
    model: nn.Module,
    batch: StepBatch,
    rows: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool = False,
    share_prompt: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [n, T] of the completion tokens of ``rows`` (and entropies); prompt logits are never computed."""
    hidden = completion_hidden(model, batch, rows, share_prompt)
    head = backbone_and_head(model)[1]
    return token_logprobs(hidden, head.weight, batch.completion_ids[rows], temperature, chunk_tokens, with_entropy)


def _fused_micro_batch(model, batch, rows, old_logp, ref_logp, settings, normaliser, temperature, chunk_tokens, share_prompt):
    """Loss of one micro-batch through the fused output layer; returns (loss, logp [n, T] detached, entropy)."""
    mask = batch.completion_mask[rows]
    m = mask.bool()
    hidden = completion_hidden(model, batch, rows, share_prompt)[m]  # [M, H], real tokens only
    weights = token_weights(mask.to(hidden.dtype), settings.aggregation, normaliser)[m]  # [M]
    adv = batch.adv[rows][:, None].expand_as(mask)[m].to(hidden.dtype)
    old = None if old_logp is None else old_logp[rows][m]
    ref = None if ref_logp is None else ref_logp[rows][m]

    def token_loss(lp: torch.Tensor, sl: slice) -> torch.Tensor:
        base = lp.detach() if old is None else old[sl]
        loss, _, _ = token_objective(lp, base, None if ref is None else ref[sl], adv[sl], settings)
        return loss * weights[sl]

    head = backbone_and_head(model)[1]
    loss, logp_real, entropy_real = fused_head_loss(
        hidden, head.weight, batch.completion_ids[rows][m], token_loss, temperature, chunk_tokens
    )
    logp = torch.zeros(mask.shape, dtype=logp_real.dtype)
    entropy = torch.zeros(mask.shape, dtype=entropy_real.dtype)
    logp[m], entropy[m] = logp_real, entropy_real
    return loss, logp, entropy


@torch.no_grad()
def _frozen_logprobs(model, batch, micro_rows, temperature, chunk_tokens, share_prompt) -> torch.Tensor:
    return torch.cat(
        [completion_logprobs(model, batch, rows, temperature, chunk_tokens, share_prompt=share_prompt)[0] for rows in micro_rows]
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batch: StepBatch,
    settings: LossSettings,
    *,
    reference: ReferencePolicy | None,
    num_iterations: int,
    micro_batch_size: int,
    temperature: float,
    max_new_tokens: int,
    max_grad_norm: float,
    chunk_tokens: int = 512,
    share_prompt: bool = True,
    fused_head: bool = True,
) -> dict[str, float]:
    """Run ``num_iterations`` optimizer steps over the batch and return metrics.

    - ``share_prompt``: each prompt runs once per group in the forward pass (see ``completion_hidden``).
    - ``fused_head``: output layer, log-softmax and loss chunk by chunk, gradients taken in the forward
      pass (``rlvr.core.fused``), so [tokens, vocab] logits are never held.
    - Old-policy log-probs are the detached current ones when num_iterations == 1 (no extra forward);
      reference log-probs are computed (no grad, micro-batch by micro-batch) only when beta != 0.
    - An update whose loss or gradient norm is not finite is skipped (weights and optimizer state
      untouched) and counted in ``skipped_updates``.
    """
    n = batch.completion_ids.shape[0]
    micro_rows = list(torch.arange(n).split(micro_batch_size))
    mask = batch.completion_mask
    normaliser = loss_normaliser(mask, settings.aggregation, max_new_tokens)

    ref_logp = None
    if settings.beta != 0.0:
        if reference is None:
            raise ValueError("beta != 0 needs a reference policy")
        with reference.active() as ref_model:
            ref_logp = _frozen_logprobs(ref_model, batch, micro_rows, temperature, chunk_tokens, share_prompt)
    old_logp = (
        _frozen_logprobs(model, batch, micro_rows, temperature, chunk_tokens, share_prompt) if num_iterations > 1 else None
    )

    model.train()
    totals: dict[str, float] = {}
    entropy_sum = 0.0
    skipped = 0
    params = [p for p in model.parameters() if p.requires_grad]
    for iteration in range(num_iterations):
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for rows in micro_rows:
            first = iteration == 0
            ref = None if ref_logp is None else ref_logp[rows]
            if fused_head:
                loss, logp, entropy = _fused_micro_batch(
                    model, batch, rows, old_logp, ref_logp, settings, normaliser, temperature, chunk_tokens, share_prompt
                )
                with torch.no_grad():  # statistics from the detached log-probs, as the unfused path reports them
                    old = logp if old_logp is None else old_logp[rows]
                    _, stats = policy_loss(logp, old, ref, batch.adv[rows], mask[rows], settings, normaliser)
            else:
                logp, entropy = completion_logprobs(
                    model, batch, rows, temperature, chunk_tokens, with_entropy=first, share_prompt=share_prompt
                )
                old = logp.detach() if old_logp is None else old_logp[rows]
                loss, stats = policy_loss(logp, old, ref, batch.adv[rows], mask[rows], settings, normaliser)
            loss.backward()
            loss_sum += loss.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            if first:
                entropy_sum += float((entropy * mask[rows]).sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        if math.isfinite(loss_sum) and math.isfinite(float(grad_norm)):
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        else:  # numerical guard: never apply a non-finite update
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
    tokens = max(totals.get("tokens", 0.0), 1.0)
    metrics = {
        "loss": loss_sum,
        "grad_norm": float(grad_norm),
        "clip_low": totals.get("clip_low", 0.0) / tokens,
        "clip_high": totals.get("clip_high", 0.0) / tokens,
        "entropy": entropy_sum / max(float(mask.sum()), 1.0),
        "lr": optimizer.param_groups[0]["lr"],
        "skipped_updates": skipped,
    }
    if "clip_dual" in totals:
        metrics["clip_dual"] = totals["clip_dual"] / tokens
    if "kl_sum" in totals:
        metrics["kl"] = totals["kl_sum"] / tokens
    return metrics
