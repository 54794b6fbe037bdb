"""Multi-turn episodes in this process: the model writes a turn, the environment answers its tool calls, the
model goes on - one token stream per episode, returned as ``Groups`` like single-turn completions.

Token in, token out: the tokens the model sampled are kept exactly as sampled, and each observation is appended
as the tokens of a new turn only (``observation_ids``), so the history is never re-rendered through the chat
template (a template that rewrites earlier turns - Qwen3 drops past <think> - cannot change what the trainer
scores). Observation tokens are attended to but not trained on: ``Groups.sampled_mask`` is 1 on sampled tokens
only, and their behaviour log-prob is 0.

An episode ends when a turn has no tool call, or at a limit: ``max_turns`` model turns, ``max_episode_tokens``
completion tokens (turns and observations together), or a turn cut at ``max_new_tokens`` without ending; each
limit that ends an episode is counted (``EpisodeStats.truncated``) and marks the episode truncated.

Not here yet (issue 23): the TRL-style environment adapter that builds the ``Environment`` objects from a user's
class, rollout servers driving turns with token-id prompts, and the asynchronous runtime's dispatch of episodes.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from rlvr.models import backbone_and_head
from rlvr.prompts import Prompt, left_pad, prompt_token_ids
from rlvr.rollout.engine import SamplingParams, generate_groups
from rlvr.rollout.groups import Groups, eos_token_ids


class Environment(Protocol):
    """One episode's environment (rlvr.envs.EpisodeEnv is one): answers a model turn (its text) with one
    observation per tool call - a string, or an object with a ``text`` - each tool given ``timeout_s``; none: the
    episode is over."""

    def step(self, text: str, timeout_s: float) -> list: ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # model turns per episode
    max_episode_tokens: int = 512  # completion tokens per episode: model turns and observations together
    tool_timeout_s: float = 10.0  # per tool call


@dataclass
class EpisodeStats:
    turns: list[int] = field(default_factory=list)  # model turns of each episode
    observation_tokens: int = 0
    model_tokens: int = 0
    env_seconds: float = 0.0
    truncated: collections.Counter = field(default_factory=collections.Counter)  # cause -> episodes

    def as_metrics(self) -> dict[str, float]:
        n = max(len(self.turns), 1)
        return {"turns_mean": sum(self.turns) / n, "turns_max": max(self.turns, default=0),
                "observation_tokens": self.observation_tokens, "model_tokens": self.model_tokens,
                "env_s": self.env_seconds, **{f"truncated/{k}": v for k, v in sorted(self.truncated.items())}}


def observation_ids(tokenizer, texts: list[str]) -> list[int]:
    """The tokens that follow a finished model turn (its end-of-turn token included) for tool results ``texts``:
    one ``tool`` turn each, then the opening of the next assistant turn - the chat template's own rendering of just
    these turns (the difference between the conversation with and without them, cut after the end of the model's
    turn), so earlier turns are never re-rendered. Without a chat template: plain ``<tool_response>`` blocks."""
    if not getattr(tokenizer, "chat_template", None):
        body = "".join(f"\n<tool_response>\n{t}\n</tool_response>" for t in texts) + "\nA:"
        return tokenizer(body, add_special_tokens=False)["input_ids"]
    head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(head, tokenize=False)
    after = tokenizer.apply_chat_template(head + [{"role": "tool", "content": t} for t in texts], tokenize=False,
                                          add_generation_prompt=True)
    end = before.rindex("a") + 1  # just after the assistant's content; the template's end-of-turn follows
    eos = tokenizer.eos_token or ""
    if eos and before[end:].startswith(eos):
        end += len(eos)  # the model sampled its end-of-turn token itself
    if not after.startswith(before[:end]):
        raise ValueError("the chat template renders earlier turns differently once a tool turn follows; rlvr "
                         "cannot append observations token-in/token-out with it")
    return tokenizer(after[end:], add_special_tokens=False)["input_ids"]


def sample_episodes(
    model: nn.Module,
    tokenizer,
    prompts: list[Prompt],
    envs: list[Environment],
    group_size: int,
    params: SamplingParams,
    generators: list[torch.Generator],
    limits: EpisodeLimits = EpisodeLimits(),
    version: int = 0,
) -> tuple[Groups, EpisodeStats]:
    """``group_size`` episodes per prompt; ``envs[i]`` and ``generators[i]`` belong to episode i (prompt
    i // group_size), so each episode's tokens depend only on its own generator and environment."""
    n = len(prompts) * group_size
    if len(envs) != n or len(generators) != n:
        raise ValueError(f"{n} episodes need {n} environments and generators, got {len(envs)} and {len(generators)}")
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]  # once per prompt, shared by its G episodes
    prompt_ids = [encoded[i // group_size] for i in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]  # completion tokens so far
    sampled: list[list[int]] = [[] for _ in range(n)]  # 1: sampled by the model
    logp: list[list[float]] = [[] for _ in range(n)]
    truncated = [False] * n
    stats = EpisodeStats(turns=[0] * n)
    active = list(range(n))
    backbone, head = backbone_and_head(model)
    eos = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        for turn in range(limits.max_turns):
            if not active:
                break
            ids, mask = left_pad([prompt_ids[i] + tokens[i] for i in active], tokenizer.pad_token_id)
            out = generate_groups(backbone, head, ids, mask, 1, params, eos, tokenizer.pad_token_id,
                                  generator=[generators[i] for i in active])
            still = []
            for row, i in enumerate(active):
                new = out.ids[row][out.mask[row].bool()].tolist()
                room = limits.max_episode_tokens - len(tokens[i])  # a turn past the episode's budget is cut there
                cut = len(new) > room
                new = new[:room]
                tokens[i] += new
                sampled[i] += [1] * len(new)
                logp[i] += out.behaviour_logp[row][: len(new)].tolist()
                stats.turns[i] += 1
                stats.model_tokens += len(new)
                if cut or bool(out.truncated[row]):
                    truncated[i] = True
                    stats.truncated["episode_tokens" if cut else "turn_tokens"] += 1
                    continue
                t0 = time.perf_counter()
                answer = envs[i].step(tokenizer.decode(new, skip_special_tokens=True), limits.tool_timeout_s)
                observations = [getattr(o, "text", o) for o in answer]
                stats.env_seconds += time.perf_counter() - t0
                if not observations:
                    continue  # no tool call: the episode is over
                obs = observation_ids(tokenizer, observations)
                if len(tokens[i]) + len(obs) >= limits.max_episode_tokens:
                    truncated[i] = True
                    stats.truncated["episode_tokens"] += 1
                    continue
                if turn + 1 == limits.max_turns:
                    truncated[i] = True
                    stats.truncated["max_turns"] += 1
                    continue
                tokens[i] += obs
                sampled[i] += [0] * len(obs)
                logp[i] += [0.0] * len(obs)
                stats.observation_tokens += len(obs)
                still.append(i)
            active = still
    finally:
        model.train(was_training)
    return _as_groups(tokenizer, encoded, group_size, tokens, sampled, logp, truncated, params, version), stats


def _as_groups(tokenizer, encoded, group_size, tokens, sampled, logp, truncated, params, version) -> Groups:
    n, width = len(tokens), max(1, max(len(t) for t in tokens))

    def right(rows: list[list], fill) -> list[list]:
        return [r + [fill] * (width - len(r)) for r in rows]

    prompt_ids, prompt_mask = left_pad(encoded, tokenizer.pad_token_id)
    return Groups(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=torch.tensor(right(tokens, tokenizer.pad_token_id), dtype=torch.long),
        completion_mask=torch.tensor(right([[1] * len(t) for t in tokens], 0), dtype=torch.long),
        behaviour_logp=torch.tensor(right(logp, 0.0), dtype=torch.float32),
        truncated=torch.tensor(truncated, dtype=torch.bool),
        texts=tokenizer.batch_decode(tokens, skip_special_tokens=True),
        group_size=group_size,
        version=torch.full((n,), version, dtype=torch.long),
        temperature=torch.full((n,), float(params.temperature)),
        sampled_mask=torch.tensor(right(sampled, 0), dtype=torch.long),
    )
