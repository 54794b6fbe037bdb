"""TRL-style environments, unchanged: one instance per episode, its public methods as tools.

The shape is TRL's ``environment_factory`` (GRPOTrainer; read from TRL's main branch, commit f2cd577 of July
2026: ``trl/trainer/grpo_trainer.py`` and the "Agent Training" section of ``docs/source/grpo_trainer.md``),
which users have already written:

- ``factory()`` (usually the class itself) makes an environment; every episode running at the same time has
  its own instance.
- ``reset(**row)`` (required) starts an episode. It receives every column of the dataset row as a keyword
  argument - ``prompt`` included, as TRL's code passes it (its docs say "the other columns") - so it must
  accept ``**kwargs`` unless it names every column. It returns ``None`` or a string; TRL appends the string
  to the content of the last user message, with no separator (``prompt_with_observation``). The episode
  sampler must put it there: TRL's async trainer dropped it (TRL #6067).
- Tools: every bound method whose name does not start with ``_`` and is not ``reset`` or ``get_reward``
  (``inspect.getmembers(instance, inspect.ismethod)`` in TRL), named by the method's ``__name__``. A public
  helper such as ``close`` is therefore a tool too: rename it ``_close``. Static methods are not tools
  (they are not bound methods); class methods are. Each schema comes from the type hints and Google-style
  docstring (``tool_schema``), so a method without them is refused before the run, in one line naming the
  class and the method. Async methods are tools as in TRL: they run on one event loop per environment
  spec, in a daemon thread.
- ``get_reward()`` (optional, sync or async, no arguments) scores the finished episode from the
  environment's state; TRL adds it as one more reward function (weight 1, named after the class). Here
  ``EpisodeEnv.reward`` returns it, checked like any reward value: a finite real number or None.
- Reward functions keep TRL's signature and may receive ``environments`` (one instance per completion):
  ``EpisodeEnv.instance`` is what to pass.
- There is no "done" signal in TRL's interface: an episode ends when a model turn has no tool call (here
  ``EpisodeEnv.done``), or at the sampler's limits (TRL: ``max_tool_calling_iterations``, the length).

Instances are reused as TRL reuses them ("construct once, reset often": an environment may load a corpus in
``__init__``): ``EnvironmentSpec.episode()`` takes an idle instance or makes one, ``EpisodeEnv.release()``
hands it back - after the rewards are computed, since reward functions may read it. An instance whose tool
timed out is never reused (the abandoned call may still be changing it).

Where rlvr departs from TRL: tool calls use rlvr's parsing and running (``tools.py``): malformed calls,
unknown tools, bad arguments, exceptions and timeouts are observations the model reads and are counted,
never a crashed run; TRL sends ``{'error': ...}`` for an exception and has no per-call timeout. Results are
rendered by ``tools._as_text`` (JSON for numbers, lists, dicts, None: ``null`` where TRL's ``str`` gives
``None``). TRL's multimodal tool results and reset observations (lists of content blocks) are not supported;
an async ``reset`` is refused as TRL cannot await it either. A ``dict`` of factories (TRL's multi-environment
mode) is not here yet.

Environments served over HTTP in the OpenEnv style are ``http_env``'s; the turns are driven by
``rlvr.rollout.episodes.run_episodes``.

NOT protected: the environment is the user's own Python and runs in the trainer's process with its
permissions; a tool that times out is abandoned in a daemon thread (``tools.run_tool_call``).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import numbers
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlvr.envs.tools import (
    MAX_RESULT_CHARS,
    Observation,
    ToolSchemaError,
    ToolStats,
    parse_tool_calls,
    run_tool_call,
    tool_schema,
)
from rlvr.platform.numbers import finite_float32

RESERVED = ("reset", "get_reward")


class EnvironmentSpecError(ValueError):
    """An environment that cannot run: one line naming the class (and method) and what to change."""


class EpisodeError(RuntimeError):
    """The environment's own code failed in ``reset`` or ``get_reward``, or returned something unusable."""


def _first_line(err: BaseException, limit: int = 300) -> str:
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[:limit] + "..."


def _why(err: BaseException) -> str:
    message = _first_line(err)
    return type(err).__name__ + (f": {message}" if message else "")


def environment_methods(instance: object) -> list[Callable]:
    """The environment's tools by TRL's rule: bound methods not starting with ``_`` and not reserved, in name
    order. Properties are not evaluated (``inspect.getmembers`` would run them)."""
    methods = []
    for name in sorted(dir(instance)):
        if name.startswith("_") or name in RESERVED:
            continue
        if isinstance(inspect.getattr_static(instance, name, None), property):
            continue
        try:
            value = getattr(instance, name)
        except AttributeError:
            continue
        if inspect.ismethod(value):
            methods.append(value)
    return methods


class EnvironmentSpec:
    """A validated environment factory plus extra standalone tools (e.g. the built-in ``python``); makes
    the per-episode environments. Build it with ``load_environment``."""

    def __init__(self, factory: Callable[[], object], name: str, tool_names: tuple[str, ...],
                 extra_tools: dict[str, Callable], schemas: list[dict], has_reward: bool) -> None:
        self.factory = factory
        self.name = name  # the environment's class name
        self.tool_names = tool_names  # every tool: the standalone ones first, then the environment's methods
        self.extra_tools = extra_tools
        self._schemas = schemas
        self.has_reward = has_reward
        self._idle: list[object] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def schemas(self) -> list[dict]:
        """The tools' JSON schemas in ``tool_names`` order (as ``apply_chat_template(tools=...)`` takes them)."""
        return copy.deepcopy(self._schemas)

    def episode(self) -> EpisodeEnv:
        """An environment for one episode: an idle instance, else a new one from the factory."""
        with self._lock:
            instance = self._idle.pop() if self._idle else None
        if instance is None:
            instance = _make(self.factory, self.name)
        return EpisodeEnv(self, instance)

    def _release(self, instance: object) -> None:
        with self._lock:
            self._idle.append(instance)

    def run_coroutine(self, coroutine: Any) -> Any:
        """Run an async tool's or ``get_reward``'s coroutine on this spec's event loop (a daemon thread)
        and wait for its result."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, daemon=True, name="rlvr-env-async").start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

    def close(self) -> None:
        """Stop the event loop of async tools (if one started) and drop idle instances."""
        with self._lock:
            loop, self._loop = self._loop, None
            self._idle.clear()
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)


def _make(factory: Callable[[], object], name: str) -> object:
    try:
        return factory()
    except Exception as err:  # noqa: BLE001 (the user's constructor: say which one failed)
        raise EnvironmentSpecError(f"environment {name}: the factory raised {_why(err)}") from None


def _factory_name(factory: Any) -> str:
    return getattr(factory, "__qualname__", None) or type(factory).__name__


def load_environment(factory: Callable[[], object], tools: tuple[Callable, ...] | list[Callable] = (),
                     columns: tuple[str, ...] | list[str] | None = None) -> EnvironmentSpec:
    """Validate a TRL-style environment factory once, before a run (see the module docstring): make one
    instance, check ``reset`` (callable; with ``columns``, able to take those columns as keyword arguments),
    ``get_reward`` (callable with no arguments, when present), and build every tool's schema - the
    environment's methods and the standalone ``tools``. Each problem is an ``EnvironmentSpecError`` of one
    line naming the class and the method."""
    if not callable(factory):
        raise EnvironmentSpecError(f"environment factory {factory!r} is not callable; pass the environment class "
                                   "(or a function returning an instance)")
    instance = _make(factory, _factory_name(factory))
    name = type(instance).__name__
    reset = getattr(instance, "reset", None)
    if not callable(reset):
        raise EnvironmentSpecError(f"environment {name} has no callable reset; add reset(self, **kwargs) that "
                                   "starts an episode and returns None or text to add to the prompt")
    if inspect.iscoroutinefunction(reset):
        raise EnvironmentSpecError(f"{name}.reset is async; make it a plain method (TRL calls it without await)")
    if columns is not None:
        try:
            inspect.signature(reset).bind(**dict.fromkeys(columns))
        except TypeError as err:
            raise EnvironmentSpecError(
                f"{name}.reset cannot take the row's columns ({', '.join(columns)}): {err}; reset receives every "
                "column as a keyword argument, prompt included: add **kwargs") from None
        except ValueError:
            pass  # no signature to check (a builtin): the call itself will say
    get_reward = getattr(instance, "get_reward", None)
    has_reward = get_reward is not None
    if has_reward:
        if not callable(get_reward):
            raise EnvironmentSpecError(f"{name}.get_reward is not callable; define get_reward(self) -> float")
        try:
            inspect.signature(get_reward).bind()
        except TypeError:
            raise EnvironmentSpecError(f"{name}.get_reward must take no arguments (it is called as "
                                       "get_reward() once the episode ends)") from None
        except ValueError:
            pass
    callables: dict[str, Callable] = {}
    extra: dict[str, Callable] = {}
    schemas = []
    for fn, owner in [(t, None) for t in tools] + [(m, name) for m in environment_methods(instance)]:
        tool = getattr(fn, "__name__", None)
        where = f"{owner}.{tool}" if owner else f"tool {tool or repr(fn)}"
        if not callable(fn) or not tool:
            raise EnvironmentSpecError(f"{where}: not a function; pass functions or bound methods as tools")
        if tool in callables:
            if getattr(callables[tool], "__func__", callables[tool]) is getattr(fn, "__func__", fn):
                continue  # the same method under two attribute names
            raise EnvironmentSpecError(f"{where}: two tools are named {tool!r}; rename one (tool names must be "
                                       "unique, and public methods of an environment are tools)")
        try:
            schema = tool_schema(fn)
        except ToolSchemaError as err:
            detail = str(err).removeprefix(f"tool {tool}: ")
            hint = f" (public methods of {owner} are tools: rename it _{tool} if it is not one)" if owner else ""
            raise EnvironmentSpecError(f"{where}: {detail}{hint}") from None
        callables[tool] = fn
        schemas.append(schema)
        if owner is None:
            extra[tool] = fn
    spec = EnvironmentSpec(factory, name, tuple(callables), extra, schemas, has_reward)
    spec._release(instance)  # the probe serves the first episode, as in TRL
    return spec


def prompt_with_observation(prompt: str | list[dict], observation: str | None) -> str | list[dict]:
    """The prompt with ``reset``'s observation appended as TRL does: to the content of the last message of a
    chat prompt (a new list; the row is not mutated), or to a plain-text prompt, with no separator. An empty
    chat prompt becomes one user message holding the observation (an environment that owns its data)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + observation
    if not prompt:
        return [{"role": "user", "content": observation}]
    last = prompt[-1]
    if not isinstance(last.get("content"), str):
        raise EpisodeError("cannot add the environment's observation to a message whose content is not text")
    return [*prompt[:-1], {**last, "content": last["content"] + observation}]


class EpisodeEnv:
    """One environment instance for one episode: ``reset`` once, ``step`` per model turn, ``reward`` at the
    end, ``release`` after the rewards are computed. Not for use from two threads at once."""

    def __init__(self, spec: EnvironmentSpec, instance: object) -> None:
        self.spec = spec
        self.instance = instance  # what TRL passes to reward functions as one of ``environments``
        self.stats = ToolStats()  # this episode's calls; the sampler merges them
        self.turns = 0  # model turns stepped
        self.seconds = 0.0  # spent in reset, tools and get_reward
        self.observation: str | None = None  # what reset returned
        self.done = False  # a model turn without a tool call ended the episode
        self._started = False
        self._abandoned = False  # a tool timed out: its thread may still be changing the instance
        self._released = False
        self._tools = self._bind()

    def _bind(self) -> dict[str, Callable]:
        methods = {m.__name__: m for m in environment_methods(self.instance)}
        tools = {}
        for tool in self.spec.tool_names:
            fn = self.spec.extra_tools.get(tool) or methods.get(tool)
            if fn is None:
                raise EpisodeError(f"{self.spec.name} instance has no method {tool!r}, which the first instance "
                                   "had; every instance must have the same tools")
            tools[tool] = self._sync(fn) if inspect.iscoroutinefunction(fn) else fn
        return tools

    def _sync(self, method: Callable) -> Callable:
        """A plain callable running an async tool on the spec's loop; keeps the signature for argument checks."""
        spec = self.spec

        def call(*args: Any, **kwargs: Any) -> Any:
            return spec.run_coroutine(method(*args, **kwargs))

        try:
            call.__signature__ = inspect.signature(method, eval_str=True)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 (an annotation that does not evaluate: keep it as written)
            call.__signature__ = inspect.signature(method)  # type: ignore[attr-defined]
        call.__name__ = method.__name__
        return call

    def tools(self) -> dict[str, Callable]:
        """Tool name -> callable for ``run_tool_call`` (async methods wrapped to run on the spec's loop)."""
        return dict(self._tools)

    def schemas(self) -> list[dict]:
        return self.spec.schemas()

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Start the episode: ``instance.reset(**row)`` with every column of the row. Returns the observation
        text the sampler must add to the prompt (``prompt_with_observation``), or None."""
        if self._started:
            raise EpisodeError(f"{self.spec.name}: reset called twice for one episode; take a new episode")
        self._started = True
        start = time.perf_counter()
        try:
            observation = self.instance.reset(**row)
        except Exception as err:  # noqa: BLE001 (the user's environment: name it)
            raise EpisodeError(f"{self.spec.name}.reset raised {_why(err)}") from None
        finally:
            self.seconds += time.perf_counter() - start
        if observation is not None and not isinstance(observation, str):
            raise EpisodeError(f"{self.spec.name}.reset returned {type(observation).__name__}; return None or a "
                               "string (text added to the prompt)")
        self.observation = observation
        return observation

    def step(self, text: str, timeout_s: float, max_chars: int = MAX_RESULT_CHARS) -> list[Observation]:
        """Run the tool calls of one model turn, in order, each with ``timeout_s``; one observation per call.
        A turn without any ``<tool_call>`` ends the episode (``done``) and returns []."""
        if not self._started:
            raise EpisodeError(f"{self.spec.name}: step before reset")
        if self.done:
            raise EpisodeError(f"{self.spec.name}: step after the episode ended (a turn without a tool call)")
        self.turns += 1
        calls = parse_tool_calls(text)
        if not calls:
            self.done = True
            return []
        observations = []
        for call in calls:
            obs = run_tool_call(call, self._tools, timeout_s, max_chars)
            self.stats.record(obs)
            self.seconds += obs.seconds
            self._abandoned |= obs.kind == "timeout"
            observations.append(obs)
        return observations

    def reward(self) -> float | None:
        """``get_reward()`` when the environment has one, checked: a finite real number, or None."""
        if not self.spec.has_reward:
            return None
        start = time.perf_counter()
        try:
            value = self.instance.get_reward()
            if inspect.isawaitable(value):
                value = self.spec.run_coroutine(value)
        except Exception as err:  # noqa: BLE001
            raise EpisodeError(f"{self.spec.name}.get_reward raised {_why(err)}") from None
        finally:
            self.seconds += time.perf_counter() - start
        if value is None:
            return None
        if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
            try:
                value = value.item()  # a one-element tensor or array
            except (TypeError, ValueError, RuntimeError):
                pass
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise EpisodeError(f"{self.spec.name}.get_reward returned {type(value).__name__}; return a float "
                               "(or None when the episode has no reward)")
        finite = finite_float32(value)  # 1e300: inf in the float32 rewards; 10**400: no float at all
        if finite is None:
            raise EpisodeError(f"{self.spec.name}.get_reward returned {str(value)[:40]}; rewards must be finite "
                               "(return None when the episode has no reward)")
        return finite

    def release(self) -> None:
        """Hand the instance back for another episode (call after the rewards are computed). An instance whose
        tool timed out is dropped instead. Idempotent."""
        if self._released:
            return
        self._released = True
        if not self._abandoned:
            self.spec._release(self.instance)
