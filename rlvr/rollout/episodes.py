"""Multi-turn episodes: the model writes a turn, the environment answers its tool calls, the model goes on - one
token stream per episode, returned as ``Groups`` like single-turn completions.

The turns are driven here, for every rollout path; only the sampling of one model turn differs: ``local_turns``
samples in this process, ``rlvr.rollout.remote_sampler.RemoteSampler`` sends token-id prompts to ``/v1/completions``
(``rlvr serve`` or vLLM), so servers stay stateless and need nothing new.

Token in, token out: the tokens the model sampled are kept exactly as sampled, and each observation is appended
as the tokens of a new turn only (``observation_ids``), so the history is never re-rendered through the chat
template (a template that rewrites earlier turns - Qwen3 drops past <think> - cannot change what the trainer
scores). Observation tokens are attended to but not trained on: ``Groups.sampled_mask`` is 1 on sampled tokens
only, and their behaviour log-prob is 0. A turn that stopped at a stop string (``</tool_call>``) rather than at
its end-of-turn token gets the template's end-of-turn as the first observation tokens.

An episode ends when a turn has no tool call, or at a limit: ``max_turns`` model turns, ``max_episode_tokens``
completion tokens (turns and observations together), or a turn cut at ``max_new_tokens`` without ending; each
limit that ends an episode is counted (``EpisodeStats.truncated``) and marks the episode truncated.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from rlvr.envs.tools import ToolStats
from rlvr.models.prompts import left_pad
from rlvr.rollout.engine import SampledTokens, SamplingParams, generate_groups
from rlvr.rollout.groups import Groups, stop_string_checker
from rlvr.rollout.turn_cache import TurnCache


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
class Turn:
    """One sampled model turn."""

    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each token
    truncated: bool  # cut at max_new_tokens, without an end-of-turn token or a stop string


TurnSampler = Callable[[list[list[int]], list[int]], list[Turn]]
"""(the token ids so far of each active episode - prompt, then completion -, their episode indices) -> the next
model turn of each. Episode i's turn must depend only on its own context and randomness (seeded per episode)."""


@dataclass
class EpisodeStats:
    turns: list[int] = field(default_factory=list)  # model turns of each episode
    observation_tokens: int = 0
    model_tokens: int = 0
    env_seconds: float = 0.0
    truncated: collections.Counter = field(default_factory=collections.Counter)  # cause -> episodes
    tools: ToolStats = field(default_factory=ToolStats)  # calls and errors per tool (merged by the caller)
    calling: int = 0  # episodes with at least one tool call

    @classmethod
    def total(cls, parts: list[EpisodeStats | None]) -> EpisodeStats | None:
        """The stats of several rounds or groups together (None when none has any: single completions)."""
        present = [p for p in parts if p is not None]
        if not present:
            return None
        total = cls()
        for p in present:
            total.merge(p)
        return total

    def merge(self, other: EpisodeStats) -> None:
        self.turns += other.turns
        self.observation_tokens += other.observation_tokens
        self.model_tokens += other.model_tokens
        self.env_seconds += other.env_seconds
        self.truncated.update(other.truncated)
        self.tools.merge(other.tools)
        self.calling += other.calling

    def as_metrics(self) -> dict[str, float]:
        n = max(len(self.turns), 1)
        tools = self.tools.as_metrics()
        return {"turns_mean": sum(self.turns) / n, "turns_max": max(self.turns, default=0),
                "tool_call_rate": tools["calls/_all"] / n, "tool_use_frac": self.calling / n,
                "observation_tokens": self.observation_tokens, "model_tokens": self.model_tokens,
                "env_s": self.env_seconds,
                **{f"truncated/{k}": self.truncated.get(k, 0) for k in TRUNCATION_CAUSES}, **tools}


TRUNCATION_CAUSES = ("max_turns", "episode_tokens", "turn_tokens")


@dataclass
class EpisodeBatch:
    """G episodes per prompt: the token streams, what happened, and each episode's turns as chat messages
    (``assistant`` turns and ``tool`` results, for reward functions: TRL passes multi-turn completions so)."""

    groups: Groups
    stats: EpisodeStats
    messages: list[list[dict]]  # [B*G] the completion of each episode as messages


def observation_ids(tokenizer, texts: list[str], turn_closed: bool = True) -> list[int]:
    """The tokens that follow a model turn for tool results ``texts``: one ``tool`` turn each, then the opening of
    the next assistant turn - the chat template's own rendering of just these turns (the difference between the
    conversation with and without them), so earlier turns are never re-rendered. ``turn_closed``: the model
    sampled its end-of-turn token itself; else (a turn stopped at a stop string) the observation starts with the
    template's end-of-turn. Without a chat template: plain ``<tool_response>`` blocks."""
    if not getattr(tokenizer, "chat_template", None):
        body = "".join(f"\n<tool_response>\n{t}\n</tool_response>" for t in texts) + "\nA:"
        return tokenizer(body, add_special_tokens=False)["input_ids"]
    head = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = tokenizer.apply_chat_template(head, tokenize=False)
    after = tokenizer.apply_chat_template(head + [{"role": "tool", "content": t} for t in texts], tokenize=False,
                                          add_generation_prompt=True)
    end = before.rindex("a") + 1  # just after the assistant's content; the template's end-of-turn follows
    eos = tokenizer.eos_token or ""
    if turn_closed and eos and before[end:].startswith(eos):
        end += len(eos)  # the model sampled its end-of-turn token itself
    if not after.startswith(before[:end]):
        raise ValueError("the chat template renders earlier turns differently once a tool turn follows; rlvr "
                         "cannot append observations token-in/token-out with it")
    return tokenizer(after[end:], add_special_tokens=False)["input_ids"]


def local_turns(decoder: tuple[nn.Module, Callable], tokenizer, eos: list[int], params: SamplingParams,
                generators: list[torch.Generator], keep_cache: bool = True) -> TurnSampler:
    """Model turns sampled in this process from ``decoder`` (backbone, head: rlvr.rollout.decode_weights.decoding,
    entered for the whole episode run); ``generators[i]`` is episode i's randomness. ``keep_cache``: each episode's
    keys and values carried to its next turn (rlvr.rollout.turn_cache); false: every turn prefills the whole
    context again (the reference the cache is tested against)."""
    backbone, head = decoder
    pad = tokenizer.pad_token_id
    stop = stop_string_checker(tokenizer, params.stop)
    device = next(backbone.parameters()).device

    def prefilled(contexts: list[list[int]], episodes: list[int]) -> SampledTokens:
        ids, mask = left_pad(contexts, pad)  # [n, P] on the CPU
        return generate_groups(backbone, head, ids.to(device), mask.to(device), 1, params, eos, pad,
                               generator=[generators[i] for i in episodes], stop=stop)

    sample = TurnCache(backbone, head, params, eos, pad, generators, stop) if keep_cache else prefilled

    def turns(contexts: list[list[int]], episodes: list[int]) -> list[Turn]:
        out = sample(contexts, episodes)
        ids, mask, logp, truncated = out.ids.tolist(), out.mask.sum(-1).tolist(), out.behaviour_logp.tolist(), \
            out.truncated.tolist()  # one crossing to the host per turn
        return [Turn(ids[row][:n], logp[row][:n], truncated[row]) for row, n in enumerate(mask)]

    return turns


def run_episodes(
    turns: TurnSampler,
    tokenizer,
    prompt_ids: list[list[int]],
    envs: list[Environment],
    group_size: int,
    params: SamplingParams,
    limits: EpisodeLimits,
    eos_ids: list[int],
    version: int = 0,
) -> EpisodeBatch:
    """``group_size`` episodes per prompt (``prompt_ids``: one token list per prompt); ``envs[i]`` belongs to
    episode i (prompt i // group_size)."""
    n = len(prompt_ids) * group_size
    if len(envs) != n:
        raise ValueError(f"{n} episodes need {n} environments, got {len(envs)}")
    eos = set(eos_ids)
    tokens: list[list[int]] = [[] for _ in range(n)]  # completion tokens so far
    sampled: list[list[int]] = [[] for _ in range(n)]  # 1: sampled by the model
    logp: list[list[float]] = [[] for _ in range(n)]
    messages: list[list[dict]] = [[] for _ in range(n)]
    truncated = [False] * n
    called = [False] * n  # the episode made a tool call
    stats = EpisodeStats(turns=[0] * n)
    active = list(range(n))
    for turn in range(limits.max_turns):
        if not active:
            break
        made = turns([prompt_ids[i // group_size] + tokens[i] for i in active], active)
        still = []
        for i, t in zip(active, made):
            room = limits.max_episode_tokens - len(tokens[i])  # a turn past the episode's budget is cut there
            cut = len(t.token_ids) > room
            new = t.token_ids[:room]
            tokens[i] += new
            sampled[i] += [1] * len(new)
            logp[i] += t.logprobs[: len(new)]
            stats.turns[i] += 1
            stats.model_tokens += len(new)
            text = tokenizer.decode(new, skip_special_tokens=True)
            messages[i].append({"role": "assistant", "content": text})
            if cut or t.truncated:
                truncated[i] = True
                stats.truncated["episode_tokens" if cut else "turn_tokens"] += 1
                continue
            t0 = time.perf_counter()
            answer = envs[i].step(text, limits.tool_timeout_s)
            stats.env_seconds += time.perf_counter() - t0
            observations = [getattr(o, "text", o) for o in answer]
            if not observations:
                continue  # no tool call: the episode is over
            if not called[i]:
                called[i] = True
                stats.calling += 1
            if turn + 1 == limits.max_turns:
                truncated[i] = True
                stats.truncated["max_turns"] += 1
                continue
            obs = observation_ids(tokenizer, observations, turn_closed=bool(new) and new[-1] in eos)
            if len(tokens[i]) + len(obs) >= limits.max_episode_tokens:
                truncated[i] = True
                stats.truncated["episode_tokens"] += 1
                continue
            tokens[i] += obs
            sampled[i] += [0] * len(obs)
            logp[i] += [0.0] * len(obs)
            messages[i] += [{"role": "tool", "content": o} for o in observations]
            stats.observation_tokens += len(obs)
            still.append(i)
        active = still
    for env in envs:
        if getattr(env, "stats", None) is not None:
            stats.tools.merge(env.stats)
    groups = _as_groups(tokenizer, prompt_ids, group_size, tokens, sampled, logp, truncated, params, version)
    return EpisodeBatch(groups, stats, messages)


def _as_groups(tokenizer, encoded, group_size, tokens, sampled, logp, truncated, params, version) -> Groups:
    n, width = len(tokens), max(1, max(len(t) for t in tokens))

    def right(rows: list[list], fill) -> list[list]:
        return [r + [fill] * (width - len(r)) for r in rows]

    prompt_ids, prompt_mask = left_pad(encoded, tokenizer.pad_token_id)
    return Groups(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=torch.tensor(right(tokens, tokenizer.pad_token_id), dtype=torch.long, device="cpu"),
        completion_mask=torch.tensor(right([[1] * len(t) for t in tokens], 0), dtype=torch.long, device="cpu"),
        behaviour_logp=torch.tensor(right(logp, 0.0), dtype=torch.float32, device="cpu"),
        truncated=torch.tensor(truncated, dtype=torch.bool, device="cpu"),
        texts=tokenizer.batch_decode(tokens, skip_special_tokens=True),
        group_size=group_size,
        version=torch.full((n,), version, dtype=torch.long, device="cpu"),
        temperature=torch.full((n,), float(params.temperature), device="cpu"),
        sampled_mask=torch.tensor(right(sampled, 0), dtype=torch.long, device="cpu"),
    )
