"""One policy update on a batch of scored groups, in three parts: the frozen passes (reference and proximal
log-probs, no gradient), the loss of one micro-batch (fused output layer, statistics gathered inside it), and
the optimizer update. ``train_step`` composes them; the synchronous loop calls it, and any other runtime can.

The step is blind to the algorithm variant: everything variant-specific arrives in ``LossSettings``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlvr.architecture import share_prefix_within
from rlvr.core import (
    LossSettings,
    TokenInputs,
    fused_head_loss,
    loss_normaliser,
    merge_stat_sums,
    sequence_log_ratio,
    stat_sums,
    token_logprobs,
    token_objective,
    token_weights,
)
from rlvr.models import ReferencePolicy, backbone_and_head
from rlvr.rollout.engine import prefill
from rlvr.train.batch import StepBatch


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


def _lengths(completion_mask: torch.Tensor) -> torch.Tensor:
    """[N] attended length of each right-padded completion row of ``completion_mask`` [N, T]."""
    return (completion_mask.bool() * torch.arange(1, completion_mask.shape[1] + 1)).amax(dim=1)


def row_width(batch: StepBatch, rows: torch.Tensor) -> int:
    """Completion columns ``rows`` need: their longest attended completion."""
    return max(int(_lengths(batch.completion_mask[rows]).max()) if len(rows) else 0, 1)


def micro_batches(batch: StepBatch, size: int, skip_zero_advantage: bool) -> list[torch.Tensor]:
    """The rows of each micro-batch, groups ordered by their longest completion (longest first) so a
    micro-batch is cut to its own longest row instead of the step's (``row_width``); a group's rows stay
    together, so its prompt still runs once. Rows that cannot move the loss are left out: no trained token,
    or, with ``skip_zero_advantage`` (no KL term), an advantage of 0 on every trained token - the clipped
    objective times 0 is 0 whatever the ratio. The loss normaliser still counts them, so the loss and
    gradient are those of the whole batch."""
    trained = batch.loss_mask.bool()  # [N, T]
    keep = trained.any(dim=1)
    if skip_zero_advantage:
        adv = batch.token_adv(torch.arange(batch.num_completions))  # [N, T]
        keep &= ((adv != 0) & trained).any(dim=1)
    length = _lengths(batch.completion_mask)  # [N]
    G = batch.group_size
    group_length = length.view(-1, G).amax(dim=1).tolist()  # [B]
    length = length.tolist()
    # longest group first, then longest row within it; ties keep batch order
    order = sorted(keep.nonzero().squeeze(-1).tolist(), key=lambda i: (-group_length[i // G], i // G, -length[i], i))
    return list(torch.tensor(order, dtype=torch.long).split(size)) if order else []


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
    with _layer_flags(backbone, gradient_checkpointing=False):  # a prefix common to all prompts runs once
        last, cached_mask = prefill(backbone, batch.prompt_ids[prompts], prompt_mask, cache, share_prefix)
    cache.batch_select_indices(local)  # keys/values [u, ...] -> [n, ...], differentiable
    for layer in cache.layers:
        layer.__class__ = _PrefixLayer
    mask = torch.cat([cached_mask[local], completion_mask], dim=1)  # [n, P + T]
    positions = prompt_mask.sum(-1)[local, None] + torch.arange(t)  # [n, T]
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
    temperature = _uniform(batch.temperature[rows, :width])
    return token_logprobs(hidden, head, batch.completion_ids[rows, :width], temperature, chunk_tokens,
                          with_entropy)


def _uniform(temperature: torch.Tensor) -> float | torch.Tensor:
    """One float when every token has the same temperature (the logits of 1.0 are then never divided)."""
    if temperature.numel() and bool((temperature == temperature.reshape(-1)[0]).all()):
        return float(temperature.reshape(-1)[0])
    return temperature


LOGITS_PER_CHUNK = 1 << 25  # elements of one chunk's [c, V] logits: 128 MB in fp32


def chunk_for_vocab(chunk_tokens: int, vocab: int) -> int:
    """Tokens per output-layer chunk: at most ``chunk_tokens``, fewer for a large vocabulary so a chunk's logits
    stay within LOGITS_PER_CHUNK (SmolLM2's 49k vocabulary keeps 512; Gemma's 262k gets 128)."""
    return max(1, min(chunk_tokens, LOGITS_PER_CHUNK // vocab))


@dataclass
class FrozenLogprobs:
    """Log-probs [N, T] computed once per step without gradient."""

    ref: torch.Tensor | None = None  # reference policy, when beta != 0
    proximal: torch.Tensor | None = None  # the weights as the step began, when mu > 1 needs them


@torch.no_grad()
def frozen_logprobs(model, batch, micro_rows, chunk_tokens, share_prompt) -> torch.Tensor:
    """Log-probs [N, T] of the completion tokens of ``micro_rows``, micro-batch by micro-batch, without gradient
    (0 in rows and columns no micro-batch covers)."""
    out = None
    for rows in micro_rows:
        width = row_width(batch, rows)
        logp = completion_logprobs(model, batch, rows, chunk_tokens, share_prompt=share_prompt, width=width)[0]
        if out is None:  # the model's dtype (fp64 in tests, bf16 under autocast)
            out = torch.zeros(batch.completion_ids.shape, dtype=logp.dtype)
        out[rows, :width] = logp
    return torch.zeros(batch.completion_ids.shape) if out is None else out


def frozen_passes(
    model: nn.Module,
    batch: StepBatch,
    micro_rows: list[torch.Tensor],
    settings: LossSettings,
    reference: ReferencePolicy | None,
    num_iterations: int,
    chunk_tokens: int = 512,
    share_prompt: bool = True,
) -> FrozenLogprobs:
    """The no-gradient passes a step needs: the reference only when beta != 0; the proximal policy only when
    mu > 1 and the objective reads it (with mu = 1 the current weights are the proximal policy)."""
    frozen = FrozenLogprobs()
    if settings.beta != 0.0:
        if reference is None:
            raise ValueError("beta != 0 needs a reference policy")
        with reference.active() as ref_model:
            frozen.ref = frozen_logprobs(ref_model, batch, micro_rows, chunk_tokens, share_prompt)
    if num_iterations > 1 and (settings.ratio_to == "proximal" or settings.is_level != "none"):
        frozen.proximal = frozen_logprobs(model, batch, micro_rows, chunk_tokens, share_prompt)
    return frozen


def micro_batch_loss(
    model: nn.Module,
    batch: StepBatch,
    rows: torch.Tensor,
    settings: LossSettings,
    normaliser: float,
    frozen: FrozenLogprobs,
    chunk_tokens: int = 512,
    share_prompt: bool = True,
) -> tuple[torch.Tensor, dict[str, float], float]:
    """This micro-batch's share of the step's loss through the fused output layer (rlvr.core.fused).

    Returns the loss (differentiable), the sums of the per-token statistics (rlvr.core.losses.stat_sums), taken
    inside the fused pass, and the summed entropy of the trained tokens.
    """
    w = row_width(batch, rows)  # columns past every row's completion are padding: not computed
    loss_mask = batch.loss_mask[rows, :w]  # [n, W]
    m = loss_mask.bool()
    hidden = completion_hidden(model, batch, rows, share_prompt, width=w)[m]  # [M, H], trained tokens only
    head = backbone_and_head(model)[1]
    targets, temperature = batch.completion_ids[rows, :w][m], _uniform(batch.temperature[rows, :w][m])  # [M]
    weights = token_weights(loss_mask.to(hidden.dtype), settings.aggregation, normaliser)[m]  # [M]
    adv = batch.token_adv(rows)[:, :w][m].to(hidden.dtype)
    behaviour = batch.behaviour_logp[rows, :w][m]
    proximal = None if frozen.proximal is None else frozen.proximal[rows, :w][m]
    ref = None if frozen.ref is None else frozen.ref[rows, :w][m]
    sequence_weight = None
    if settings.is_level == "sequence":
        prox = proximal
        if prox is None:  # mu = 1: the current weights are the proximal policy; one pass through the output layer
            with torch.no_grad():
                temp = temperature[None] if isinstance(temperature, torch.Tensor) else temperature
                prox, _ = token_logprobs(hidden.detach()[None], head, targets[None], temp, chunk_tokens)
                prox = prox[0]
        full = torch.zeros(loss_mask.shape, dtype=prox.dtype)
        full[m] = prox
        per_row = sequence_log_ratio(full, batch.behaviour_logp[rows, :w].to(prox.dtype), loss_mask)  # [n]
        sequence_weight = per_row[:, None].expand_as(full)[m]
    sums: dict[str, float] = {}

    def token_loss(lp: torch.Tensor, sl: slice) -> torch.Tensor:
        x = TokenInputs(
            lp, behaviour[sl], adv[sl],
            proximal_logp=None if proximal is None else proximal[sl],
            ref_logp=None if ref is None else ref[sl],
            sequence_log_weight=None if sequence_weight is None else sequence_weight[sl],
        )
        loss, stats = token_objective(x, settings)
        merge_stat_sums(sums, stat_sums(stats))
        return loss * weights[sl]

    loss, _, entropy = fused_head_loss(hidden, head, targets, token_loss, temperature, chunk_tokens)
    return loss, sums, float(entropy.sum())


def apply_update(
    params: list[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    max_grad_norm: float,
    loss: float,
) -> tuple[float, bool]:
    """Clip the accumulated gradients and step; a non-finite loss or gradient norm skips the update (weights and
    optimizer state untouched, gradients dropped). Returns (gradient norm, applied)."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf")))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm, False
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return grad_norm, True


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batch: StepBatch,
    settings: LossSettings,
    *,
    reference: ReferencePolicy | None = None,
    num_iterations: int = 1,
    micro_batch_size: int = 16,
    max_new_tokens: int,
    max_grad_norm: float = 1.0,
    chunk_tokens: int = 512,
    share_prompt: bool = True,
) -> dict[str, float]:
    """Run ``num_iterations`` optimizer steps over the batch and return metrics.

    - ``share_prompt``: each prompt runs once per group in the forward pass (see ``completion_hidden``); off,
      every completion runs its own copy of the prompt (a test oracle; same result, more compute).
    - Output layer, log-softmax and loss run chunk by chunk with gradients taken in the forward pass
      (``rlvr.core.fused``), so [tokens, vocab] logits are never held (chunks shrink for large vocabularies:
      ``chunk_for_vocab``).
    - The ratio and importance weights use ``batch.behaviour_logp`` as ``settings`` asks (rlvr.core.off_policy).
    - An update whose loss or gradient norm is not finite is skipped and counted in ``skipped_updates``.
    - Micro-batches come from ``micro_batches``: cut to their longest row, and without the rows that carry no
      gradient (with beta = 0: those whose advantage is 0). ``entropy`` is the mean over the tokens computed.
    """
    micro_rows = micro_batches(batch, micro_batch_size, skip_zero_advantage=settings.beta == 0.0)
    chunk_tokens = chunk_for_vocab(chunk_tokens, backbone_and_head(model)[1].weight.shape[0])
    normaliser = loss_normaliser(batch.loss_mask, settings.aggregation, max_new_tokens)
    frozen = frozen_passes(model, batch, micro_rows, settings, reference, num_iterations, chunk_tokens, share_prompt)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    entropy_sum, skipped = 0.0, 0
    computed = sum(float(batch.loss_mask[rows].sum()) for rows in micro_rows)
    for iteration in range(num_iterations):
        optimizer.zero_grad(set_to_none=True)
        if not micro_rows:  # nothing carries a gradient: a zero one, so the optimizer steps as it would on one
            for p in params:
                p.grad = torch.zeros_like(p)
        loss_sum = 0.0
        for rows in micro_rows:
            loss, part, entropy = micro_batch_loss(model, batch, rows, settings, normaliser, frozen, chunk_tokens,
                                                   share_prompt)
            loss.backward()
            loss_sum += loss.item()
            merge_stat_sums(sums, part)
            entropy_sum += entropy if iteration == 0 else 0.0
        grad_norm, applied = apply_update(params, optimizer, scheduler, max_grad_norm, loss_sum)
        skipped += not applied
    return step_statistics(sums, loss_sum, grad_norm, entropy_sum / max(computed, 1.0),
                           optimizer.param_groups[0]["lr"], skipped)


def step_statistics(sums: dict[str, float], loss: float, grad_norm: float, entropy: float, lr: float,
                    skipped: int) -> dict[str, float]:
    """The step's metrics from the summed per-token statistics (fractions and means over trained tokens)."""
    tokens = max(sums.get("tokens", 0.0), 1.0)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "entropy": entropy,
        "lr": lr,
        "skipped_updates": skipped,
        "clip_low": sums.get("clip_low", 0.0) / tokens,
        "clip_high": sums.get("clip_high", 0.0) / tokens,
        "is_weight_mean": sums.get("is_weight", 0.0) / tokens,
        "is_weight_max": sums.get("is_weight_max", 0.0),
        "is_capped_frac": sums.get("is_capped", 0.0) / tokens,
        "gap_masked_frac": sums.get("gap_masked", 0.0) / tokens,
        "logp_gap": sums.get("logp_gap", 0.0) / tokens,
    }
    if "clip_dual" in sums:
        metrics["clip_dual"] = sums["clip_dual"] / tokens
    if "kl" in sums:
        metrics["kl"] = sums["kl"] / tokens
    return metrics
