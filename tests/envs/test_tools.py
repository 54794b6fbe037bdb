"""Tool schemas, parsing tool calls, running them (every failure an observation), counting them. Pure Python:
no model, no sampler. Expected values are written out by hand."""

from __future__ import annotations

import threading
from typing import Literal

import pytest

from rlvr.envs.calculator import calculator
from rlvr.envs.tools import (
    CALL_FORMAT,
    Observation,
    ToolCall,
    ToolCallError,
    ToolError,
    ToolSchemaError,
    ToolStats,
    parse_tool_calls,
    run_tool_call,
    tool_schema,
)

FIX = f"; write {CALL_FORMAT}"


def multiply(a: int, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor,
            on two lines.
    """
    return a * b


def convert(distance: float, unit: Literal["km", "mi"] = "km", tags: list[str] | None = None):
    """Convert a distance.

    Args:
        distance: How far.
        unit: The unit.
        tags: Labels.
    """


class Counter:
    """A TRL-style environment: public methods are tools."""

    def __init__(self):
        self.total = 0

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.total += step
        return self.total


def test_schema_of_a_typed_documented_function():
    assert tool_schema(multiply) == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first factor."},
                    "b": {"type": "number", "description": "The second factor, on two lines."},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "number"},
        },
    }


def test_schema_literal_optional_list_and_defaults():
    assert tool_schema(convert)["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "distance": {"type": "number", "description": "How far."},
            "unit": {"type": "string", "enum": ["km", "mi"], "description": "The unit."},
            "tags": {"type": "array", "items": {"type": "string"}, "nullable": True, "description": "Labels."},
        },
        "required": ["distance"],
    }


def test_schema_of_a_bound_method_leaves_out_self():
    assert tool_schema(Counter().increment)["function"] == {
        "name": "increment",
        "description": "Add to the counter.",
        "parameters": {"type": "object", "properties": {"step": {"type": "integer", "description": "How much to add."}},
                       "required": ["step"]},
        "return": {"type": "integer"},
    }


def test_schema_of_the_calculator():
    assert tool_schema(calculator)["function"] == {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly, e.g. 123456 * 789 or (2.5 + 1) / 7.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "Numbers, parentheses and the operators + - * / // % ** (power)."}},
            "required": ["expression"]},
        "return": {"type": "string"},
    }


def no_hint(x, y: int):
    """D.

    Args:
        x: X.
        y: Y.
    """


def no_doc(x: int):
    pass


def undocumented(x: int, y: int):
    """D.

    Args:
        x: X.
    """


class Opaque:
    pass


def opaque(x: Opaque):
    """D.

    Args:
        x: X.
    """


HINTS = "int, float, str, bool, list[...], dict, Literal[...] or X | None"


@pytest.mark.parametrize("fn, message", [
    (no_hint, f"tool no_hint: argument 'x' has no type hint; add one ({HINTS})"),
    (no_doc, ("tool no_doc: no docstring; add one (first paragraph: what the tool does, then an 'Args:' section "
             "with one line per argument)")),
    (undocumented, ("tool undocumented: argument 'y' is not described in the docstring; add 'y: <what it is>' under "
                   "'Args:'")),
])
def test_schema_errors_name_the_tool_and_the_fix(fn, message):
    with pytest.raises(ToolSchemaError) as err:
        tool_schema(fn)
    assert str(err.value) == message


def test_schema_error_for_a_type_without_a_schema_is_one_line():
    with pytest.raises(ToolSchemaError) as err:
        tool_schema(opaque)
    message = str(err.value)
    assert message.startswith("tool opaque: cannot build its schema (TypeHintParsingException: ")
    assert message.endswith(f"); use {HINTS}") and "\n" not in message


CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": [2]}}\n</tool_call>'


@pytest.mark.parametrize("text, expected", [
    ("The answer is 6.", []),
    (f"Let me compute. {CALC} Done.", [ToolCall("calculator", {"expression": "2*3"})]),
    (f"{CALC}{ADD}", [ToolCall("calculator", {"expression": "2*3"}), ToolCall("add", {"x": 1, "y": [2]})]),
    ('<tool_call>{"name": "now"}</tool_call>', [ToolCall("now", {})]),  # no "arguments": none
    ("</tool_call> stray closing tag", []),
])
def test_parse_well_formed(text, expected):
    assert parse_tool_calls(text) == expected


@pytest.mark.parametrize("body, reason", [
    ('{"name": "calculator" "arguments": {}}', "not valid JSON: Expecting ',' delimiter at character 22"),
    ('{"name": "calculator", "arguments": {"expression": "2*3"}', ("not valid JSON: Expecting ',' delimiter at "
                                                                   "character 57")),
    ("", "not valid JSON: Expecting value at character 0"),
    ("calculator(2*3)", "not valid JSON: Expecting value at character 0"),
    ('["calculator", "2*3"]', "expected a JSON object, got an array"),
    ('"calculator"', "expected a JSON object, got a string"),
    ('{"arguments": {}}', 'no "name" string'),
    ('{"name": "", "arguments": {}}', 'no "name" string'),
    ('{"name": 7, "arguments": {}}', 'no "name" string'),
    ("[" * 20_000, "JSON nested too deeply"),
])
def test_parse_malformed(body, reason):
    assert parse_tool_calls(f"x <tool_call>{body}</tool_call> y") == [ToolCallError(reason)]


def test_parse_non_object_arguments_keeps_the_name():
    text = '<tool_call>{"name": "calculator", "arguments": "2*3"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCallError('"arguments" must be a JSON object, got a string', "calculator")]


def test_parse_unclosed_call_after_a_good_one():
    assert parse_tool_calls(CALC + '<tool_call>{"name": "calc') == [
        ToolCall("calculator", {"expression": "2*3"}), ToolCallError("<tool_call> without </tool_call>")]


def test_parse_bounds_calls_per_turn_and_characters_read():
    assert parse_tool_calls(CALC * 3, max_calls=2) == [
        ToolCall("calculator", {"expression": "2*3"}), ToolCall("calculator", {"expression": "2*3"}),
        ToolCallError("more than 2 tool calls in one turn; the rest were ignored")]
    # CALC is 11 + 58 + 12 = 81 characters: the second call starts inside the first 100 and ends after them.
    assert len(CALC) == 81
    assert parse_tool_calls(CALC + CALC, max_chars=100) == [
        ToolCall("calculator", {"expression": "2*3"}),
        ToolCallError("<tool_call> without </tool_call> (only the first 100 characters are read)")]
    assert parse_tool_calls("x" * 100 + CALC, max_chars=100) == []


def add(x: float, y: float) -> float:
    """Add.

    Args:
        x: First.
        y: Second.
    """
    return x + y


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


class Thing:
    def __str__(self):
        return "<thing>"


async def aio() -> int:
    return 1


def failing():
    raise KeyError("key")


def exits():
    raise SystemExit(3)


def refusing():
    raise ToolError("the input must be positive")


TOOLS = {"add": add, "calculator": calculator, "failing": failing, "exits": exits, "refusing": refusing,
         "aio": aio, "thing": Thing, "unprintable": Unprintable, "echo": lambda value: value}


@pytest.mark.parametrize("call, kind, text", [
    (ToolCall("add", {"x": 1, "y": 2.5}), "ok", "3.5"),
    (ToolCall("calculator", {"expression": "0.1 + 0.2"}), "ok", "0.3"),
    (ToolCall("echo", {"value": {"a": [1, None, True]}}), "ok", '{"a": [1, null, true]}'),
    (ToolCall("echo", {"value": "plain"}), "ok", "plain"),
    (ToolCall("echo", {"value": None}), "ok", "null"),
    (ToolCall("echo", {"value": 7}), "ok", "7"),
    (ToolCall("thing", {}), "ok", "<thing>"),
    (ToolCall("multiply", {}), "unknown_tool", ("error: unknown tool 'multiply'; available tools: add, aio, "
                                               "calculator, echo, exits, failing, refusing, thing, unprintable")),
    (ToolCall("add", {"x": 1}), "bad_arguments", ("error: bad arguments for add: missing a required argument: "
                                                 "'y'; expected add(x: float, y: float)")),
    (ToolCall("add", {"x": 1, "y": 2, "z": 3}), "bad_arguments", ("error: bad arguments for add: got an "
                                                                 "unexpected keyword argument 'z'; expected "
                                                                 "add(x: float, y: float)")),
    (ToolCall("failing", {}), "error", "error: failing raised KeyError: 'key'"),
    (ToolCall("exits", {}), "error", "error: exits raised SystemExit: 3"),
    (ToolCall("refusing", {}), "error", "error: the input must be positive"),
    (ToolCall("calculator", {"expression": "1/0"}), "error", "error: division by zero"),
    (ToolCall("aio", {}), "error", "error: aio is async; rlvr runs only plain functions as tools"),
    (ToolCall("unprintable", {}), "error", ("error: the result of unprintable could not be turned into text "
                                           "(RuntimeError: no text)")),
    (ToolCallError("no \"name\" string"), "malformed", 'error: malformed tool call: no "name" string' + FIX),
])
@pytest.mark.parametrize("timeout_s", [0.0, 30.0])  # in this thread, and in a worker with a deadline
def test_every_outcome_is_an_observation(call, kind, text, timeout_s):
    obs = run_tool_call(call, TOOLS, timeout_s)
    assert (obs.kind, obs.text, obs.truncated) == (kind, text, 0)
    assert obs.tool == (None if kind in ("unknown_tool", "malformed") else call.name)


def test_malformed_call_that_names_a_known_tool_is_counted_for_it():
    obs = run_tool_call(ToolCallError('"arguments" must be a JSON object, got a string', "add"), TOOLS, 1.0)
    assert (obs.tool, obs.kind) == ("add", "malformed")
    assert obs.text == 'error: malformed tool call: "arguments" must be a JSON object, got a string' + FIX


def test_unknown_tool_name_is_shortened_and_none_available():
    obs = run_tool_call(ToolCall("n" * 60, {}), {}, 1.0)
    assert obs.text == f"error: unknown tool '{'n' * 50}...'; available tools: none"


def test_long_result_is_cut_and_says_how_much():
    obs = run_tool_call(ToolCall("echo", {"value": "x" * 50}), TOOLS, 0.0, max_chars=10)
    assert (obs.kind, obs.text, obs.truncated) == ("ok", "xxxxxxxxxx\n[truncated: 40 more characters]", 40)


def test_timeout_abandons_the_tool():
    release = threading.Event()
    obs = run_tool_call(ToolCall("wait", {}), {"wait": release.wait}, 0.05)
    release.set()  # let the abandoned worker thread finish
    assert (obs.tool, obs.kind, obs.text) == ("wait", "timeout", "error: wait did not return within 0.05 s")


def test_environment_method_keeps_its_state():
    env = Counter()
    tools = {"increment": env.increment}
    assert run_tool_call(ToolCall("increment", {"step": 2}), tools, 1.0).text == "2"
    assert run_tool_call(ToolCall("increment", {"step": 3}), tools, 0.0).text == "5"


def test_stats_count_calls_and_errors_per_tool():
    stats = ToolStats()
    for obs in [Observation("calculator", "ok", "6", 0.25), Observation("calculator", "error", "e", 0.5),
                Observation("calculator", "ok", "x", 0.25, truncated=9), Observation(None, "unknown_tool", "e"),
                Observation(None, "malformed", "e")]:
        stats.record(obs)
    other = ToolStats()
    other.record(Observation("python", "timeout", "e", 2.0))
    stats.merge(other)
    assert stats.as_metrics() == {
        "calls/_all": 6.0,
        "errors/_all/unknown_tool": 1.0, "errors/_all/bad_arguments": 0.0, "errors/_all/error": 1.0,
        "errors/_all/timeout": 1.0, "errors/_all/malformed": 1.0,
        "calls/_other": 2.0, "calls/calculator": 3.0, "calls/python": 1.0,
        "errors/_other/malformed": 1.0, "errors/_other/unknown_tool": 1.0, "errors/calculator/error": 1.0,
        "errors/python/timeout": 1.0,
        "seconds/calculator": 1.0, "seconds/python": 2.0,
        "truncated/calculator": 1.0,
    }


def test_empty_stats_still_report_totals():
    assert ToolStats().as_metrics() == {"calls/_all": 0.0, "errors/_all/unknown_tool": 0.0,
                                        "errors/_all/bad_arguments": 0.0, "errors/_all/error": 0.0,
                                        "errors/_all/timeout": 0.0, "errors/_all/malformed": 0.0}
