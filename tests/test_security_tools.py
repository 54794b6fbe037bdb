"""Security review (issue 39), episodes: a tool call the model writes with an integer over Python's int-str digit
limit (4,300 digits) is a malformed call the model reads about, not an exception that ends the run."""

from __future__ import annotations

from rlvr.envs.environment import load_environment
from rlvr.envs.tools import CALL_FORMAT, ToolCall, ToolCallError, parse_tool_calls

HUGE = "9" * 4301  # one digit over CPython's default sys.get_int_max_str_digits()


class Adder:
    """A TRL-style environment with one tool."""

    def reset(self, **row) -> None:
        self.total = 0

    def add(self, step: int) -> int:
        """Add to the total.

        Args:
            step: How much to add.
        """
        self.total += step
        return self.total


def test_a_call_with_a_4301_digit_integer_is_a_malformed_call():
    text = f'<tool_call>{{"name": "add", "arguments": {{"step": {HUGE}}}}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCallError("a number too long to read")]


def test_the_episode_goes_on_after_the_bad_call_and_counts_it():
    env = load_environment(Adder).episode()
    env.reset({})
    bad = f'<tool_call>{{"name": "add", "arguments": {{"step": {HUGE}}}}}</tool_call>'
    good = '<tool_call>{"name": "add", "arguments": {"step": 4}}</tool_call>'
    (first,) = env.step(bad, timeout_s=5)
    assert first.kind == "malformed"
    assert first.text == f"error: malformed tool call: a number too long to read; write {CALL_FORMAT}"
    (second,) = env.step(good, timeout_s=5)
    assert (second.kind, second.text) == ("ok", "4")
    assert env.stats.errors == {("_other", "malformed"): 1}


def test_an_integer_at_the_limit_still_parses():
    text = f'<tool_call>{{"name": "add", "arguments": {{"step": {HUGE[1:]}}}}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("add", {"step": int(HUGE[1:])})]
