"""Greedy held-out evaluation: accuracy (the fraction of questions whose correctness reward is 1, on episodes with
tools), and beside it what the training judge never sees - the run's rewards on the held-out replies, the
evaluation-only metrics (eval.metrics: a judge of another model, a lexicon, any reward function), the replies'
length, truncation and refusal rates - with the replies themselves, for the detector of a gamed reward
(rlvr.run.gaming)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlvr.rewards import RewardFn, WeightedReward
from rlvr.rewards.format import refusal
from rlvr.rollout import Sampler, SamplingParams
from rlvr.run.scoring import EnvironmentSetup, sample_scored

CHECK, REFUSAL = "check", "refusal_frac"
REWARD, METRIC = "reward/", "metric/"  # prefixes of the run's rewards and of eval.metrics in HeldOut.sums


@dataclass
class HeldOut:
    """One evaluation of some held-out rows (a learner's share under torchrun)."""

    n: int = 0  # rows evaluated
    sums: dict[str, list[float]] = field(default_factory=dict)  # measure -> [sum of its values, rows it scored]
    replies: list[dict] = field(default_factory=list)  # [n] {"prompt", "reply", "scores": {measure: value | None}}

    def mean(self, name: str) -> float | None:
        total, count = self.sums.get(name, (0.0, 0))
        return total / count if count else None

    @property
    def accuracy(self) -> float:
        """The share of rows the correctness check scored 1 (unscored rows count as wrong)."""
        return self.sums.get(CHECK, [0.0, 0])[0] / max(self.n, 1)

    def metrics(self, weights: dict[str, float]) -> dict[str, float]:
        """``eval/`` metrics: each run reward's mean on the held-out replies (``eval/reward/NAME``) and their
        ``weights``-weighted sum (``eval/reward``), each eval.metrics entry (``eval/metric/NAME``), the mean reply
        length in tokens, the truncated and refusing shares. A measure that scored no row is left out."""
        out = {}
        for name in self.sums:
            value = self.mean(name)
            if value is not None and name != CHECK:
                out["eval/" + name] = value
        rewards = [(self.mean(REWARD + k), w) for k, w in weights.items() if w]
        if rewards and all(v is not None for v, _ in rewards):
            out["eval/reward"] = sum(v * w for v, w in rewards)
        return out


def held_out(
    sampler: Sampler,
    rows: list[dict],
    check: RewardFn,
    batch_size: int,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    env_setup: EnvironmentSetup | None = None,
    rewards: list[WeightedReward] = (),
    metrics: list[WeightedReward] = (),
) -> HeldOut:
    """Greedy decoding (one completion, or one episode, per prompt) through ``sampler``; each reply scored by
    ``check``, by the run's ``rewards`` (unweighted, each as ``reward/NAME``), by ``metrics`` (``metric/NAME``) and
    for refusal; its length and truncation counted."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop=stop)
    measures = [WeightedReward(CHECK, check), WeightedReward(REFUSAL, refusal())]
    measures += [WeightedReward(REWARD + r.name, r.fn, 1.0, "none", r.timeout_s) for r in rewards]
    measures += [WeightedReward(METRIC + r.name, r.fn, 1.0, "none", r.timeout_s) for r in metrics]
    out = HeldOut()
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        got = sample_scored(sampler, batch, 1, greedy, 0, measures, env_setup)
        known = {m.name for m in measures}
        columns = {(k if k in known else REWARD + k): v.tolist()  # the environment's own reward: a run reward too
                   for k, v in got.scores.per_function.items()}
        columns[CHECK] = [float(v == 1.0) for v in columns[CHECK]]  # correct: exactly 1 (NaN: unscored, wrong)
        lengths = got.groups.completion_mask.sum(-1).tolist()
        columns["length_mean"] = [float(n) for n in lengths]
        columns["truncated_frac"] = [float(t) for t in got.groups.truncated.tolist()]
        for name, values in columns.items():
            present = [v for v in values if not math.isnan(v)]
            acc = out.sums.setdefault(name, [0.0, 0])
            acc[0] += sum(present)
            acc[1] += len(present)
        for i, row in enumerate(batch):
            scores = {k: (None if math.isnan(v[i]) else v[i]) for k, v in columns.items()}
            out.replies.append({"prompt": row["prompt"], "reply": got.groups.texts[i], "scores": scores})
        out.n += len(batch)
    return out


def evaluate(sampler: Sampler, rows: list[dict], check: RewardFn, *args, **kwargs) -> float:
    """Greedy accuracy alone: ``held_out``'s, with its other arguments (batch size, token cap, stop, episodes)."""
    return held_out(sampler, rows, check, *args, **kwargs).accuracy


def environment_reward(env_setup: EnvironmentSetup | None) -> str | None:
    """The name episodes' own reward is scored under (the environment's), or None."""
    return env_setup.spec.name if env_setup is not None and env_setup.spec.has_reward else None


def measure_names(rewards: list[WeightedReward], metrics: list[WeightedReward],
                  env_setup: EnvironmentSetup | None = None) -> list[str]:
    """Every name ``held_out`` may sum, in one order (the same on every learner)."""
    env = environment_reward(env_setup)
    return [CHECK, REFUSAL, *(REWARD + r.name for r in rewards), *([REWARD + env] if env else []),
            *(METRIC + r.name for r in metrics), "length_mean", "truncated_frac"]


def summed(part: HeldOut, names: list[str], sum_floats) -> HeldOut:
    """``part``'s sums added over the learners (``sum_floats``: rlvr.platform.distributed's all-reduce of a dict);
    the replies stay this learner's."""
    flat = {"n": float(part.n)}
    for name in names:
        total, count = part.sums.get(name, (0.0, 0))
        flat[f"{name}\0sum"], flat[f"{name}\0count"] = total, float(count)
    flat = sum_floats(flat)
    sums = {n: [flat[f"{n}\0sum"], int(flat[f"{n}\0count"])] for n in names if flat[f"{n}\0count"]}
    return HeldOut(int(flat["n"]), sums, part.replies)
