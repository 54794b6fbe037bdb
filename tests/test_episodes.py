"""Multi-turn episodes in process: the token stream (model turns, then observation turns appended as tokens only),
its masks, the limits that end an episode, and that the update trains on it."""

import copy

import pytest
import torch

from rlvr.core import LossSettings
from rlvr.learn.batch import StepBatch
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.models.prompts import prompt_token_ids
from rlvr.rollout import LocalSampler, SamplingParams
from rlvr.rollout.episodes import EpisodeLimits, observation_ids
from tests.conftest import make_model

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]
G = 2


class Scripted:
    """Answers the first ``calls`` model turns with one observation each, then ends the episode; records turns."""

    def __init__(self, calls: int, text: str = "7"):
        self.calls, self.text, self.seen = calls, text, []

    def step(self, text: str, timeout_s: float) -> list[str]:
        self.seen.append(text)
        return [self.text] if len(self.seen) <= self.calls else []


def _model(tokenizer, eos_every=5):
    model = make_model(len(tokenizer))
    model.generation_config.eos_token_id = list(range(0, len(tokenizer), eos_every))  # turns end at varied lengths
    return model


def _episodes(model, tokenizer, envs, limits=None, seed=0, max_new_tokens=6):
    """Episodes in process (LocalSampler: one generator per episode, seeded from ``seed`` and its position)."""
    prompt_ids = [prompt_token_ids(tokenizer, p) for p in PROMPTS]
    out = LocalSampler(model, tokenizer).sample_episodes(prompt_ids, envs, G, SamplingParams(
        max_new_tokens=max_new_tokens), seed, limits or EpisodeLimits())
    return out.groups, out.stats


def test_an_observation_is_the_tool_turn_after_the_models_end_of_turn(tokenizer):
    ids = observation_ids(tokenizer, ["7", "x"])
    assert tokenizer.decode(ids) == ("\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>tool\nx<|im_end|>\n"
                                     "<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    rewriting = copy.deepcopy(tokenizer)  # drops an assistant turn's content unless it is the last message (Qwen3-like)
    rewriting.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        observation_ids(rewriting, ["7"])


def test_the_stream_is_turns_and_observations_with_their_masks(tokenizer):
    model = _model(tokenizer)
    envs = [Scripted(calls=2) for _ in range(len(PROMPTS) * G)]
    groups, stats = _episodes(model, tokenizer, envs, EpisodeLimits(max_turns=4, max_episode_tokens=200),
                              max_new_tokens=32)  # every turn ends by itself (an EOS id every 5 ids)
    obs = observation_ids(tokenizer, ["7"])
    for i, env in enumerate(envs):
        n = int(groups.completion_mask[i].sum())
        ids, sampled = groups.completion_ids[i, :n].tolist(), groups.sampled_mask[i, :n].tolist()
        # turn, observation, turn, observation, turn: every unsampled run of tokens is exactly one observation
        runs, k = [], 0
        while k < n:
            j = k
            while j < n and sampled[j] == sampled[k]:
                j += 1
            runs.append((sampled[k], ids[k:j]))
            k = j
        assert [s for s, _ in runs] == [1, 0, 1, 0, 1] and all(r == obs for s, r in runs if s == 0)
        assert len(env.seen) == 3 and stats.turns[i] == 3
        assert [tokenizer.decode(r, skip_special_tokens=True) for s, r in runs if s == 1] == env.seen
        assert torch.all(groups.behaviour_logp[i, :n][torch.tensor(sampled) == 0] == 0)
        assert torch.all(groups.behaviour_logp[i, :n][torch.tensor(sampled) == 1] < 0)
    assert stats.observation_tokens == 2 * len(obs) * len(envs) and not groups.truncated.any()


def test_each_limit_ends_an_episode_and_is_counted(tokenizer):
    model = _model(tokenizer, eos_every=10_000)  # only id 0 ends a turn: every turn runs to max_new_tokens
    groups, stats = _episodes(model, tokenizer, [Scripted(calls=9) for _ in range(4)], max_new_tokens=4)
    assert groups.truncated.all() and stats.truncated == {"turn_tokens": 4} and stats.turns == [1] * 4

    model = _model(tokenizer)
    groups, stats = _episodes(model, tokenizer, [Scripted(calls=9) for _ in range(4)], EpisodeLimits(max_turns=2))
    ended = stats.truncated["max_turns"] + stats.truncated["turn_tokens"]
    assert ended == 4 and groups.truncated.all() and max(stats.turns) <= 2

    groups, stats = _episodes(model, tokenizer, [Scripted(calls=9) for _ in range(4)], EpisodeLimits(9, 12))
    assert int(groups.completion_mask.sum(-1).max()) <= 12 and stats.truncated["episode_tokens"] >= 1


def test_an_episode_depends_only_on_its_own_generator_and_environment(tokenizer):
    model = _model(tokenizer)
    a, _ = _episodes(model, tokenizer, [Scripted(calls=1) for _ in range(4)])
    b, _ = _episodes(model, tokenizer, [Scripted(calls=1)] + [Scripted(calls=3, text="99") for _ in range(3)])
    n = int(a.completion_mask[0].sum())
    assert int(b.completion_mask[0].sum()) == n and torch.equal(a.completion_ids[0, :n], b.completion_ids[0, :n])


def test_the_update_trains_on_episodes(tokenizer):
    model = _model(tokenizer)
    groups, _ = _episodes(model, tokenizer, [Scripted(calls=1) for _ in range(4)])
    batch = StepBatch.from_groups(groups, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert torch.equal(batch.loss_mask, groups.sampled_mask)
    before = [p.clone() for p in model.parameters()]
    stats = train_step(Learner(model, torch.optim.SGD(model.parameters(), lr=0.1)), batch, LossSettings(),
                       StepOptions(micro_batch_size=4, max_completion_tokens=6))
    assert stats["skipped_updates"] == 0 and any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class Counter:
    """A TRL-style environment: reset(**row), public methods are tools."""

    def reset(self, **row):
        self.total = 0
        return "The counter starts at 0."

    def add(self, n: int) -> int:
        """Add to the counter.

        Args:
            n: how much to add
        """
        self.total += n
        return self.total


def test_a_trl_style_environment_drives_episodes(tokenizer):
    from rlvr.envs.environment import load_environment

    spec = load_environment(Counter)
    episodes = [spec.episode() for _ in range(4)]
    assert [e.reset({"prompt": "p"}) for e in episodes] == ["The counter starts at 0."] * 4
    groups, stats = _episodes(_model(tokenizer), tokenizer, episodes, max_new_tokens=32)
    # a random model writes no <tool_call>: every episode is one turn, ended by the environment, none truncated
    assert stats.turns == [1] * 4 and all(e.done for e in episodes) and not groups.truncated.any()
    assert torch.equal(groups.sampled_mask, groups.completion_mask)
