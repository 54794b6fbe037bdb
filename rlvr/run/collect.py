"""The synchronous batch source: prompts -> groups -> rewards -> advantages, with DAPO's dynamic sampling
(dynamic_sampling.py); and what a step's collection reports.

``scored_batch`` is the one place a batch's advantages are computed, for every source (the asynchronous one in
rlvr/runtime/source.py builds its batches with it too). ``collect`` only needs a Sampler, the reward functions
and a source of dataset rows, so any runtime can call it.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable

import torch

from rlvr.config.schema import RunConfig
from rlvr.core import group_advantages, normalize_then_sum
from rlvr.learn.collected import Collected, Round
from rlvr.platform.distributed import Collectives
from rlvr.platform.seeds import round_seed, step_seed
from rlvr.rewards import Scores, WeightedReward
from rlvr.rollout import Groups, Sampler, SamplingParams
from rlvr.rollout.episodes import EpisodeStats
from rlvr.run.build import SAMPLER_BACKENDS, build_sampler, sampling_params
from rlvr.run.curriculum import Curriculum, stage_row_ids
from rlvr.run.dynamic_sampling import DynamicSampling
from rlvr.run.learners import SharedServers, gather_round
from rlvr.run.lifecycle import Run
from rlvr.run.scoring import EnvironmentSetup, sample_scored
from rlvr.tasks import data_order

Advantages = Callable[[Scores], torch.Tensor]  # a batch's scores -> advantages [N] (0 where unscored)


def group_advantage_fn(group_size: int, scale: str, eps: float, negative_scale: float,
                       reward_aggregation: str = "sum_then_normalize") -> Advantages:
    """GRPO's advantages with the run's settings: of the weighted sum of the rewards (rlvr.core.group_advantages),
    or, with normalize_then_sum, each reward normalised in its group first (GDPO: rlvr.core.normalize_then_sum)."""
    if reward_aggregation == "normalize_then_sum":
        def gdpo(scores: Scores) -> torch.Tensor:
            per_function = torch.stack(list(scores.per_function.values()), dim=1)  # [N, K]
            adv = normalize_then_sum(per_function, scores.weight_vector(), group_size, eps)
            return torch.where(adv < 0, adv * negative_scale, adv)
        return gdpo
    return lambda scores: group_advantages(scores.total, group_size, scale, eps, negative_scale)  # type: ignore[arg-type]


def scored_batch(rounds: list[Round], kept: list[tuple[Round, torch.Tensor]], advantages: Advantages | None,
                 time_generate_s: float, time_reward_s: float) -> Collected:
    """The batch of the ``kept`` groups (a round and the indices of its groups to train, each) with advantages
    computed over them - the only place a batch's advantages are computed."""
    G = kept[0][0].groups.group_size
    groups = Groups.concat([r.groups.select(idx.tolist()) for r, idx in kept])
    completion_rows = [(idx[:, None] * G + torch.arange(G)).reshape(-1) for _, idx in kept]  # [n_k * G] each
    scores = Scores.concat([r.scores.select(c) for (r, _), c in zip(kept, completion_rows)])
    return Collected(
        rounds=rounds,
        row_ids=[r.row_ids[i] for r, idx in kept for i in idx.tolist()],
        groups=groups,
        scores=scores,
        adv=None if advantages is None else advantages(scores),  # [N]
        time_generate_s=time_generate_s,
        time_reward_s=time_reward_s,
    )


def collect(
    sampler: Sampler,
    next_row_ids: Callable[[], list[int]],
    rows: list[dict],
    group_size: int,
    params: SamplingParams,
    rewards: list[WeightedReward],
    advantages: Advantages | None,
    *,
    seed: int,
    dynamic_sampling: bool = False,
    max_resample_rounds: int = 0,
    env_setup: EnvironmentSetup | None = None,
    collectives: Collectives | None = None,
    first: int = 0,
) -> Collected:
    """Sample, score and compute advantages for one step.

    ``next_row_ids()`` gives the dataset rows of one round (B of them) and advances the data stream. Rounds are
    sampled, and their groups kept or dropped, as ``DynamicSampling`` decides (rlvr.run.dynamic_sampling):
    without dynamic sampling one round, trained as it is; with it, until B informative groups are in hand or
    ``max_resample_rounds`` extra rounds were sampled. ``env_setup``: multi-turn episodes instead of
    single completions (rlvr.run.scoring). ``collectives``: one of several learners (torchrun) samples and
    scores its share of each round and gets the whole round back (rlvr.run.learners). ``first``: the position of
    these rows in a batch that other learners share (diloco.rollouts=step), which seeds their completions.
    """
    world = collectives.world if collectives is not None else None
    rounds: list[Round] = []
    t_generate = t_reward = 0.0
    pick: DynamicSampling[tuple[int, int]] | None = None  # (round, group within it)
    while pick is None or not pick.done:
        row_ids = next_row_ids()
        if world is None or world.size == 1:
            round_ = sample_scored(sampler, [rows[i] for i in row_ids], group_size, params,
                                   round_seed(seed, len(rounds)), rewards, env_setup, row_ids=row_ids, first=first)
        else:
            share = world.share(len(row_ids))  # this learner's prompts of the round, a contiguous run
            mine = [row_ids[i] for i in share]
            part = sample_scored(sampler, [rows[i] for i in mine], group_size, params, round_seed(seed, len(rounds)),
                                 rewards, env_setup, row_ids=mine, first=share.start)
            round_ = gather_round(collectives, part, row_ids)
        t_generate, t_reward = t_generate + round_.time_generate_s, t_reward + round_.time_reward_s
        pick = pick or DynamicSampling(len(row_ids), dynamic_sampling, max_resample_rounds)
        for i, informative in enumerate(round_.informative.tolist()):
            pick.offer((len(rounds), i), informative)
        rounds.append(round_)
    trained = pick.trained()
    kept = [(r, torch.tensor([i for k, i in trained if k == n])) for n, r in enumerate(rounds)]
    return scored_batch(rounds, [(r, idx) for r, idx in kept if idx.numel()], advantages, t_generate, t_reward)


def _masked_stats(values: torch.Tensor) -> tuple[float, float]:
    v = values[~torch.isnan(values)]
    if v.numel() == 0:
        return math.nan, math.nan
    return float(v.mean()), float(v.std()) if v.numel() > 1 else 0.0


def collect_metrics(c: Collected, version: int) -> dict[str, float]:
    """Rewards of everything sampled this step (the policy's, not only the trained subset), signal, lengths,
    staleness of the trained groups against the learner's ``version``, and timing."""
    sampled = Scores.concat([r.scores for r in c.rounds])
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


def episode_metrics(c: Collected) -> dict[str, float]:
    """Turns, tool calls and errors per tool, environment time, observation vs model tokens and truncations by
    cause, over every episode sampled this step (empty for single completions)."""
    total = EpisodeStats.total([r.episode_stats for r in c.rounds])
    return total.as_metrics() if total else {}


def warn_unscored(batch: Collected, step: int, warned: bool) -> bool:
    """Say once per run (``warned``: said already) that a step had no reward for any completion; returns whether
    it has been said."""
    message = None if warned else batch.scores.unscored_warning()
    if message:
        print(f"rlvr: warning: step {step}: {message} (shown once per run)", file=sys.stderr, flush=True)
    return warned or message is not None


def round_share(num_rows: int, seed: int, position: int, share: tuple[int, int], prompts: int) -> list[int]:
    """Learner k's rows of a round that K learners split (``share`` = (k, K)): positions [position + k B,
    position + (k + 1) B) of the data stream, B = ``prompts`` - its contiguous share of the K B rows one learner
    would draw there (diloco.rollouts=step)."""
    return data_order(num_rows, seed, position + share[0] * prompts, prompts)


class SyncSource:
    """The synchronous batch source: each step samples B prompts' groups with the run's sampler (the training
    model in this process, or rollout servers: rollout.backend), scores them and computes their advantages.
    ``share`` = (k, K): one of K learners that draw each round's K x B rows together and sample share k of them
    (diloco.rollouts=step); every step then moves the data stream by K x B x its most rounds, on every learner."""

    label = ""  # the progress bar shows the preset alone
    metrics_section = "data"  # report(): the curriculum's stage

    def __init__(self, cfg: RunConfig, advantages: Advantages | None):
        self.cfg, self.advantages = cfg, advantages
        self.curriculum = Curriculum.of(cfg.task)
        self.stage = 0
        self.share: tuple[int, int] | None = None

    def rounds_reserved(self) -> int:
        """Sampling rounds a step may draw (1 + algo.max_resample_rounds under dynamic sampling)."""
        return 1 + self.cfg.algo.max_resample_rounds if self.cfg.algo.dynamic_sampling else 1

    def open(self, run: Run, stack: contextlib.ExitStack) -> Sampler:
        learners = self.share[1] if self.share else run.collectives.world.size  # auto per-completion seeds
        sampler = build_sampler(self.cfg, run.model, run.data.tokenizer, run.run_dir, learners)
        if run.collectives.world.size > 1 and SAMPLER_BACKENDS[self.cfg.rollout.backend].publishes_adapters:
            sampler = SharedServers(sampler, run.collectives)  # rank 0 publishes each adapter version
        stack.callback(sampler.close)
        return sampler

    def next(self, run: Run, step: int) -> Collected:
        cfg, B = self.cfg, self.cfg.train.prompts_per_step

        rows = run.data.train_rows
        start, drawn = run.state["cursor"], [0]

        def next_row_ids() -> list[int]:
            if self.share:  # this learner's share of the round's K x B rows
                K = self.share[1]
                drawn[0] += 1
                return round_share(len(rows), cfg.train.seed, start + (drawn[0] - 1) * K * B, self.share, B)
            if self.curriculum:
                return stage_row_ids(rows, self.curriculum.allowed(run.state), B, run.state,
                                     lambda start, n: data_order(len(rows), cfg.train.seed, start, n))
            ids = data_order(len(rows), cfg.train.seed, run.state["cursor"], B)
            run.state["cursor"] += B
            return ids

        c = collect(run.sampler, next_row_ids, rows, cfg.rollout.group_size, sampling_params(cfg.rollout),
                    run.rewards, self.advantages, seed=step_seed(cfg.train.seed, step),
                    dynamic_sampling=cfg.algo.dynamic_sampling, max_resample_rounds=cfg.algo.max_resample_rounds,
                    env_setup=run.data.env_setup, collectives=run.collectives,
                    first=self.share[0] * B if self.share else 0)
        if self.share:  # every learner moves the stream alike, however many rounds it drew
            run.state["cursor"] = start + self.share[1] * B * self.rounds_reserved()
        if self.curriculum:  # the pass rate: the first reward's mean over everything sampled this step
            first = Scores.concat([r.scores for r in c.rounds]).per_function[run.rewards[0].name]
            self.curriculum.record(run.state, float(first[~torch.isnan(first)].mean()) if (~torch.isnan(first)).any()
                                   else 0.0)
            self.stage = run.state["curriculum_stage"]
        return c

    def report(self) -> dict[str, float]:
        """data/curriculum_stage: the stage the next step draws from (with task.curriculum)."""
        return {"curriculum_stage": self.stage} if self.curriculum else {}

    def state(self) -> dict:
        return {}  # the cursor (and the curriculum's stage) live in run.state already
