"""Reward protocol: TRL signature, weighted combination, None handling, built-ins."""

import math

import pytest
import torch

from rlvr.rewards import RewardError, WeightedReward, build_reward, check_rewards, score_completions


def trl_style(prompts, completions, **kwargs):
    """A reward written for TRL: reads a dataset column through kwargs."""
    return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, kwargs["solution"])]


def test_trl_reward_function_works_unchanged():
    prompts = [[{"role": "user", "content": "q"}]] * 2
    completions = [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    columns = {"solution": ["a", "a"]}
    total, _per_fn, _, _ = score_completions([WeightedReward("trl", trl_style)], prompts, completions, columns)
    assert total.tolist() == [1.0, 0.0]


def test_weighted_sum_and_none():
    a = WeightedReward("a", lambda prompts, completions, **kw: [1.0, None, None], weight=2.0)
    b = WeightedReward("b", lambda prompts, completions, **kw: [0.5, 0.25, None], weight=-1.0)
    total, per_fn, _, weights = score_completions([a, b], ["p"] * 3, ["c"] * 3, {})
    # row 0: 2*1 - 0.5; row 1: only b scores -> -0.25; row 2: nothing scored -> NaN (excluded)
    assert total[:2].tolist() == [1.5, -0.25] and math.isnan(total[2])
    assert math.isnan(per_fn["a"][1]) and per_fn["b"][1] == 0.25
    assert weights == {"a": 2.0, "b": -1.0}  # GDPO's normalize_then_sum weighs the unweighted columns with these


def test_nan_is_refused_like_inf():
    f = WeightedReward("nan_fn", lambda prompts, completions, **kw: [1.0, float("nan")])
    with pytest.raises(RewardError) as err:
        score_completions([f], ["p"] * 2, ["c"] * 2, {})
    assert str(err.value) == ("reward function 'nan_fn' returned nan at index 1; rewards must be finite or None "
                              "(return None where the function does not apply to a completion)")
    as_tensor = WeightedReward("tensor_fn", lambda prompts, completions, **kw: [torch.tensor(float("nan"))])
    with pytest.raises(RewardError, match="'tensor_fn' returned nan at index 0"):
        score_completions([as_tensor], ["p"], ["c"], {})


def test_real_numbers_of_any_type_are_accepted():
    import numpy as np

    f = WeightedReward("np", lambda prompts, completions, **kw: [np.float32(0.5), np.int64(2), torch.tensor(0.25)])
    total, *_ = score_completions([f], ["p"] * 3, ["c"] * 3, {})
    assert total.tolist() == [0.5, 2.0, 0.25]
    flag = WeightedReward("bool_fn", lambda prompts, completions, **kw: [True])
    with pytest.raises(RewardError, match="'bool_fn' returned bool at index 0; expected a float or None"):
        score_completions([flag], ["p"], ["c"], {})


def test_unscored_batch_is_reported_with_the_function_names():
    none = WeightedReward("never", lambda prompts, completions, **kw: [None] * len(completions))
    crash = WeightedReward("crash", lambda prompts, completions, **kw: 1 / 0, on_error="none")
    scores = score_completions([none, crash], ["p"] * 3, ["c"] * 3, {})
    assert scores.unscored_warning() == (
        "no completion of this batch has a reward: the reward functions ('never', 'crash') returned None for all 3 "
        "completions, so it trains nothing; crash failed (ZeroDivisionError: division by zero) and was scored None "
        "(on_error: none). Check that they read the right columns and the completions' format (a function returns "
        "None only where it does not apply)")
    one = WeightedReward("one", lambda prompts, completions, **kw: [None, None, 0.0])
    assert score_completions([none, one], ["p"] * 3, ["c"] * 3, {}).unscored_warning() is None
    assert score_completions([none], [], [], {}).unscored_warning() is None


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
    with pytest.raises(RewardError, match="unknown reward 'nope'"):
        build_reward("nope")
    with pytest.raises(RewardError, match="has no function 'missing'"):
        build_reward("tests.helpers:missing")


def test_total_dtype():
    ints = WeightedReward("f", lambda prompts, completions, **kw: [1, 0])
    total, *_ = score_completions([ints], ["p"] * 2, ["c"] * 2, {})
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


def _rows():
    return [{"prompt": [{"role": "user", "content": "1 + 1 ="}], "answer": "2"},
            {"prompt": [{"role": "user", "content": "2 + 5 ="}], "answer": "7"},
            {"prompt": [{"role": "user", "content": "never read"}], "answer": "0"}]


def test_check_rewards_calls_each_function_as_training_does():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [len(ids) for ids in columns["completion_ids"]]

    scores = check_rewards([WeightedReward("spy", spy)], _rows())
    chat = _rows()[0]["prompt"], _rows()[1]["prompt"]
    assert seen["prompts"] == [chat[0], chat[0], chat[1], chat[1]]  # 2 rows, 2 placeholder completions each
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in ("", "0", "", "0")]
    trl = {k: seen["columns"].pop(k, None) for k in ("trainer_state", "log_metric", "log_extra")}  # TRL 1.x's
    assert None not in trl.values()
    assert seen["columns"] == {"answer": ["2", "2", "7", "7"], "completion_ids": [[0], [0, 0], [0], [0, 0]]}
    assert scores.total.tolist() == [1.0, 2.0, 1.0, 2.0]  # one fake token per character, plus one
    plain = check_rewards([WeightedReward("spy", spy)], [{"prompt": "1 + 1 =", "answer": "2"}], n=2)
    assert seen["completions"] == ["", "0"] and plain.total.tolist() == [1.0, 2.0]  # plain text for plain prompts
    correct = WeightedReward("correct", build_reward("arithmetic_correct"))
    assert check_rewards([correct], _rows()).total.tolist() == [0.0] * 4  # "" and "0" are wrong answers


def _bad(returns):
    def fn(prompts, completions, **columns):
        return returns(completions)

    return fn


FINITE = "rewards must be finite or None (return None where the function does not apply to a completion)"
CONTAIN = "fix it, or set on_error: none for it to score such batches as None"
BAD_FUNCTIONS = {  # what a function returns for the 4 completions -> the error, as in training
    "raises": (_bad(lambda c: 1 / 0), f"failed (ZeroDivisionError: division by zero); {CONTAIN}"),
    "short": (_bad(lambda c: [1.0]), "returned 1 values for 4 completions; it must return a list of 4"),
    "not_a_list": (_bad(lambda c: 0.5), "returned float values for 4 completions; it must return a list of 4"),
    "string": (_bad(lambda c: ["1"] * len(c)), "returned str at index 0; expected a float or None"),
    "inf": (_bad(lambda c: [0.0, float("inf"), 0.0, 0.0]), f"returned inf at index 1; {FINITE}"),
    "nan": (_bad(lambda c: [float("nan")] * len(c)), f"returned nan at index 0; {FINITE}"),
    "missing_column": (lambda prompts, completions, solution, **columns: [0.0] * len(completions),
                       f"failed (TypeError: <lambda>() missing 1 required positional argument: 'solution'); {CONTAIN}"),
}


@pytest.mark.parametrize("case", list(BAD_FUNCTIONS))
def test_check_rewards_catches_each_bad_function(case):
    fn, message = BAD_FUNCTIONS[case]
    good = WeightedReward("good", lambda prompts, completions, **kw: [1.0] * len(completions))
    with pytest.raises(RewardError) as err:
        check_rewards([good, WeightedReward("bad", fn)], _rows())
    found = "found before training: each function was called once on 2 training rows with the placeholder completions"
    assert str(err.value) == f"reward function 'bad' {message} ({found} '', '0')"


def test_check_rewards_contains_what_training_contains():
    crash = WeightedReward("crash", lambda prompts, completions, **kw: 1 / 0, on_error="none")
    scores = check_rewards([crash], _rows())
    assert scores.errors == {"crash": "ZeroDivisionError: division by zero"}


def test_sentences_are_counted_by_their_ends():
    from rlvr.rewards.format import sentences

    assert sentences("Hi there. You did great!") == 2
    assert sentences("Wait... what?! No way") == 3  # the last runs to the end of the text
    assert sentences("Version 2.5 is out.") == 1  # a period inside a number ends nothing
    assert sentences("") == 0 and sentences(" . ! ") == 0


def test_reply_form_wants_a_short_finished_reply_not_a_review():
    from rlvr.rewards import build_reward

    fn = build_reward("reply_form", {"max_sentences": 2, "max_tokens": 8})
    texts = ["So sorry! You'll pass next time.",                       # a reply: 1
             "One. Two. Three.",                                       # three sentences: 0
             "Your message conveys disappointment clearly.",           # reviews the message: 0
             "Here\u2019s a refined version of your post: I passed.",  # rewrites it (a curly apostrophe): 0
             "It has improved grammar now.",                           # "improved grammar": 0
             "Your message made my day, congratulations!",             # addresses the writer about the news: 1
             "Cut short at the limit"]                                 # 8 tokens: not finished: 0
    ids = [[1] * 5] * 6 + [[1] * 8]
    assert fn(["m"] * 7, texts, completion_ids=ids) == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    anything = build_reward("reply_form", {"max_sentences": 0, "reviews": False})
    assert anything(["m"] * 7, texts, completion_ids=ids) == [1.0] * 7
    with pytest.raises(ValueError, match="max_sentences"):
        build_reward("reply_form", {"max_sentences": -1})
    echo = build_reward("reply_form", {"copy_words": 4})
    message = [{"role": "user", "content": "Flying a kite turns out to be much harder than every movie makes it look."}]
    said = ["Flying a kite turns out to be much harder!", "Kites are hard, but you'll get the knack of it.",
            "It turns out to be fun."]  # 7 words of the message in a row; none; 4 ("turns out to be")
    assert echo([message] * 3, said) == [0.0, 1.0, 0.0]
    said[2] = "It turns out fun."  # 2 in a row
    assert echo([message] * 3, said) == [0.0, 1.0, 1.0]


def test_refusal_finds_a_declined_request():
    from rlvr.rewards import build_reward

    fn = build_reward("refusal")
    texts = ["I'm sorry, but I can't help with that.", "I cannot assist with this request.",
             "As an AI, I have no feelings.", "I\u2019m afraid, but I won\u2019t do that.",
             "I'm sorry to hear that! Can't wait to see it.", "Sure, here you go."]
    assert fn(["m"] * 6, texts) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
