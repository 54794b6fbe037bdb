"""Reward protocol: TRL signature, weighted combination, None handling, built-ins."""

import math

import pytest
import torch

from rlvr.rewards import RewardError, WeightedReward, build_reward, score_completions


def trl_style(prompts, completions, **kwargs):
    """A reward written for TRL: reads a dataset column through kwargs."""
    return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, kwargs["solution"])]


def test_trl_reward_function_works_unchanged():
    prompts = [[{"role": "user", "content": "q"}]] * 2
    completions = [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    columns = {"solution": ["a", "a"]}
    total, _per_fn, _ = score_completions([WeightedReward("trl", trl_style)], prompts, completions, columns)
    assert total.tolist() == [1.0, 0.0]


def test_weighted_sum_and_none():
    a = WeightedReward("a", lambda prompts, completions, **kw: [1.0, None, None], weight=2.0)
    b = WeightedReward("b", lambda prompts, completions, **kw: [0.5, 0.25, None], weight=-1.0)
    total, per_fn, _ = score_completions([a, b], ["p"] * 3, ["c"] * 3, {})
    # row 0: 2*1 - 0.5; row 1: only b scores -> -0.25; row 2: nothing scored -> NaN (excluded)
    assert total[:2].tolist() == [1.5, -0.25] and math.isnan(total[2])
    assert math.isnan(per_fn["a"][1]) and per_fn["b"][1] == 0.25


def test_nan_counts_as_missing():
    f = WeightedReward("f", lambda prompts, completions, **kw: [float("nan"), 1.0])
    total, _, _ = score_completions([f], ["p"] * 2, ["c"] * 2, {})
    assert math.isnan(total[0]) and total[1] == 1.0


def test_wrong_length_names_the_function():
    f = WeightedReward("short_fn", lambda prompts, completions, **kw: [1.0])
    with pytest.raises(RewardError, match="reward function 'short_fn' returned 1 values for 2 completions"):
        score_completions([f], ["p"] * 2, ["c"] * 2, {})


def test_wrong_type_names_the_function():
    f = WeightedReward("str_fn", lambda prompts, completions, **kw: ["1.0"])
    with pytest.raises(RewardError, match="reward function 'str_fn' returned str at index 0; expected a float or None"):
        score_completions([f], ["p"], ["c"], {})


@pytest.mark.parametrize(
    "text, gold, expected",
    [("The answer is 42.", "42", 1.0), ("so \\boxed{0.5}", "1/2", 1.0), ("$\\frac{3}{4}$", "0.75", 1.0),
     ("It is 1,000", "1000", 1.0), ("41", "42", 0.0), ("no number here", "7", 0.0)],
)
def test_math_correct(text, gold, expected):
    assert build_reward("math_correct")([None], [text], answer=[gold]) == [expected]


def test_math_correct_unparsable_gold_is_none():
    assert build_reward("math_correct")([None], ["5"], answer=[""]) == [None]


def test_math_correct_missing_column_is_clear():
    with pytest.raises(KeyError, match="needs a dataset column 'answer'"):
        build_reward("math_correct")([None], ["5"], solution=["5"])


@pytest.mark.parametrize(
    "text, expected",
    [("The answer is 12.", 1.0), ("7 + 5 = 12", 1.0), ("12 or 13", 0.0), ("1,2", 0.0), ("", 0.0), ("x = 1,012", 0.0)],
)
def test_arithmetic_correct(text, expected):
    assert build_reward("arithmetic_correct")([None], [text], answer=["12"]) == [expected]


def test_format_reward():
    f = build_reward("format")
    ok, bad = "<think>a b</think>\n<answer>3</answer>", "<answer>3</answer>"
    assert f(None, [ok, bad, [{"role": "assistant", "content": ok}]]) == [1.0, 0.0, 1.0]
    assert build_reward("format", {"pattern": r"\d+"})(None, ["123", "12a"]) == [1.0, 0.0]


def test_import_path_and_unknown_names():
    f = build_reward("tests.helpers:length_reward")
    assert f([None], ["abc"]) == [3.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("nope")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        build_reward("tests.helpers:missing")


def test_total_dtype():
    ints = WeightedReward("f", lambda prompts, completions, **kw: [1, 0])
    total, _, _ = score_completions([ints], ["p"] * 2, ["c"] * 2, {})
    assert total.dtype == torch.float32 and total.tolist() == [1.0, 0.0]


def test_equations_correct_by_hand():
    f = build_reward("equations_correct")
    texts = ["3 + 4 = 7\n7 - 2 = 5\nThe answer is 5.",  # both right
             "12 / 3 = 4, then 4 * 5 = 21",  # one of two
             "5 x 33 = 165 and 10 × 2 = 22",  # one of two (x and × are times)
             "7 / 2 = 3", "2 - 5 = -3", "6 ÷ 0 = 0",  # inexact division is wrong; negatives fine; no zero division
             "no calculation, 1.5 + 2 = 3.5", ""]  # nothing of the form: 0
    assert f(None, texts) == [1.0, 0.5, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_steps_correct_by_hand():
    f = build_reward("steps_correct")
    chain = ["7", "5"]  # "3 pens, buys 4, gives away 2": 7 after step one, 5 after step two
    texts = ["3 + 4 = 7\n7 - 2 = 5", "3 + 4 = 7\n7 - 3 = 4", "3 + 4 = 8\n8 - 3 = 5",  # 2/2, 1/2, 0 (wrong sum first)
             "7 - 2 = 5\n3 + 4 = 7",  # right calculations in the wrong order: the first gives 5, not 7 -> 0
             "2 + 2 = 4, 3 + 4 = 7, 7 - 2 = 5",  # a calculation off the chain first: 0, however many follow
             "3 + 4 = 7, 7 - 2 = 5, 5 + 5 = 10", "The answer is 5."]  # extra after the chain: 1; no work: 0
    assert f(None, texts, chain=[chain] * 7) == [1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert f(None, ["x"], chain=[[]]) == [None]
    with pytest.raises(KeyError, match="column 'chain'"):
        f(None, ["x"], answer=["1"])


def test_steps_correct_all_steps_by_hand():
    f = build_reward("steps_correct", {"all_steps": True})
    chain = ["7", "5"]
    texts = ["3 + 4 = 7\n7 - 2 = 5", "3 + 4 = 7\n7 - 3 = 4",  # two calculations: 2/2, 1/2 as before
             "3 + 4 = 7\nThe answer is 7.",  # first step right, then stops: 0 (1/2 without all_steps)
             "3 + 4 = 7, 7 - 2 = 5, 5 + 5 = 10",  # runs on past the chain: 0 (1 without all_steps)
             "3 + 4 = 8\n8 - 3 = 5", "The answer is 5."]
    assert f(None, texts, chain=[chain] * 6) == [1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    assert f(None, ["3 + 4 = 7"], chain=[["7"]]) == [1.0]  # a one-step problem needs its one calculation


def test_overlong_penalty_by_hand():
    f = build_reward("overlong_penalty", {"max_tokens": 10, "cache_tokens": 4})
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 11)]
    # free up to 6 tokens; 7 -> (6 - 7) / 4 = -0.25; 8 -> -0.5; 10 -> -1; 11 -> -1
    assert f(None, [""] * 6, completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="0 < cache_tokens <= max_tokens"):
        build_reward("overlong_penalty", {"max_tokens": 4, "cache_tokens": 5})
