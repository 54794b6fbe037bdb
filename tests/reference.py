"""Naive reference implementations the optimised code is tested against: full logits through autograd.

``naive_update`` is the train step's specification (docs/reference/step.md): the whole batch in one piece, every
prompt run once per completion, full [N, P + T, V] logits, then the same ``policy_loss`` the step calls.
"""

from __future__ import annotations

import torch

from rlvr.core import LossSettings, TokenBatch, loss_normaliser, policy_loss
from rlvr.learn.batch import StepBatch


def naive_logprobs(model, batch: StepBatch, with_entropy: bool = False):
    """Log-probs [N, T] of every completion token: the whole prompt + completion through the model for each
    completion, full [N, P + T, V] logits, log_softmax at the token's temperature, gather (and the entropy of each
    position's distribution, with gradient, when ``with_entropy``)."""
    g = batch.group_size
    ids = torch.cat([batch.prompt_ids.repeat_interleave(g, 0), batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask.repeat_interleave(g, 0), batch.completion_mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    p = batch.prompt_ids.shape[1]
    logits = logits[:, p - 1 : -1].double() / batch.temperature[..., None].double()  # position j predicts token j+1
    log_probs = torch.log_softmax(logits, dim=-1)  # [N, T, V]
    logp = log_probs.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    if not with_entropy:
        return logp
    return logp, -(log_probs.exp() * log_probs).sum(-1)


def naive_update(model, batch: StepBatch, settings: LossSettings, lr: float, ref_logp=None, max_new_tokens=8,
                 high_entropy=None):
    """One SGD step on the whole batch with ``policy_loss`` (mu = 1: proximal = current weights); returns the loss
    and the statistics' sums."""
    logp, entropy = naive_logprobs(model, batch, with_entropy=True)
    mask = batch.loss_mask.double()
    adv = batch.adv.double()
    x = TokenBatch(logp=logp, behaviour_logp=batch.behaviour_logp.double(),
                   adv=adv[:, None] if adv.dim() == 1 else adv, mask=mask, ref_logp=ref_logp, entropy=entropy,
                   high_entropy=high_entropy)
    normaliser = loss_normaliser(mask, settings.aggregation, max_new_tokens, settings.count_untrained_rows)
    loss, sums = policy_loss(x, settings, normaliser, float(mask.sum()))
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(loss.detach()), sums
