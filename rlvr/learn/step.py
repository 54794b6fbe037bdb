"""GRPO's update, top to bottom: ``GRPOUpdate`` (what the loop calls) -> ``train_step`` -> ``apply_update`` ->
``optimizer.step()``.

    normaliser = loss_normaliser(batch)                       once per optimizer step, over the whole batch
    frozen     = frozen_passes(...)                           reference / proximal log-probs, no gradient
    for each micro-batch of rows:
        x = micro_batch_inputs(model, batch, rows, frozen)    TokenBatch [n, W]: logp, entropy (fused head), adv, ...
        loss, stats = policy_loss(x, settings, normaliser)    the objective, at this one call site (rlvr/core)
        loss.backward()
    learner.team.sum_gradients(...)                           several learners only (learner.py)
    apply_update(...)                                         clip, optimizer.step(), scheduler.step()

The step is blind to the algorithm variant: everything variant-specific arrives in ``LossSettings``. The same
step written naively (full logits, one batch) is the specification: docs/reference/step.md, tests/reference.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rlvr.config.schema import RunConfig
from rlvr.core import LossSettings, TokenBatch, fused_logprobs, loss_normaliser, merge_stat_sums, policy_loss
from rlvr.learn.batch import StepBatch
from rlvr.learn.collected import Collected
from rlvr.learn.forward import completion_hidden, completion_lengths, completion_logprobs, uniform_temperature
from rlvr.learn.learner import Learner
from rlvr.models.policy import ReferencePolicy, autocast, backbone_and_head, trainable_parameters
from rlvr.platform.devices import model_device


class GRPOUpdate:
    """GRPO's update for the loop: the policy loss on the advantages the batch source computed. Every variant
    (presets grpo, dapo, dr_grpo, gspo, cispo, sapo, luspo) is this update with other ``LossSettings``; PPO's, with
    a critic, is rlvr/learn/ppo.py."""

    def __init__(self, cfg: RunConfig):
        self.settings = cfg.algo.loss_settings()
        self.options = StepOptions.of(cfg)
        self.needs_reference = self.settings.beta != 0.0
        self.mask_truncated, self.autocast = cfg.algo.mask_truncated, cfg.model.autocast

    def attach(self, model: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        return model, trainable_parameters(model)

    def __call__(self, learner: Learner, batch: Collected) -> dict[str, float]:
        if batch.adv is None:
            raise ValueError("GRPO trains on the batch source's advantages; this source computed none")
        with autocast(learner.model, self.autocast):
            return train_step(learner, step_batch(batch, batch.adv, self.mask_truncated), self.settings, self.options)


def step_batch(batch: Collected, adv, mask_truncated: bool) -> StepBatch:
    """The update's tensors for a scored batch; completions without a reward are kept but not trained on."""
    return StepBatch.from_groups(batch.groups, adv, batch.included, mask_truncated=mask_truncated)


@dataclass(frozen=True)
class StepOptions:
    """How a step runs, apart from the loss (``LossSettings``)."""

    max_completion_tokens: int  # the longest a completion can be (Dr. GRPO's constant normaliser)
    micro_batch_size: int = 16
    max_grad_norm: float = 1.0  # 0: no clipping
    chunk_tokens: int = 512  # tokens per output-layer chunk (fewer for a large vocabulary: chunk_for_vocab)
    num_iterations: int = 1  # mu: optimizer steps on one batch
    share_prompt: bool = True  # each prompt runs once per group; off, once per completion (a test oracle)

    @classmethod
    def of(cls, cfg: RunConfig) -> StepOptions:
        """The options a run's config sets; an episode's whole budget is the longest a completion can be."""
        longest = cfg.env.max_episode_tokens if cfg.env.enabled else cfg.rollout.max_new_tokens
        return cls(max_completion_tokens=longest, micro_batch_size=cfg.train.micro_batch_size,
                   max_grad_norm=cfg.train.max_grad_norm, chunk_tokens=cfg.train.logprob_chunk,
                   num_iterations=cfg.algo.num_iterations)


def row_width(batch: StepBatch, rows: torch.Tensor) -> int:
    """Completion columns ``rows`` need: their longest attended completion."""
    return max(int(completion_lengths(batch.completion_mask[rows]).max()) if len(rows) else 0, 1)


def micro_batches(batch: StepBatch, size: int, skip_zero_advantage: bool,
                  groups: range | None = None) -> list[torch.Tensor]:
    """The rows of each micro-batch, groups ordered by their longest completion (longest first) so a
    micro-batch is cut to its own longest row instead of the step's (``row_width``); a group's rows stay
    together, so its prompt still runs once. Rows that cannot move the loss are left out: no trained token,
    or, with ``skip_zero_advantage`` (no KL term), an advantage of 0 on every trained token - the clipped
    objective times 0 is 0 whatever the ratio. The loss normaliser still counts them, so the loss and
    gradient are those of the whole batch. ``groups``: only these groups' rows (a learner's share under torchrun)."""
    trained = batch.loss_mask.bool()  # [N, T]
    keep = trained.any(dim=1)
    if groups is not None:
        owned = torch.zeros_like(keep)
        owned[groups.start * batch.group_size:groups.stop * batch.group_size] = True
        keep &= owned
    device = batch.completion_ids.device
    if skip_zero_advantage:
        adv = batch.token_adv(torch.arange(batch.num_completions, device=device))  # [N, T]
        keep &= ((adv != 0) & trained).any(dim=1)
    length = completion_lengths(batch.completion_mask)  # [N]
    G = batch.group_size
    group_length = length.view(-1, G).amax(dim=1).tolist()  # [B]
    length = length.tolist()
    # longest group first, then longest row within it; ties keep batch order
    order = sorted(keep.nonzero().squeeze(-1).tolist(), key=lambda i: (-group_length[i // G], i // G, -length[i], i))
    return list(torch.tensor(order, dtype=torch.long, device=device).split(size)) if order else []  # row indices


LOGITS_PER_CHUNK = 1 << 25  # elements of one chunk's [c, V] logits: 128 MB in fp32


def chunk_for_vocab(chunk_tokens: int, vocab: int) -> int:
    """Tokens per output-layer chunk: at most ``chunk_tokens``, fewer for a large vocabulary so a chunk's logits
    stay within LOGITS_PER_CHUNK (SmolLM2's 49k vocabulary keeps 512; Gemma's 262k gets 128)."""
    return max(1, min(chunk_tokens, LOGITS_PER_CHUNK // vocab))


@dataclass
class FrozenLogprobs:
    """What a step computes once, without gradient, [N, T] each."""

    ref: torch.Tensor | None = None  # reference policy log-probs, when beta != 0
    proximal: torch.Tensor | None = None  # the weights as the step began, when mu > 1 needs them
    high_entropy: torch.Tensor | None = None  # bool: in the step's top_entropy_quantile, when it is < 1


@torch.no_grad()
def frozen_logprobs(model, batch, micro_rows, chunk_tokens, share_prompt, with_entropy: bool = False):
    """Log-probs [N, T] of the completion tokens of ``micro_rows``, micro-batch by micro-batch, without gradient
    (0 in rows and columns no micro-batch covers); with ``with_entropy``, (log-probs, entropies)."""
    logp = entropy = None
    for rows in micro_rows:
        width = row_width(batch, rows)
        lp, ent = completion_logprobs(model, batch, rows, chunk_tokens, with_entropy, share_prompt, width)
        if logp is None:  # the model's dtype (fp64 in tests, bf16 under autocast)
            logp = torch.zeros(batch.completion_ids.shape, dtype=lp.dtype, device=lp.device)
            entropy = torch.zeros(batch.completion_ids.shape, dtype=lp.dtype, device=lp.device)
        logp[rows, :width] = lp
        if with_entropy:
            entropy[rows, :width] = ent
    if logp is None:
        logp = entropy = torch.zeros(batch.completion_ids.shape, device=batch.completion_ids.device)
    return (logp, entropy) if with_entropy else logp


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, share: float) -> torch.Tensor:
    """[N, T] bool: the trained tokens (``mask``) whose entropy is at or above the (1 - share) quantile of the
    entropies of all trained tokens."""
    m = mask.bool()
    if not m.any():
        return m
    threshold = torch.quantile(entropy[m].double(), 1.0 - share)
    return m & (entropy.double() >= threshold)


def frozen_passes(model: nn.Module, batch: StepBatch, micro_rows: list[torch.Tensor], settings: LossSettings,
                  reference: ReferencePolicy | None, options: StepOptions, chunk_tokens: int) -> FrozenLogprobs:
    """The no-gradient passes a step needs, over the rows of ``micro_rows``: the reference only when beta != 0; the
    proximal policy only when mu > 1 and the objective reads it (with mu = 1 the current weights are the proximal
    policy); the policy's entropies when top_entropy_quantile < 1, over every trained row (those without gradient
    too: the threshold is over the whole step's trained tokens, as the paper takes it)."""
    frozen = FrozenLogprobs()
    if settings.beta != 0.0:
        if reference is None:
            raise ValueError("beta != 0 needs a reference policy")
        with reference.active() as ref_model:
            frozen.ref = frozen_logprobs(ref_model, batch, micro_rows, chunk_tokens, options.share_prompt)
    needs_proximal = options.num_iterations > 1 and (settings.ratio_to == "proximal" or settings.is_level != "none")
    needs_entropy = settings.top_entropy_quantile < 1.0
    if needs_proximal or needs_entropy:
        every_row = micro_batches(batch, options.micro_batch_size, skip_zero_advantage=False)
        rows = every_row if needs_entropy else micro_rows
        proximal, entropy = frozen_logprobs(model, batch, rows, chunk_tokens, options.share_prompt, with_entropy=True)
        frozen.proximal = proximal if needs_proximal else None
        if needs_entropy:
            frozen.high_entropy = high_entropy_tokens(entropy, batch.loss_mask, settings.top_entropy_quantile)
    return frozen


def _spread(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Values [M] of the True entries of ``mask`` [n, W] laid out as [n, W] (0 elsewhere); differentiable."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def micro_batch_inputs(model: nn.Module, batch: StepBatch, rows: torch.Tensor, frozen: FrozenLogprobs,
                       chunk_tokens: int = 512, share_prompt: bool = True) -> TokenBatch:
    """The objective's inputs for the completions ``rows``, [n, W] (W: their longest completion): the policy's
    log-probs and entropies through the fused output layer (only the trained tokens reach it; rlvr.core.fused),
    and the batch's and frozen passes' tensors cut to the same shape."""
    w = row_width(batch, rows)  # columns past every row's completion are padding: not computed
    m = batch.loss_mask[rows, :w].bool()  # [n, W]
    hidden = completion_hidden(model, batch, rows, share_prompt, width=w)[m]  # [M, H], trained tokens only
    targets, temperature = batch.completion_ids[rows, :w][m], uniform_temperature(batch.temperature[rows, :w][m])
    logp, entropy = fused_logprobs(hidden, backbone_and_head(model)[1], targets, temperature, chunk_tokens)  # [M]

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows, :w]

    return TokenBatch(logp=_spread(logp, m), behaviour_logp=batch.behaviour_logp[rows, :w],
                      adv=batch.token_adv(rows)[:, :w].to(logp.dtype), mask=m.to(logp.dtype),
                      proximal_logp=cut(frozen.proximal), ref_logp=cut(frozen.ref), entropy=_spread(entropy, m),
                      high_entropy=cut(frozen.high_entropy))


def apply_update(params: list[nn.Parameter], learner: Learner, max_grad_norm: float,
                 loss: float) -> tuple[float, bool]:
    """Clip the accumulated gradients (the team's way: sharded gradients' norm is summed over the learners) and step;
    a non-finite loss or gradient norm skips the update (weights and optimizer state untouched, gradients dropped).
    Returns (gradient norm, applied)."""
    grad_norm = learner.team.clip_gradients(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        learner.optimizer.zero_grad(set_to_none=True)
        return grad_norm, False
    learner.optimizer.step()
    if learner.scheduler is not None:
        learner.scheduler.step()
    return grad_norm, True


ExtraLoss = Callable[[torch.Tensor], torch.Tensor]  # rows -> a scalar loss of its own (PPO's value loss)


def train_step(learner: Learner, batch: StepBatch, settings: LossSettings, options: StepOptions, *,
               params: list[nn.Parameter] | None = None, extra_loss: ExtraLoss | None = None) -> dict[str, float]:
    """Run ``options.num_iterations`` optimizer steps over the batch and return metrics.

    - Micro-batches come from ``micro_batches``: cut to their longest row, and without the rows that carry no
      gradient (with beta = 0, no entropy bonus and no extra loss: those whose advantage is 0).
    - ``params``: what is clipped and stepped (default: what the learner's optimizer trains); ``extra_loss(rows)``:
      a second loss per micro-batch, backpropagated after the policy's (PPO's critic).
    - An update whose loss or gradient norm is not finite is skipped and counted in ``skipped_updates``.
    - ``learner.team``: the other learners, if any: which groups are this learner's, and the sums (learner.py).
    """
    model, optimizer, team = learner.model, learner.optimizer, learner.team
    batch = batch.to(model_device(model))  # the step's tensors cross to the model's device once
    skip_zero_adv = settings.beta == 0.0 and settings.entropy_coef == 0.0 and extra_loss is None
    micro_rows = micro_batches(batch, options.micro_batch_size, skip_zero_adv, team.groups(batch.prompt_ids.shape[0]))
    fillers = team.fillers(batch, len(micro_rows))  # what the team needs run besides this learner's rows
    chunk_tokens = chunk_for_vocab(options.chunk_tokens, backbone_and_head(model)[1].weight.shape[0])
    normaliser = loss_normaliser(batch.loss_mask, settings.aggregation, options.max_completion_tokens,
                                 settings.count_untrained_rows)
    step_tokens = float(batch.loss_mask.sum())
    frozen = frozen_passes(model, batch, micro_rows + fillers, settings, learner.reference, options, chunk_tokens)
    model.train()
    params = learner.trained_parameters() if params is None else params
    sums: dict[str, float] = {}
    skipped = 0
    for iteration in range(options.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        if not micro_rows:  # nothing carries a gradient: a zero one, so the optimizer steps as it would on one
            for p in params:
                p.grad = torch.zeros_like(p)
        loss_sum = 0.0
        for rows in fillers:  # adds 0
            x = micro_batch_inputs(model, batch, rows, frozen, chunk_tokens, options.share_prompt)
            (policy_loss(x, settings, normaliser, step_tokens)[0] * 0.0).backward()
        for rows in micro_rows:
            x = micro_batch_inputs(model, batch, rows, frozen, chunk_tokens, options.share_prompt)
            loss, part = policy_loss(x, settings, normaliser, step_tokens)
            loss.backward()
            loss_sum += loss.item()
            if extra_loss is not None:
                extra = extra_loss(rows)
                extra.backward()
                loss_sum += extra.item()
            merge_stat_sums(sums, part)
            if iteration == 0:  # the entropy of the weights the step began with
                merge_stat_sums(sums, {"entropy": float(x.entropy.detach()[x.mask.bool()].sum()),
                                       "entropy_tokens": float(x.mask.sum())})
        team.sum_gradients(params, len(micro_rows) + len(fillers))
        loss_sum = team.sum_loss(loss_sum)
        grad_norm, applied = apply_update(params, learner, options.max_grad_norm, loss_sum)
        skipped += not applied
    return {"loss": loss_sum, "grad_norm": grad_norm, "lr": optimizer.param_groups[0]["lr"],
            "skipped_updates": skipped, **step_statistics(team.sum_statistics(sums)), **team.report()}


def step_statistics(sums: dict[str, float]) -> dict[str, float]:
    """The step's metrics from summed statistics, each under its own name (rlvr/core/losses.py): ``NAME`` is its sum
    divided by ``NAME_tokens`` where that count exists, else by ``tokens`` (a mean, or a fraction of booleans);
    ``NAME_max`` stands as it is. A step that computed nothing reports an entropy of 0 and no other statistic."""
    tokens = max(sums.get("tokens", 0.0), 1.0)
    metrics = {"entropy": 0.0}
    for name, value in sums.items():
        if name == "tokens" or name.endswith("_tokens"):
            continue
        metrics[name] = value if name.endswith("_max") else value / max(sums.get(f"{name}_tokens", tokens), 1.0)
    return metrics
