"""The policy's forward pass over a batch of completions: final hidden states at the positions that predict each
completion token (each prompt run once per group), and the log-probs of those tokens.

Used by the train step (rlvr/learn/step.py), the frozen reference and proximal passes, and PPO's critic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlvr.core import token_logprobs
from rlvr.learn.batch import StepBatch
from rlvr.learn.sharding import BodyThroughRoot
from rlvr.models.architecture import share_prefix_within
from rlvr.models.policy import backbone_and_head
from rlvr.rollout.engine import prefill


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


def completion_lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """[N] attended length of each right-padded completion row of ``completion_mask`` [N, T]."""
    steps = torch.arange(1, completion_mask.shape[1] + 1, device=completion_mask.device)
    return (completion_mask.bool() * steps).amax(dim=1)


def completion_hidden(
    model: nn.Module, batch: StepBatch, rows: torch.Tensor, share_prompt: bool, share_prefix: int = 16,
    width: int | None = None,
) -> torch.Tensor:
    """Final hidden states [n, W, H] at the positions that predict the first W completion tokens of ``rows``
    (``width`` W; all T columns by default).

    With ``share_prompt`` each distinct prompt among ``rows`` runs through the model once - a token prefix
    common to all of them (>= ``share_prefix`` tokens: a system message, worked examples) once for all, as the
    sampler does (rlvr.rollout.engine.prefill) - and its keys and values are indexed out to every completion of
    its group (gradients flow back into the one prompt pass); otherwise every row runs its own copy of the
    prompt. Works with gradient checkpointing: the prompt pass is not checkpointed (it writes the cache), the
    completion pass only reads a frozen prefix cache.
    """
    backbone, _ = backbone_and_head(model)
    prompt_of_row = rows // batch.group_size  # [n]
    completion_ids = batch.completion_ids[rows, :width]  # [n, W]
    completion_mask = batch.completion_mask[rows, :width]
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
    share_prefix = share_prefix_within(backbone.config, p + t, share_prefix)  # exact under sliding windows
    if isinstance(backbone, BodyThroughRoot):  # sharded weights: one prompt pass on every learner
        share_prefix = 0
    with _layer_flags(backbone, gradient_checkpointing=False):  # a prefix common to all prompts runs once
        last, cached_mask = prefill(backbone, batch.prompt_ids[prompts], prompt_mask, cache, share_prefix)
    cache.batch_select_indices(local)  # keys/values [u, ...] -> [n, ...], differentiable
    for layer in cache.layers:
        layer.__class__ = _PrefixLayer
    mask = torch.cat([cached_mask[local], completion_mask], dim=1)  # [n, P + T]
    positions = prompt_mask.sum(-1)[local, None] + torch.arange(t, device=prompt_mask.device)  # [n, T]
    with _layer_flags(backbone, _can_checkpoint_with_cache=True):
        suffix = backbone(
            input_ids=completion_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        ).last_hidden_state  # [n, T, H]
    # the last prompt state predicts completion token 0; completion state j predicts token j + 1
    return torch.cat([last[local, None], suffix[:, :-1]], dim=1)


def completion_logprobs(
    model: nn.Module,
    batch: StepBatch,
    rows: torch.Tensor,
    chunk_tokens: int = 512,
    with_entropy: bool = False,
    share_prompt: bool = True,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [n, W] of the first W (``width``; default all T) completion tokens of ``rows`` at their
    sampling temperatures (and entropies); prompt logits are never computed."""
    hidden = completion_hidden(model, batch, rows, share_prompt, width=width)
    head = backbone_and_head(model)[1]
    temperature = uniform_temperature(batch.temperature[rows, :width])
    return token_logprobs(hidden, head, batch.completion_ids[rows, :width], temperature, chunk_tokens,
                          with_entropy)


def uniform_temperature(temperature: torch.Tensor) -> float | torch.Tensor:
    """One float when every token has the same temperature (the logits of 1.0 are then never divided)."""
    if temperature.numel() and bool((temperature == temperature.reshape(-1)[0]).all()):
        return float(temperature.reshape(-1)[0])
    return temperature
