"""collect(): prompts -> groups -> rewards -> advantages, with DAPO's dynamic sampling; and its metrics.

Any runtime can call it: it only needs a Sampler, the reward functions, and a source of dataset rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlvr.core import group_advantages, informative_groups
from rlvr.rewards import Scores, WeightedReward, as_completions, score_completions
from rlvr.rollout import Groups, Sampler, SamplingParams
from rlvr.tasks import reward_columns

ROUND_SEED_STRIDE = 1_000_000_007  # sampling seed of extra round k: seed + k * stride


@dataclass
class Round:
    """One sampling round: B prompts, G completions each, scored."""

    row_ids: list[int]
    groups: Groups
    scores: Scores
    informative: torch.Tensor  # [B] bool: the group's rewards differ
    uids: list[int] | None = None  # positions in the data stream (asynchronous runs log them)


@dataclass
class Collected:
    """What one step trains on (``groups`` and everything aligned with them) and every round sampled for it."""

    rounds: list[Round]
    row_ids: list[int]  # dataset row of each trained group
    groups: Groups
    scores: Scores  # per trained completion
    adv: torch.Tensor  # [N]
    time_generate_s: float
    time_reward_s: float

    @property
    def included(self) -> torch.Tensor:
        """[N] bool: completions with a reward (the others are not trained on)."""
        return ~torch.isnan(self.scores.total)


def score_groups(rewards: list[WeightedReward], groups: Groups, rows: list[dict]) -> Scores:
    """Every reward function once over the groups' completions; ``rows[i]`` is group i's dataset row."""
    G = groups.group_size
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    columns = {**reward_columns(rows, G), "completion_ids": groups.completion_token_ids()}
    return score_completions(rewards, prompts, as_completions(prompts, groups.texts), columns)


def _select_scores(scores: Scores, rows: torch.Tensor) -> Scores:
    return Scores(scores.total[rows], {k: v[rows] for k, v in scores.per_function.items()}, scores.errors)


def _concat_scores(parts: list[Scores]) -> Scores:
    names = parts[0].per_function
    per_function = {k: torch.cat([p.per_function[k] for p in parts]) for k in names}
    return Scores(torch.cat([p.total for p in parts]), per_function, {k: v for p in parts for k, v in p.errors.items()})


def collect(
    sampler: Sampler,
    next_row_ids: Callable[[], list[int]],
    rows: list[dict],
    group_size: int,
    params: SamplingParams,
    rewards: list[WeightedReward],
    *,
    seed: int,
    scale: str = "group",
    adv_eps: float = 1e-4,
    negative_scale: float = 1.0,
    dynamic_sampling: bool = False,
    max_extra_rounds: int = 0,
) -> Collected:
    """Sample, score and compute advantages for one step.

    ``next_row_ids()`` gives the dataset rows of one round (B of them) and advances the data stream. Without
    dynamic sampling one round is trained as it is. With it, groups whose rewards are all equal are dropped
    and further rounds are sampled (at most ``max_extra_rounds``) until B informative groups are in hand;
    extra informative groups beyond B are dropped (DAPO), and if the rounds run out the step trains on
    the informative groups it has. If no round had any, the first round is trained as it is: its
    advantages are all 0, as in GRPO without dynamic sampling.
    """
    rounds: list[Round] = []
    t_generate = t_reward = 0.0
    kept: list[tuple[Round, torch.Tensor]] = []
    have = 0
    for k in range(1 + (max_extra_rounds if dynamic_sampling else 0)):
        row_ids = next_row_ids()
        t0 = time.perf_counter()
        groups = sampler.sample([rows[i]["prompt"] for i in row_ids], group_size, params, seed + k * ROUND_SEED_STRIDE)
        t1 = time.perf_counter()
        scores = score_groups(rewards, groups, [rows[i] for i in row_ids])
        t_generate, t_reward = t_generate + t1 - t0, t_reward + time.perf_counter() - t1
        round_ = Round(row_ids, groups, scores, informative_groups(scores.total, group_size))
        rounds.append(round_)
        if not dynamic_sampling:
            kept.append((round_, torch.arange(len(row_ids))))
            break
        picked = round_.informative.nonzero().squeeze(-1)[: len(row_ids) - have]
        if picked.numel():
            kept.append((round_, picked))
            have += picked.numel()
        if have == len(row_ids):
            break
    if not kept:
        kept.append((rounds[0], torch.arange(len(rounds[0].row_ids))))
    G = group_size
    groups = Groups.concat([r.groups.select(idx.tolist()) for r, idx in kept])
    completion_rows = [(idx[:, None] * G + torch.arange(G)).reshape(-1) for _, idx in kept]
    scores = _concat_scores([_select_scores(r.scores, c) for (r, _), c in zip(kept, completion_rows)])
    return Collected(
        rounds=rounds,
        row_ids=[r.row_ids[i] for r, idx in kept for i in idx.tolist()],
        groups=groups,
        scores=scores,
        adv=group_advantages(scores.total, G, scale, adv_eps, negative_scale),  # [N]
        time_generate_s=t_generate,
        time_reward_s=t_reward,
    )


def _masked_stats(values: torch.Tensor) -> tuple[float, float]:
    v = values[~torch.isnan(values)]
    if v.numel() == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std()) if v.numel() > 1 else 0.0


def collect_metrics(c: Collected, version: int) -> dict[str, float]:
    """Rewards of everything sampled this step (the policy's, not only the trained subset), signal, lengths,
    staleness of the trained groups against the learner's ``version``, and timing."""
    sampled = _concat_scores([r.scores for r in c.rounds])
    informative = torch.cat([r.informative for r in c.rounds])
    lengths = torch.cat([r.groups.completion_mask.sum(-1) for r in c.rounds]).float()
    truncated = torch.cat([r.groups.truncated for r in c.rounds]).float()
    staleness = (version - c.groups.version).float()
    reward_mean, reward_std = _masked_stats(sampled.total)
    return {
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "reward_missing_frac": float(torch.isnan(sampled.total).float().mean()),
        **{f"reward/{k}_{stat}": x for k, v in sampled.per_function.items()
           for stat, x in zip(("mean", "std"), _masked_stats(v))},
        **{f"reward/{k}_missing": int(torch.isnan(v).sum()) for k, v in sampled.per_function.items()},
        **{f"reward/{k}_errors": 1 for k in sampled.errors},
        "zero_variance_frac": float((~informative).float().mean()),
        "groups_sampled": len(informative),
        "groups_trained": c.groups.num_groups,
        "sampling_rounds": len(c.rounds),
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "completion_len_mean": float(lengths.mean()),
        "completion_len_max": float(lengths.max()),
        "truncated_frac": float(truncated.mean()),
        "time_generate_s": c.time_generate_s,
        "time_reward_s": c.time_reward_s,
        "gen_tokens_per_s": float(lengths.sum()) / max(c.time_generate_s, 1e-9),
    }
