"""One round of rollouts, scored: single completions, or multi-turn episodes when the run has an environment.

``sample_scored`` is what every batch source calls (the synchronous ``collect``, the asynchronous orchestrator's
dispatchers) and ``evaluate`` reuses, so episodes run on every path without a second copy of the loop.

An episode round (``EnvironmentSetup``): each of the G episodes of a row gets its own environment instance, reset with
the row's columns; the text ``reset`` returns is added to the prompt (TRL's rule, ``prompt_with_observation``) and
the tools are described in it (the chat template's ``tools=`` when it renders them, else rlvr's default system
instruction). The G episodes of a group share that prompt, so ``reset`` must return the same text for them (seed
its randomness from the row). Reward functions then get TRL's arguments: the prompts, each episode's completion
as chat messages (assistant turns and ``tool`` results; the built-in rewards read the last assistant turn), the
row's columns and ``environments`` (one instance per completion); an environment with ``get_reward()`` adds one
more reward, named after its class, weight 1. Instances go back to the pool after scoring.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from rlvr.config.schema import EnvConfig
from rlvr.envs import calculator
from rlvr.envs.environment import (
    EnvironmentSpec,
    EpisodeEnv,
    EpisodeError,
    load_environment,
    prompt_with_observation,
)
from rlvr.envs.http_env import HttpEnvSpec
from rlvr.envs.python_tool import PythonTool
from rlvr.envs.render import template_renders_tools, tools_instruction, with_tools
from rlvr.learn.collected import Round
from rlvr.rewards import Scores, WeightedReward, as_completions, import_object, score_completions
from rlvr.rollout import Groups, Sampler, SamplingParams
from rlvr.rollout.episodes import EpisodeLimits
from rlvr.rollout.http_client import api_key_from_env
from rlvr.tasks import reward_columns

CALL_END = "</tool_call>"


class Tools:
    """The environment of a run that lists tools but no env.factory: no state, no observation."""

    def reset(self, **row) -> None:
        return None


def builtin_tool(name: str, closers: list[Callable[[], None]]):
    """A tool of env.tools: a built-in by name, or an imported 'package.module:function'; what must be closed at
    the end of the run (the python tool's sandbox) is added to ``closers``."""
    if name == "calculator":
        return calculator.calculator
    if name == "python":
        tool = PythonTool()
        closers.append(tool.close)
        return tool.python
    return import_object(name, "env.tools")


@dataclass
class EnvironmentSetup:
    """What a run's episodes need: the validated environment, the limits, and how prompts are rendered."""

    spec: EnvironmentSpec | HttpEnvSpec
    limits: EpisodeLimits
    tokenizer: object
    template_tools: bool  # the chat template renders tools= itself
    stop_after_call: bool
    closers: tuple[Callable[[], None], ...] = ()  # run at the end of the run: sandboxes, the async tools' loop
    max_prompt_tokens: int = 0  # the room a prompt with its reset text may take (0: unchecked); set by load_data

    def close(self) -> None:
        """Release what the run's tools hold (the python tool's sandbox, the event loop of async tools)."""
        for close in self.closers:
            close()

    def params(self, params: SamplingParams) -> SamplingParams:
        """The sampling parameters of a model turn: a turn ends at ``</tool_call>`` when stop_after_call."""
        if not self.stop_after_call or not self.spec.tool_names or CALL_END in params.stop:
            return params
        return replace(params, stop=(*params.stop, CALL_END))

    def prompt_ids(self, prompt) -> list[int]:
        """The prompt's token ids with the tools described (see the module docstring)."""
        schemas = self.spec.schemas()
        if isinstance(prompt, str):
            return self.tokenizer(f"{tools_instruction(schemas)}\n\n{prompt}")["input_ids"]
        messages, tools = with_tools(prompt, schemas, self.template_tools)
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def start(self, rows: list[dict], group_size: int) -> tuple[list[EpisodeEnv], list[list[int]]]:
        """A reset environment per episode (``group_size`` per row) and each row's prompt ids. On an error every
        environment taken is handed back."""
        envs: list[EpisodeEnv] = []
        prompt_ids = []
        try:
            for row in rows:
                group = [self.spec.episode() for _ in range(group_size)]
                envs += group
                seen = [env.reset(row) for env in group]
                if any(s != seen[0] for s in seen):
                    raise EpisodeError(f"{self.spec.name}.reset returned different text for the {group_size} "
                                       "episodes of one row; they share one prompt: make reset's result depend on "
                                       "the row only")
                prompt_ids.append(self._fitting_prompt(row, seen[0]))
        except BaseException:
            for env in envs:
                env.release()
            raise
        return envs, prompt_ids

    def _fitting_prompt(self, row: dict, observation) -> list[int]:
        """The row's prompt ids with reset's observation, refused when they leave too little room (the prompt-length
        check before the run cannot see reset's text)."""
        ids = self.prompt_ids(prompt_with_observation(row["prompt"], observation))
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            raise EpisodeError(f"{self.spec.name}.reset's text makes a prompt of {len(ids)} tokens, more than the "
                               f"{self.max_prompt_tokens} the model's context leaves after env.max_episode_tokens: "
                               "return a shorter observation from reset, or lower env.max_episode_tokens")
        return ids

    def check_environment(self, row: dict) -> object:
        """A reset instance for ``check_rewards`` (released at once: only its type matters there); its prompt with
        reset's text must fit, as every episode's must."""
        env = self.spec.episode()
        try:
            self._fitting_prompt(row, env.reset(row))
            return env.instance
        finally:
            env.release()


@dataclass(frozen=True)
class EnvironmentObjects:
    """An environment given as Python objects (rlvr.api: TRL's ``environment_factory`` and ``tools``), used instead
    of the names in env.factory / env.tools."""

    factory: Callable | None = None
    tools: tuple[Callable, ...] = ()


def build_environment_setup(cfg: EnvConfig, tokenizer, columns: list[str] | None = None,
                        objects: EnvironmentObjects | None = None) -> EnvironmentSetup | None:
    """The run's ``EnvironmentSetup`` (None without env.factory, env.tools or env.url); the environment is validated
    here, once, before the model loads. ``objects``: the factory and tools as objects instead of by name."""
    if not cfg.enabled and objects is None:
        return None
    closers: list[Callable[[], None]] = []
    if cfg.url:
        if cfg.factory or cfg.tools:
            raise EpisodeError("env.url is an environment of its own: leave env.factory and env.tools empty with it")
        spec = HttpEnvSpec(cfg.url, transport=cfg.transport, api_key=api_key_from_env(cfg.api_key_env),
                           timeout_s=max(cfg.tool_timeout_s, 30.0))
    elif objects is not None:
        spec = load_environment(objects.factory or Tools, list(objects.tools), columns)
    else:
        factory = import_object(cfg.factory, "env.factory") if cfg.factory else Tools
        tools = [builtin_tool(t, closers) for t in cfg.tools]
        try:
            spec = load_environment(factory, tools, columns)
        except BaseException:
            for close in closers:
                close()
            raise
        if not spec.tool_names:
            raise EpisodeError(f"environment {spec.name} has no tools: give it public methods or set env.tools")
    limits = EpisodeLimits(cfg.max_turns, cfg.max_episode_tokens, cfg.tool_timeout_s)
    if isinstance(spec, EnvironmentSpec):
        closers.append(spec.close)
    return EnvironmentSetup(spec, limits, tokenizer, template_renders_tools(tokenizer), cfg.stop_after_call,
                        tuple(closers))


def episode_completions(prompts: list, messages: list[list[dict]]) -> list:
    """TRL's completions of episodes: chat messages for chat prompts, the final turn's text for text prompts."""
    return [m if not isinstance(p, str) else (m[-1]["content"] if m else "") for p, m in zip(prompts, messages)]


def score_groups(rewards: list[WeightedReward], groups: Groups, rows: list[dict], completions: list | None = None,
                 extra: dict[str, list] | None = None) -> Scores:
    """Every reward function once over the groups' completions; ``rows[i]`` is group i's dataset row."""
    G = groups.group_size
    prompts = [r["prompt"] for r in rows for _ in range(G)]
    columns = {**reward_columns(rows, G), "completion_ids": groups.completion_token_ids(), **(extra or {})}
    completions = as_completions(prompts, groups.texts) if completions is None else completions
    return score_completions(rewards, prompts, completions, columns, G)


def sample_scored(sampler: Sampler, rows: list[dict], group_size: int, params: SamplingParams, seed: int,
                  rewards: list[WeightedReward], setup: EnvironmentSetup | None = None,
                  score_lock: threading.Lock | None = None, row_ids: list[int] | None = None, first: int = 0) -> Round:
    """G completions (or episodes) per row from ``sampler``, scored by ``rewards`` (holding ``score_lock``, when
    given, while the reward functions run: the asynchronous dispatchers call them one batch at a time), as a
    ``Round`` of the dataset rows ``row_ids`` (default: the positions of ``rows``). ``first``: the position of
    ``rows[0]`` in the step's batch (a learner's share of it under torchrun; rlvr.rollout.Sampler.sample)."""
    where = {"first": first} if first else {}  # samplers written before ``first`` existed are still called
    row_ids = list(range(len(rows))) if row_ids is None else row_ids
    lock = score_lock or contextlib.nullcontext()
    t0 = time.perf_counter()
    if setup is None:
        groups = sampler.sample([r["prompt"] for r in rows], group_size, params, seed, **where)
        t1 = time.perf_counter()
        with lock:
            t2 = time.perf_counter()
            scores = score_groups(rewards, groups, rows)
            return Round(row_ids, groups, scores, None, t1 - t0, time.perf_counter() - t2)
    envs, prompt_ids = setup.start(rows, group_size)
    try:
        out = sampler.sample_episodes(prompt_ids, envs, group_size, setup.params(params), seed, setup.limits, **where)
        t1 = time.perf_counter()
        prompts = [r["prompt"] for r in rows for _ in range(group_size)]
        if setup.spec.has_reward:
            rewards = [*rewards, WeightedReward(setup.spec.name, lambda **_: [env.reward() for env in envs])]
        with lock:
            t2 = time.perf_counter()
            scores = score_groups(rewards, out.groups, rows, episode_completions(prompts, out.messages),
                                  {"environments": [env.instance for env in envs]})
            t3 = time.perf_counter()
    finally:
        for env in envs:
            env.release()
    return Round(row_ids, out.groups, scores, out.stats, t1 - t0, t3 - t2)
