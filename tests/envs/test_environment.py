"""TRL-style environments: a counter environment written the way TRL's docs write one, driven by hand-written
model turns (a scripted model). Pure Python: no model, no sandbox. Expected values are written out by hand."""

from __future__ import annotations

import asyncio
import threading
from fractions import Fraction

import pytest

from rlvr.envs.calculator import calculator
from rlvr.envs.environment import (
    EnvironmentSpecError,
    EpisodeError,
    environment_methods,
    load_environment,
    prompt_with_observation,
)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


class CounterEnv:
    """Reach the row's target by adding to a counter (TRL's IncrementEnv, with two tools)."""

    def reset(self, **kwargs) -> str | None:
        self.counter = kwargs.get("start", 0)
        self.target = kwargs["target"]
        return f" The counter starts at {self.counter}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def add(self, n: int) -> int:
        """Add n to the counter.

        Args:
            n: How much to add.
        """
        self.counter += n
        return self.counter

    def total(self) -> int:
        """The counter's value."""
        return self.counter

    def _helper(self):  # private: not a tool, needs no docstring
        return None

    @staticmethod
    def describe():  # not a bound method: not a tool (as in TRL)
        return "counter"

    @property
    def broken(self):  # never evaluated while looking for tools
        raise RuntimeError("a property was evaluated")


ROW = {"prompt": [{"role": "user", "content": "Make the counter 8."}], "start": 3, "target": 8}

ADD_SCHEMA = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add n to the counter.",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "description": "How much to add."}},
            "required": ["n"],
        },
        "return": {"type": "integer"},
    },
}
TOTAL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "total",
        "description": "The counter's value.",
        "parameters": {"type": "object", "properties": {}},
        "return": {"type": "integer"},
    },
}


def test_tools_are_public_bound_methods_except_reset_and_get_reward():
    env = CounterEnv()
    assert [m.__name__ for m in environment_methods(env)] == ["add", "total"]
    spec = load_environment(CounterEnv, columns=list(ROW))
    assert spec.name == "CounterEnv"
    assert spec.tool_names == ("add", "total")
    assert spec.schemas() == [ADD_SCHEMA, TOTAL_SCHEMA]
    assert spec.has_reward


def test_a_scripted_model_drives_an_episode():
    spec = load_environment(CounterEnv)
    env = spec.episode()
    assert env.reset(ROW) == " The counter starts at 3."
    assert prompt_with_observation(ROW["prompt"], env.observation) == [
        {"role": "user", "content": "Make the counter 8. The counter starts at 3."}]
    assert ROW["prompt"][0]["content"] == "Make the counter 8."  # the row is not mutated
    assert sorted(env.tools()) == ["add", "total"]
    assert env.schemas() == [ADD_SCHEMA, TOTAL_SCHEMA]

    # Turn 1: two calls; 3 + 4 = 7, then read it back.
    obs = env.step("I will add 4. " + call("add", '{"n": 4}') + call("total", "{}"), timeout_s=5)
    assert [(o.tool, o.kind, o.text) for o in obs] == [("add", "ok", "7"), ("total", "ok", "7")]
    assert not env.done
    # Turn 2: a wrong argument name, an unknown tool, a malformed call: observations, not crashes.
    obs = env.step(call("add", '{"m": 1}') + call("mul", '{"n": 2}') + "<tool_call>{oops}</tool_call>", timeout_s=5)
    assert [(o.tool, o.kind) for o in obs] == [("add", "bad_arguments"), (None, "unknown_tool"),
                                                (None, "malformed")]
    assert obs[0].text == "error: bad arguments for add: missing a required argument: 'n'; expected add(n: int)"
    assert obs[1].text == "error: unknown tool 'mul'; available tools: add, total"
    # Turn 3: 7 + 1 = 8.
    assert [o.text for o in env.step(call("add", '{"n": 1}'), timeout_s=5)] == ["8"]
    # Turn 4: no tool call ends the episode.
    assert env.step("The counter is 8.", timeout_s=5) == []
    assert env.done and env.turns == 4
    assert env.reward() == 1.0
    assert env.stats.calls == {"add": 3, "total": 1, "_other": 2}
    assert env.stats.errors == {("add", "bad_arguments"): 1, ("_other", "unknown_tool"): 1,
                                ("_other", "malformed"): 1}
    with pytest.raises(EpisodeError, match="step after the episode ended"):
        env.step(call("add", '{"n": 1}'), timeout_s=5)


def test_wrong_total_gets_reward_zero_and_step_needs_reset():
    env = load_environment(CounterEnv).episode()
    with pytest.raises(EpisodeError, match="CounterEnv: step before reset"):
        env.step("hi", timeout_s=1)
    env.reset({"target": 2})
    env.step(call("add", '{"n": 5}'), timeout_s=1)
    env.step("done", timeout_s=1)
    assert env.reward() == 0.0
    with pytest.raises(EpisodeError, match="reset called twice"):
        env.reset({"target": 2})


def test_observation_goes_where_trl_puts_it():
    assert prompt_with_observation("Solve:", " 2+2") == "Solve: 2+2"
    assert prompt_with_observation([], "Guess a word.") == [{"role": "user", "content": "Guess a word."}]
    system = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert prompt_with_observation(system, "!") == [system[0], {"role": "user", "content": "Q!"}]
    assert prompt_with_observation(system, None) is system


def test_environments_are_reused_after_release_unless_a_tool_timed_out():
    made = []

    class Slow(CounterEnv):
        def __init__(self):
            made.append(self)
            self.gate = threading.Event()

        def wait(self) -> str:
            """Block until released."""
            self.gate.wait(5)
            return "late"

    spec = load_environment(Slow)
    assert len(made) == 1  # the probe
    first = spec.episode()
    assert first.instance is made[0]  # the probe serves the first episode
    second = spec.episode()
    assert second.instance is made[1]
    first.release()
    first.release()  # idempotent
    assert spec.episode().instance is made[0]
    second.reset({"target": 1})
    [obs] = second.step(call("wait", "{}"), timeout_s=0.05)
    assert (obs.kind, obs.text) == ("timeout", "error: wait did not return within 0.05 s")
    made[1].gate.set()
    second.release()  # its abandoned call may still touch it: not reused
    assert spec.episode().instance is made[2]


def test_standalone_tools_come_first_and_names_must_be_unique():
    spec = load_environment(CounterEnv, tools=[calculator])
    assert spec.tool_names == ("calculator", "add", "total")
    env = spec.episode()
    env.reset({"target": 0})
    [obs] = env.step(call("calculator", '{"expression": "12 * 12"}'), timeout_s=5)
    assert (obs.tool, obs.text) == ("calculator", "144")

    def add(n: int) -> int:
        """Add.

        Args:
            n: A number.
        """
        return n

    with pytest.raises(EnvironmentSpecError) as err:
        load_environment(CounterEnv, tools=[add])
    assert str(err.value) == ("CounterEnv.add: two tools are named 'add'; rename one (tool names must be unique, and "
                              "public methods of an environment are tools)")


class Untyped:
    def reset(self, **kwargs):
        return None

    def scale(self, factor):
        """Scale.

        Args:
            factor: By how much.
        """


class Undocumented:
    def reset(self, **kwargs):
        return None

    def close(self) -> None:
        pass


class NoReset:
    def go(self) -> None:
        """Go."""


class NamedReset:
    def reset(self, target):
        return None


class RewardWithArgument:
    def reset(self, **kwargs):
        return None

    def get_reward(self, completion):
        return 1.0


class Exploding:
    def __init__(self):
        raise OSError("corpus.jsonl not found")


@pytest.mark.parametrize(("factory", "columns", "message"), [
    (Untyped, None, ("Untyped.scale: argument 'factor' has no type hint; add one (int, float, str, bool, list[...], "
     "dict, Literal[...] or X | None) (public methods of Untyped are tools: rename it _scale if it is not one)")),
    (Undocumented, None, ("Undocumented.close: no docstring; add one (first paragraph: what the tool does, then an "
     "'Args:' section with one line per argument) (public methods of Undocumented are tools: rename it _close if "
     "it is not one)")),
    (NoReset, None, ("environment NoReset has no callable reset; add reset(self, **kwargs) that starts an episode "
     "and returns None or text to add to the prompt")),
    (NamedReset, ["prompt", "target"], ("NamedReset.reset cannot take the row's columns (prompt, target): got an "
     "unexpected keyword argument 'prompt'; reset receives every column as a keyword argument, prompt included: "
     "add **kwargs")),
    (RewardWithArgument, None, ("RewardWithArgument.get_reward must take no arguments (it is called as get_reward() "
     "once the episode ends)")),
    (Exploding, None, "environment Exploding: the factory raised OSError: corpus.jsonl not found"),
    ("CounterEnv", None, ("environment factory 'CounterEnv' is not callable; pass the environment class (or a "
     "function returning an instance)")),
])
def test_load_errors_are_one_line_naming_class_and_method(factory, columns, message):
    with pytest.raises(EnvironmentSpecError) as err:
        load_environment(factory, columns=columns)
    assert str(err.value) == message
    assert "\n" not in message


def test_named_reset_is_fine_when_the_columns_match():
    env = load_environment(NamedReset, columns=["target"]).episode()
    assert env.reset({"target": 3}) is None
    assert env.reward() is None  # no get_reward: the environment does not score


class Scored(CounterEnv):
    value: object = 1.0

    def get_reward(self):
        return self.value


@pytest.mark.parametrize(("value", "expected"), [(1, 1.0), (Fraction(1, 4), 0.25), (None, None)])
def test_reward_values_are_real_numbers_or_none(value, expected):
    env = load_environment(Scored).episode()
    env.instance.value = value
    assert env.reward() == expected


@pytest.mark.parametrize(("value", "message"), [
    (float("nan"), ("Scored.get_reward returned nan; rewards must be finite (return None when the episode has no "
     "reward)")),
    (True, "Scored.get_reward returned bool; return a float (or None when the episode has no reward)"),
    ("1.0", "Scored.get_reward returned str; return a float (or None when the episode has no reward)"),
])
def test_bad_reward_values_are_refused(value, message):
    env = load_environment(Scored).episode()
    env.instance.value = value
    with pytest.raises(EpisodeError) as err:
        env.reward()
    assert str(err.value) == message


def test_reset_failures_name_the_class():
    env = load_environment(CounterEnv).episode()
    with pytest.raises(EpisodeError, match=r"^CounterEnv.reset raised KeyError: 'target'$"):
        env.reset({"start": 1})

    class Listy(CounterEnv):
        def reset(self, **kwargs):
            return ["a"]

    with pytest.raises(EpisodeError, match=r"^Listy.reset returned list; return None or a string"):
        load_environment(Listy).episode().reset({})


class AsyncEnv:
    """TRL accepts async tools and an async get_reward; so does rlvr."""

    def reset(self, **kwargs) -> None:
        self.seen = []

    async def fetch(self, key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        await asyncio.sleep(0)
        self.seen.append(key)
        return key.upper()

    async def get_reward(self) -> float:
        return float(len(self.seen))


async def shout(word: str) -> str:
    """Say it louder.

    Args:
        word: The word.
    """
    return word.upper() + "!"


def test_async_tools_and_reward_run_on_the_specs_loop():
    spec = load_environment(AsyncEnv, tools=[shout])
    env = spec.episode()
    env.reset({})
    assert [o.text for o in env.step(call("shout", '{"word": "hi"}'), timeout_s=5)] == ["HI!"]
    obs = env.step(call("fetch", '{"key": "ab"}') + call("fetch", '{"nope": 1}'), timeout_s=5)
    assert [(o.kind, o.text) for o in obs] == [
        ("ok", "AB"),
        ("bad_arguments", ("error: bad arguments for fetch: missing a required argument: 'key'; expected "
                          "fetch(key: str)"))]
    assert env.reward() == 1.0
    spec.close()
