"""Several learners in one run (torchrun): what they support, and how a step's round becomes whole on every rank.

Each learner samples and scores its contiguous share of a round's prompts (``World.share``: a group is never
split), then ``gather_round`` hands every rank the whole round, in prompt order, as one process would have drawn it
(with per-completion seeds the samples are the same: rollout.per_completion_seeds). From there every decision that
reads the batch (advantages, dynamic sampling, the curriculum, the metrics) is the single process's.
"""

from __future__ import annotations

import torch

from rlvr.config.schema import RunConfig
from rlvr.learn.collected import Round
from rlvr.platform.distributed import Collectives, World
from rlvr.rewards import Scores
from rlvr.rollout import Groups, Sampler
from rlvr.rollout.episodes import EpisodeStats

NOT_YET = {
    "async.enabled": "the asynchronous runtime has one learner; run it without torchrun",
}


def check_learners(cfg: RunConfig, world: World) -> None:
    """One line for what a job of several learners cannot do yet, before anything loads."""
    used = {"async.enabled": cfg.asynchronous.enabled}
    for key, on in used.items():
        if on:
            raise ValueError(f"{key} with {world.size} learners (torchrun): {NOT_YET[key]}")
    if sharded_weights(cfg, world) and cfg.algo.name == "ppo":
        raise ValueError("algo.name=ppo with sharded weights (train.shard_weights): PPO's critic is not sharded; "
                         "set train.shard_weights=false (every learner then holds a replica)")
    if cfg.train.prompts_per_step < world.size:
        raise ValueError(f"train.prompts_per_step={cfg.train.prompts_per_step} gives some of the {world.size} learners "
                         "no prompt: raise it to at least the number of learners")


def sharded_weights(cfg: RunConfig, world: World) -> bool:
    """Whether this job shards its weights across the learners (train.shard_weights; auto: full fine-tuning)."""
    on = cfg.train.shard_weights
    return world.size > 1 and (not cfg.model.lora if on == "auto" else on)


_GROUP_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behaviour_logp", "truncated",
                 "version", "temperature", "sampled_mask")


def gather_round(collectives: Collectives, part: Round, row_ids: list[int]) -> Round:
    """The whole round from every learner's ``part`` (its share of the prompts ``row_ids``), in rank order; timings
    are the slowest learner's."""
    g = part.groups
    fields = {}
    for name in _GROUP_FIELDS:
        t = getattr(g, name)
        got = collectives.gather(t.to(torch.uint8) if t.dtype == torch.bool else t)  # gloo has no bool
        fields[name] = [x.bool() if t.dtype == torch.bool else x for x in got]
    texts = collectives.gather_texts(g.texts)
    groups = Groups.concat([Groups(**{k: v[r] for k, v in fields.items()}, texts=texts[r], group_size=g.group_size)
                            for r in range(collectives.world.size)])
    s = part.scores
    total = torch.cat(collectives.gather(s.total))
    per_function = {k: torch.cat(collectives.gather(v)) for k, v in s.per_function.items()}
    errors = {}
    names, messages = collectives.gather_texts(list(s.errors)), collectives.gather_texts(list(s.errors.values()))
    for n, m in zip(names, messages):  # a reward function's contained failure, as any learner saw it
        errors.update(zip(n, m))
    episodes = None if part.episode_stats is None else gather_episode_stats(collectives, part.episode_stats)
    times = [collectives.max_float(part.time_generate_s), collectives.max_float(part.time_reward_s)]
    return Round(row_ids, groups, Scores(total, per_function, errors, s.weights), episodes, *times)


_SEP = "\x1f"  # between a tool's name and an error kind in a flattened counter key


def _flat(stats: EpisodeStats) -> dict[str, float]:
    """Every counter of ``stats`` as one named number (the turns per episode apart)."""
    t = stats.tools
    return {"observation_tokens": stats.observation_tokens, "model_tokens": stats.model_tokens,
            "env_seconds": stats.env_seconds, "calling": stats.calling,
            **{f"truncated/{k}": v for k, v in stats.truncated.items()},
            **{f"calls/{k}": v for k, v in t.calls.items()}, **{f"seconds/{k}": v for k, v in t.seconds.items()},
            **{f"errors/{k}{_SEP}{kind}": v for (k, kind), v in t.errors.items()},
            **{f"cut/{k}": v for k, v in t.truncated.items()}}


def _unflat(values: dict[str, float], turns: list[int]) -> EpisodeStats:
    stats = EpisodeStats(turns=turns, observation_tokens=int(values.pop("observation_tokens")),
                         model_tokens=int(values.pop("model_tokens")), env_seconds=values.pop("env_seconds"),
                         calling=int(values.pop("calling")))
    t = stats.tools
    for key, v in values.items():
        kind, _, name = key.partition("/")
        if kind == "truncated":
            stats.truncated[name] = int(v)
        elif kind == "calls":
            t.calls[name] = int(v)
        elif kind == "seconds":
            t.seconds[name] = v
        elif kind == "errors":
            t.errors[tuple(name.split(_SEP, 1))] = int(v)
        elif kind == "cut":
            t.truncated[name] = int(v)
    return stats


def gather_episode_stats(collectives: Collectives, stats: EpisodeStats) -> EpisodeStats:
    """Every learner's episode statistics merged, in rank order (names as UTF-8, numbers as float64)."""
    flat = _flat(stats)
    names = collectives.gather_texts(list(flat))
    values = collectives.gather(torch.tensor(list(flat.values()), dtype=torch.float64, device="cpu"))
    turns = collectives.gather(torch.tensor(stats.turns, dtype=torch.long, device="cpu"))
    return EpisodeStats.total([_unflat(dict(zip(n, v.tolist())), t.tolist()) for n, v, t in zip(names, values, turns)])


class SharedServers:
    """The rollout servers of a job of several learners: every learner samples its share from them, rank 0 alone
    publishes each version of the adapter (to the bucket and the servers), and the others wait for it before they
    name that version in a request."""

    def __init__(self, sampler: Sampler, collectives: Collectives):
        self.sampler, self.collectives = sampler, collectives

    @property
    def version(self) -> int:
        return self.sampler.version

    def sample(self, *args, **kwargs) -> Groups:
        return self.sampler.sample(*args, **kwargs)

    def sample_episodes(self, *args, **kwargs):
        return self.sampler.sample_episodes(*args, **kwargs)

    def sync(self, version: int) -> None:
        if self.collectives.world.main:
            self.sampler.sync(version)
        self.collectives.barrier("waiting for rank 0 to publish the adapter")
        self.sampler.version = version

    def stats(self) -> dict[str, float]:
        return self.sampler.stats()

    def close(self) -> None:
        self.sampler.close()
