"""The math verifier: a table of 200+ (prediction, gold, expected) cases and hang inputs that must come
back within timeout + 1 s from a thread and from an asyncio loop."""

import asyncio
import threading
import time

import pytest

from rlvr.verifiers.math import AMBIGUOUS, MathVerifier, extract_answer

TIMEOUT = 2.0

INTEGERS = [0, 3, 7, 12, 42, 99, 100, -15, -7, 256, 1000, 2024, 12345, 65536, 1000000, -4096]


def _integer_cases():
    cases = []
    for n in INTEGERS:
        gold = str(n)
        cases += [
            (f"\\boxed{{{n}}}", gold, 1),
            (f"The answer is {n}.", gold, 1),
            (f"So we get $ {n} $", gold, 1),
            (f"Answer: {n}", gold, 1),
            (f"<think>work</think><answer>{n}</answer>", gold, 1),
            (f"\\boxed{{{n}.0}}", gold, 1),
            (f"\\boxed{{{n + 1}}}", gold, 0),
            (f"The answer is {n} + 1 = {n + 1}.", gold, 0),  # the final value is what counts
        ]
        if abs(n) >= 1000:
            cases.append((f"\\boxed{{{n:,}}}", gold, 1))  # thousands separators
            cases.append((f"The answer is {n:,}.", gold, 1))
    return cases


FRACTIONS = [(1, 2), (1, 4), (3, 4), (1, 5), (2, 5), (1, 8), (3, 8), (7, 10), (5, 2), (9, 4)]


def _fraction_cases():
    cases = []
    for a, b in FRACTIONS:
        gold = f"{a}/{b}"
        cases += [
            (f"\\boxed{{{a / b:g}}}", gold, 1),  # exact decimal
            (f"\\boxed{{\\frac{{{a}}}{{{b}}}}}", gold, 1),
            (f"\\boxed{{\\dfrac{{{a}}}{{{b}}}}}", gold, 1),
            (f"\\boxed{{{2 * a}/{2 * b}}}", gold, 1),  # unreduced
            (f"\\boxed{{\\frac{{{a + 1}}}{{{b}}}}}", gold, 0),
        ]
    for a, b in [(1, 3), (2, 3), (1, 6), (5, 7), (1, 9)]:
        gold = f"\\frac{{{a}}}{{{b}}}"
        cases += [
            (f"\\boxed{{{a / b:.6f}}}", gold, 1),  # agrees to 6 decimals
            (f"\\boxed{{{a / b:.2f}}}", gold, 0),  # rounded too early
            (f"\\boxed{{\\frac{{{2 * a}}}{{{2 * b}}}}}", gold, 1),
        ]
    return cases


LATEX_AND_UNITS = [
    ("\\boxed{\\frac{1}{2}\\pi}", "\\frac{\\pi}{2}", 1),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1),
    ("\\boxed{x = 42}", "42", 1),
    ("\\boxed{\\sqrt{2}}", "1.4142", 0),  # not equal to 6 decimals
    ("\\boxed{1.5708}", "\\pi/2", 0),
    ("\\boxed{2\\pi}", "\\pi", 0),
    ("\\boxed{x^2+1}", "x^2+2x+1", 0),
    ("\\boxed{5 \\text{ cm}}", "5", 1),
    ("\\boxed{\\$5}", "5", 1),
    ("The answer is 5 cm.", "5", 1),
    ("\\boxed{5\\%}", "0.05", 1),
    ("\\boxed{50\\%}", "0.5", 1),
    ("\\boxed{10^{2}}", "100", 1),
    ("\\boxed{2^{10}}", "1024", 1),
    ("\\boxed{\\sqrt{16}}", "4", 1),
    ("\\boxed{−7}", "-7", 1),  # unicode minus
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1),
]

TRAPS = [
    ("\\boxed{12.0001}", "12", 0),
    ("\\boxed{100001}", "100000", 0),
    ("\\boxed{-7}", "7", 0),
    ("\\boxed{7}", "-7", 0),
    ("\\boxed{5}", "0.5", 0),
    ("\\boxed{0.5}", "5", 0),
    ("I have 42 apples and 3 oranges", "42", 0),  # the last number is 3
    ("\\boxed{}", "0", 0),
    ("no answer at all", "7", 0),
    ("\\boxed{42", "42", 0),  # a malformed (unclosed) box is no answer
    ("\\boxed{1,2}", "12", 0),  # a pair, not twelve
    ("\\boxed{21}", "12", 0),
]

HACKING = [
    ("\\boxed{41} \\boxed{42}", "42", 0),  # several different boxed answers: listing candidates earns 0
    ("\\boxed{42} or maybe \\boxed{43}", "42", 0),
    ("\\boxed{40}\\boxed{41}\\boxed{42}\\boxed{43}", "42", 0),
    ("First \\boxed{42}; checking again: \\boxed{42}", "42", 1),  # the same answer twice is fine
    ("\\boxed{ 42 } and \\boxed{42}", "42", 1),
    ("\\boxed{41, 42}", "42", 0),
    ("\\boxed{\\{41, 42\\}}", "42", 0),
    ("\\boxed{42 \\text{ or } 43}", "42", 0),
    ("The answer is 41. No wait, the answer is 42.", "42", 1),  # last answer wins
    ("The answer is 41. No wait, the answer is 42.", "41", 0),
    ("<answer>41</answer> ... <answer>42</answer>", "42", 1),
]

CASES = _integer_cases() + _fraction_cases() + LATEX_AND_UNITS + TRAPS + HACKING


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(workers=2, timeout_s=TIMEOUT)
    yield v
    v.close()


def test_table_has_200_cases():
    assert len(CASES) >= 200


def test_table(verifier):
    preds, golds, expected = zip(*CASES)
    got = verifier.score(list(golds), list(preds))
    wrong = [(p, g, e, s) for p, g, e, s in zip(preds, golds, expected, got) if s != e]
    assert not wrong, wrong


def test_several_different_boxes_are_ambiguous():
    assert extract_answer("\\boxed{1} \\boxed{2}") is AMBIGUOUS
    assert extract_answer("\\boxed{\\frac{1}{2}} then \\boxed{ \\frac{1}{2} }") == "\\boxed{ \\frac{1}{2} }"


def test_unparsable_gold_is_none(verifier):
    assert verifier.check("\\", "\\boxed{1}") is None


HANGS = {
    "tower": "\\boxed{10^{10^{10^{10}}}}",
    "python_power": "The answer is 2**30**5",
    "long_expression": "\\boxed{" + "+".join(["(1+x)^{99}"] * 12_000) + "}",
}


def _timed(verifier, prediction):
    started = time.perf_counter()
    score = verifier.check("1", prediction)
    return score, time.perf_counter() - started


@pytest.mark.parametrize("name", sorted(HANGS))
def test_hang_inputs_return_in_time_from_a_thread(verifier, name):
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=_timed(verifier, HANGS[name])))
    thread.start()
    thread.join(TIMEOUT + 5)
    score, elapsed = out["result"]
    assert score == 0.0
    assert elapsed < TIMEOUT + 1.0
    assert verifier.alive_workers == verifier.size  # the pool recovered to full size


@pytest.mark.parametrize("name", sorted(HANGS))
def test_hang_inputs_return_in_time_inside_asyncio(verifier, name):
    async def main():
        return _timed(verifier, HANGS[name])

    score, elapsed = asyncio.run(main())
    assert score == 0.0 and elapsed < TIMEOUT + 1.0
    assert verifier.check("42", "\\boxed{42}") == 1.0  # still serving


def test_completion_length_is_capped_before_parsing():
    text = "x" * 100_000 + " The answer is 42."
    assert len(extract_answer(text)) < 5000
