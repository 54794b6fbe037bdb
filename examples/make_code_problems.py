"""Write the small code-problem JSONL files of the examples (deterministic), in three test formats:

- code_*.jsonl (examples/code.yaml): a chat prompt, ``entry_point`` and input/output ``tests``; the sandbox
  returns values and the trainer compares them with the outputs, which never enter the sandbox;
- humaneval_*.jsonl (examples/code_humaneval.yaml): HumanEval's layout - the prompt holds the function's
  signature and docstring, ``test`` defines ``check(candidate)``, plus ``entry_point``;
- mbpp_*.jsonl (examples/code_mbpp.yaml): MBPP's layout - a task description and ``test_list``, assert
  statements naming the function, plus ``test_setup_code``.

The problems are this project's own; expected values come from reference implementations kept here.
"""

import json
import random
from pathlib import Path

SYSTEM = "You write correct, short Python functions. Answer with one ```python code block only."
SPECS = [
    ("add", "a, b", "returns the sum of the integers a and b", lambda a, b: a + b, lambda r: [r.randint(-99, 99), r.randint(-99, 99)]),
    ("is_even", "n", "returns True when the integer n is even", lambda n: n % 2 == 0, lambda r: [r.randint(-50, 50)]),
    ("reverse", "s", "returns the string s reversed", lambda s: s[::-1], lambda r: ["".join(r.choices("abcxyz", k=r.randint(0, 8)))]),
    ("max_of", "xs", "returns the largest number in the non-empty list xs", max, lambda r: [[r.randint(-9, 99) for _ in range(r.randint(1, 6))]]),
    ("count_vowels", "s", "returns how many of the characters of s are vowels (aeiou)", lambda s: sum(c in "aeiou" for c in s), lambda r: ["".join(r.choices("aebcdio", k=r.randint(0, 10)))]),
    ("factorial", "n", "returns n! for an integer 0 <= n <= 12", lambda n: __import__("math").factorial(n), lambda r: [r.randint(0, 12)]),
    ("fib", "n", "returns the n-th Fibonacci number (fib(0) = 0, fib(1) = 1)", lambda n: [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610][n], lambda r: [r.randint(0, 15)]),
    ("square_all", "xs", "returns a list with every number of xs squared", lambda xs: [x * x for x in xs], lambda r: [[r.randint(-9, 9) for _ in range(r.randint(0, 5))]]),
    ("count_char", "s, c", "returns how many times the character c occurs in s", lambda s, c: s.count(c), lambda r: ["".join(r.choices("abc", k=r.randint(0, 9))), r.choice("abc")]),
    ("is_palindrome", "s", "returns True when s reads the same backwards", lambda s: s == s[::-1], lambda r: [r.choice(["abba", "abc", "a", "", "racecar", "ab"])]),
    ("sum_digits", "n", "returns the sum of the decimal digits of the non-negative integer n", lambda n: sum(map(int, str(n))), lambda r: [r.randint(0, 99999)]),
    ("clamp", "x, lo, hi", "returns x limited to the range [lo, hi]", lambda x, lo, hi: max(lo, min(hi, x)), lambda r: [r.randint(-20, 20), -5, 5]),
    ("first_word", "s", "returns the first word of the sentence s (words are separated by spaces)", lambda s: s.split(" ")[0], lambda r: [" ".join(r.choices(["hi", "cat", "sun", "go"], k=r.randint(1, 4)))]),
    ("unique_sorted", "xs", "returns the distinct values of xs in increasing order", lambda xs: sorted(set(xs)), lambda r: [[r.randint(0, 5) for _ in range(r.randint(0, 8))]]),
    ("celsius_to_f", "c", "returns the temperature c (Celsius) in Fahrenheit", lambda c: c * 9 / 5 + 32, lambda r: [r.randint(-40, 100)]),
    ("gcd", "a, b", "returns the greatest common divisor of the positive integers a and b", lambda a, b: __import__("math").gcd(a, b), lambda r: [r.randint(1, 60), r.randint(1, 60)]),
    ("count_words", "s", "returns the number of space-separated words in s", lambda s: len(s.split()), lambda r: [" ".join(r.choices(["a", "bb", "ccc"], k=r.randint(0, 6)))]),
    ("last_item", "xs", "returns the last element of the non-empty list xs", lambda xs: xs[-1], lambda r: [[r.randint(0, 9) for _ in range(r.randint(1, 5))]]),
    ("double", "n", "returns twice the number n", lambda n: 2 * n, lambda r: [r.randint(-100, 100)]),
    ("abs_diff", "a, b", "returns the absolute difference of a and b", lambda a, b: abs(a - b), lambda r: [r.randint(-30, 30), r.randint(-30, 30)]),
    ("upper_first", "s", "returns s with its first character in upper case (s is non-empty)", lambda s: s[:1].upper() + s[1:], lambda r: [r.choice(["hello", "x", "abc def"])]),
    ("average", "xs", "returns the mean of the non-empty list of numbers xs", lambda xs: sum(xs) / len(xs), lambda r: [[r.randint(0, 10) for _ in range(r.randint(1, 5))]]),
    ("is_prime", "n", "returns True when the integer n >= 0 is prime", lambda n: n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)), lambda r: [r.randint(0, 50)]),
    ("join_words", "words", "returns the strings of the list words joined by single spaces", lambda w: " ".join(w), lambda r: [r.choices(["red", "blue", "x"], k=r.randint(0, 4))]),
]


def rows(rng: random.Random) -> list[dict]:
    out = []
    for name, args, text, fn, make in SPECS:
        tests = []
        for _ in range(5):
            inp = make(rng)
            tests.append({"input": inp, "output": fn(*inp)})
        user = f"Write a Python function `{name}({args})` that {text}."
        out.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    "entry_point": name, "tests": tests})
    return out


def _literal(value) -> str:
    return repr(value)


def _assert(name: str, inp: list, out) -> str:
    call = f"{name}({', '.join(_literal(a) for a in inp)})"
    if isinstance(out, float):  # another correct formula may round differently
        return f"assert abs({call} - {out!r}) < 1e-6"
    return f"assert {call} == {_literal(out)}"


def humaneval_rows(rng: random.Random) -> list[dict]:
    out = []
    for name, args, text, fn, make in SPECS:
        signature = f'def {name}({args}):\n    """{text[0].upper() + text[1:]}."""\n'
        body = "\n".join("    " + _assert("candidate", inp, fn(*inp)) for inp in (make(rng) for _ in range(5)))
        user = f"Complete this Python function:\n```python\n{signature}```"
        out.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    "entry_point": name, "test": f"def check(candidate):\n{body}\n"})
    return out


def mbpp_rows(rng: random.Random) -> list[dict]:
    out = []
    for name, args, text, fn, make in SPECS:
        tests = [_assert(name, inp, fn(*inp)) for inp in (make(rng) for _ in range(3))]
        user = f"Write a Python function `{name}({args})` that {text}. It must pass:\n{tests[0]}"
        out.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
                    "test_list": tests, "test_setup_code": ""})
    return out


if __name__ == "__main__":
    out = Path(__file__).parent / "data"
    for stem, all_rows in (("code", rows(random.Random(0))), ("humaneval", humaneval_rows(random.Random(1))),
                           ("mbpp", mbpp_rows(random.Random(2)))):
        for split, part in (("train", all_rows[:18]), ("eval", all_rows[18:])):
            (out / f"{stem}_{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
