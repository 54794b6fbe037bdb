"""Naive reference implementations the optimised code is tested against: full logits through autograd."""

from __future__ import annotations

import torch

from rlvr.core import LossSettings, TokenInputs, loss_normaliser, policy_loss, sequence_log_ratio
from rlvr.train.batch import StepBatch


def naive_logprobs(model, batch: StepBatch) -> torch.Tensor:
    """Log-probs [N, T] of every completion token: the whole prompt + completion through the model for each
    completion, full [N, P + T, V] logits, log_softmax at the token's temperature, gather."""
    g = batch.group_size
    ids = torch.cat([batch.prompt_ids.repeat_interleave(g, 0), batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask.repeat_interleave(g, 0), batch.completion_mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    p = batch.prompt_ids.shape[1]
    logits = logits[:, p - 1 : -1].double() / batch.temperature[..., None].double()  # position j predicts token j+1
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)


def naive_update(model, batch: StepBatch, settings: LossSettings, lr: float, ref_logp=None, max_new_tokens=8):
    """One SGD step on the whole batch with the plain composition ``policy_loss`` (mu = 1: proximal = current
    weights); returns the loss and the statistics' sums."""
    logp = naive_logprobs(model, batch)
    mask = batch.loss_mask
    behaviour = batch.behaviour_logp.double()
    seq = None
    if settings.is_level == "sequence":
        seq = sequence_log_ratio(logp.detach(), behaviour, mask)[:, None].expand_as(logp)
    adv = batch.adv.double()
    x = TokenInputs(logp, behaviour, adv[:, None] if adv.dim() == 1 else adv, ref_logp=ref_logp,
                    sequence_log_weight=seq)
    loss, sums = policy_loss(x, mask, settings, loss_normaliser(mask, settings.aggregation, max_new_tokens))
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(loss.detach()), sums
