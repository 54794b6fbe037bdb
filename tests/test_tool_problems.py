"""The tool-use task: deterministic, held-out products never trained on, right answers, prompt structure."""

import json
import re

import pytest

from rlvr.envs.calculator import calculator
from rlvr.envs.tools import ToolCall, parse_tool_calls
from rlvr.tasks.tool_problems import KINDS, SYSTEM_PROMPT, tool_problem_rows


def _operands(row) -> tuple[int, int]:
    a, b = (int(x) for x in re.findall(r"\d+", row["expression"])[:2])
    return min(a, b), max(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_and_seeded(kind):
    assert tool_problem_rows(20, 50, seed=3, kind=kind) == tool_problem_rows(20, 50, seed=3, kind=kind)
    assert tool_problem_rows(20, 50, seed=3, kind=kind)[1] != tool_problem_rows(20, 50, seed=4, kind=kind)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_held_out_products_are_never_trained_on(kind):
    train, held = tool_problem_rows(40, 2000, seed=0, kind=kind)
    assert len(train) == 2000 and len(held) == 40
    held_pairs = {_operands(r) for r in held}
    assert len(held_pairs) == 40  # one distinct product per held-out question
    assert not held_pairs & {_operands(r) for r in train}
    questions = [r["prompt"][-1]["content"] for r in train + held]
    assert len(set(questions)) == len(questions)
    examples = {(23, 41), (37, 58)}
    assert not examples & {_operands(r) for r in train + held}


@pytest.mark.parametrize("kind", KINDS)
def test_answers_match_a_naive_reference(kind):
    train, held = tool_problem_rows(30, 200, seed=1, kind=kind)
    for row in train + held:
        question = row["prompt"][-1]["content"]
        numbers = [int(x) for x in re.findall(r"\d+", question)]
        a, b = _operands(row)
        assert 12 <= a <= b <= 99 and a % 10 and b % 10
        if kind in ("products", "word"):
            assert sorted(numbers) == [a, b]
            assert row["answer"] == str(a * b)
        else:  # a * b plus or minus the one other number in the question
            (c,) = [n for n in numbers if n not in (a, b)] or [a if numbers.count(a) > 1 else b]
            assert row["answer"] in (str(a * b + c), str(a * b - c))
        assert calculator(row["expression"]) == row["answer"]


@pytest.mark.parametrize("shots", [0, 1, 2])
def test_prompt_structure(shots):
    _, held = tool_problem_rows(5, 10, seed=0, kind="word", shots=shots)
    prompt = held[0]["prompt"]
    assert prompt[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert "calculator" in SYSTEM_PROMPT and "{" not in SYSTEM_PROMPT  # the tool schema is added at rollout time
    assert [m["role"] for m in prompt[1:]] == ["user", "assistant", "tool", "assistant"] * shots + ["user"]
    for i in range(shots):
        _user, call, result, answer = prompt[1 + 4 * i: 5 + 4 * i]
        (parsed,) = parse_tool_calls(call["content"])
        assert isinstance(parsed, ToolCall) and parsed.name == "calculator"
        assert json.loads(call["content"].removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert calculator(parsed.arguments["expression"]) == result["content"]
        assert answer["content"] == f"The answer is {result['content']}."


def test_example_kind_and_errors():
    _, held = tool_problem_rows(3, 5, seed=0, kind="word", example_kind="products")
    assert held[0]["prompt"][1]["content"].startswith("What is ")
    assert not held[0]["prompt"][-1]["content"].startswith("What is ")
    _, bare = tool_problem_rows(3, 5, seed=0, kind="products", shots=0, system_prompt="")
    assert [m["role"] for m in bare[0]["prompt"]] == ["user"]
    with pytest.raises(ValueError, match="kind"):
        tool_problem_rows(3, 5, seed=0, kind="division")
    with pytest.raises(ValueError, match="shots"):
        tool_problem_rows(3, 5, seed=0, shots=3)
    with pytest.raises(ValueError, match="operand pairs"):
        tool_problem_rows(0, 5, seed=0)
