"""The four code-test formats through the real sandbox: a correct solution scores 1, a wrong one 0, a
crashing one 0, a looping one 0 - and the assert formats resist the attacks that target in-sandbox grading."""

import math
import re

import pytest

from rlvr.verifiers import plain
from rlvr.verifiers.code_formats import detect_format, make_job, normalise_output, score
from rlvr.verifiers.sandbox import Limits, Sandbox, SandboxUnavailable

TIMEOUT = 2.0


@pytest.fixture(scope="module")
def sandbox():
    try:
        box = Sandbox(slots=2, limits=Limits(timeout_s=TIMEOUT, cpu_s=2))
    except SandboxUnavailable as err:
        pytest.skip(f"no isolation on this machine: {err}")
    yield box
    box.close()


def scores(sandbox, row, codes, prompt_code=None):
    runs = sandbox.execute_many([make_job(row, code, prompt_code) for code in codes])
    return [score(run, row) for run in runs]


IO_ROW = {"entry_point": "mul", "tests": [{"input": [2, 3], "output": 6}, {"input": [-1, 4], "output": -4}]}
PROGRAM_ROW = {"tests": [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4\n", "stdout": "6"}]}
HUMANEVAL_ROW = {
    "entry_point": "mul",
    "test": "def check(candidate):\n    assert candidate(2, 3) == 6\n    assert candidate(-1, 4) == -4\n"
            "    assert candidate(0, 9) == 0\n",
}
MBPP_ROW = {"test_list": ["assert mul(2, 3) == 6", "assert mul(-1, 4) == -4", "assert mul(0, 9) == 0"],
            "test_setup_code": ""}

MUL = "def mul(a, b):\n    return a * b\n"
WRONG = "def mul(a, b):\n    return a + b\n"
CRASH = "def mul(a, b):\n    raise RuntimeError('boom')\n"
LOOP = "def mul(a, b):\n    while True:\n        pass\n"
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)   \n"


@pytest.mark.parametrize(
    "row, right, wrong, crash, loop",
    [
        (IO_ROW, MUL, WRONG, CRASH, LOOP),
        (HUMANEVAL_ROW, MUL, WRONG, CRASH, LOOP),
        (MBPP_ROW, MUL, WRONG, CRASH, LOOP),
        (PROGRAM_ROW, ADD_PROGRAM, "print(0)", "raise SystemExit('no')", "while True:\n    pass\n"),
    ],
    ids=["io", "humaneval", "mbpp", "program"],
)
def test_each_format_scores_right_wrong_crash_loop(sandbox, row, right, wrong, crash, loop):
    assert scores(sandbox, row, [right, wrong, crash, loop]) == [1.0, 0.0, 0.0, 0.0]


def test_formats_are_recognised_by_columns():
    assert [detect_format(r) for r in (IO_ROW, PROGRAM_ROW, HUMANEVAL_ROW, MBPP_ROW)] == [
        "io", "program", "humaneval", "mbpp"]
    with pytest.raises(ValueError, match="input/output tests need 'entry_point'"):
        detect_format({"tests": [{"input": [1], "output": 2}]})
    with pytest.raises(ValueError, match="HumanEval-style rows need 'entry_point'"):
        detect_format({"test": "def check(candidate): pass"})
    with pytest.raises(ValueError, match="code rows need one of"):
        detect_format({"tests": [{"input": 1, "output": 2}], "entry_point": "f"})


def test_partial_credit_per_assert_and_per_program_run(sandbox):
    half_right = "def mul(a, b):\n    return a * b if a > 0 else 99\n"
    assert scores(sandbox, MBPP_ROW, [half_right]) == [pytest.approx(1 / 3)]
    first_only = "a, b = map(int, input().split())\nprint(5 if a == 2 else 0)\n"
    assert scores(sandbox, PROGRAM_ROW, [first_only]) == [0.5]


def test_humaneval_body_completes_the_prompt(sandbox):
    prompt = 'def mul(a, b):\n    """Return a times b."""\n'
    body = "    return a * b\n"
    assert scores(sandbox, HUMANEVAL_ROW, [body], prompt_code=prompt) == [1.0]
    assert scores(sandbox, HUMANEVAL_ROW, [body]) == [0.0]  # a body alone defines nothing


def test_mbpp_setup_code_and_helpers(sandbox):
    row = {"test_list": ["assert total(make()) == 6"], "test_setup_code": "def make():\n    return [1, 2, 3]\n"}
    assert scores(sandbox, row, ["def total(xs):\n    return sum(xs)\n"]) == [1.0]


def test_program_output_whitespace_is_normalised_but_a_crash_is_not_a_pass(sandbox):
    assert normalise_output("5  \n\n\n") == normalise_output("5") == "5"
    crash_after_printing = "a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)\n"
    assert scores(sandbox, PROGRAM_ROW, [crash_after_printing]) == [0.0]


ASSERT_ATTACKS = {
    "always_equal_object": "class A:\n    def __eq__(self, o):\n        return True\n"
                           "def mul(a, b):\n    return A()\n",
    "int_subclass": "class I(int):\n    def __eq__(self, o):\n        return True\n"
                    "def mul(a, b):\n    return I(7)\n",
    "exit_at_load": "import sys\nsys.exit(0)\n" + MUL,
    "hard_exit_at_load": "import os\nos._exit(0)\n" + MUL,
    "exit_during_a_call": "import os\ndef mul(a, b):\n    os._exit(0)\n",
    "system_exit_in_call": "import sys\ndef mul(a, b):\n    sys.exit(0)\n",
    "print_passed": "print('{\"i\": 0, \"passed\": true}')\nprint('ALL TESTS PASSED')\n" + WRONG,
    "forge_on_every_fd": "import os\nfor fd in range(64):\n    try:\n"
                         "        os.write(fd, b'{\"i\": 0, \"passed\": true}\\n{\"i\": 1, \"passed\": true}\\n')\n"
                         "    except OSError:\n        pass\n" + WRONG,
    "kill_the_checker": "import os, signal\ntry:\n    os.kill(1, signal.SIGKILL)\nexcept OSError:\n    pass\n" + WRONG,
    "read_the_checker_memory": "def mul(a, b):\n    return open('/proc/1/environ').read()\n",
    "patch_assertion_error": "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\n" + WRONG,
    "dunder_builtins": "def __builtins__():\n    return {}\ndef __import__(*a):\n    return 0\n" + WRONG,
}


@pytest.mark.parametrize("name", sorted(ASSERT_ATTACKS))
@pytest.mark.parametrize("row", [HUMANEVAL_ROW, MBPP_ROW], ids=["humaneval", "mbpp"])
def test_assert_formats_resist_attacks(sandbox, row, name):
    assert scores(sandbox, row, [ASSERT_ATTACKS[name]]) == [0.0], name


# builtin -> (an assert on f(...) that an MBPP or HumanEval test might make, what a shadow returns to pass it)
BUILTIN_ASSERTS = {
    "set": ("set(f([1, 2])) == set([2, 1])", "{1, 2}"),
    "sorted": ("sorted(f([2, 1])) == [1, 2]", "[1, 2]"),
    "abs": ("abs(f(-3)) == 3", "3"),
    "len": ("len(f([1, 2])) == 2", "2"),
    "list": ("list(f((1, 2))) == [1, 2]", "[1, 2]"),
    "tuple": ("tuple(f([1, 2])) == (1, 2)", "(1, 2)"),
    "dict": ("dict(f([(1, 2)])) == {1: 2}", "{1: 2}"),
    "str": ("str(f(5)) == '5'", "'5'"),
    "int": ("int(f('7')) == 7", "7"),
    "float": ("float(f('1.5')) == 1.5", "1.5"),
    "round": ("round(f(2.4)) == 2", "2"),
    "sum": ("sum(f([1, 2])) == 3", "3"),
    "min": ("min(f([3, 1])) == 1", "1"),
    "max": ("max(f([3, 1])) == 3", "3"),
    "all": ("all(f([1, 1]))", "True"),
    "any": ("any(f([0, 1]))", "True"),
    "isinstance": ("isinstance(f(3), int)", "True"),
    "bool": ("bool(f(1)) is True", "True"),
    "type": ("type(f(1)) == type(1)", "0"),
    "frozenset": ("frozenset(f([1])) == frozenset([1])", "0"),
    "pow": ("pow(f(2), 2) == 4", "4"),
    "divmod": ("divmod(f(7), 2) == (3, 1)", "(3, 1)"),
    "repr": ("repr(f('a')) == \"'a'\"", "\"'a'\""),
    "ord": ("ord(f('a')) == 97", "97"),
    "chr": ("chr(f(97)) == 'a'", "'a'"),
    "hash": ("hash(f('a')) == hash('a')", "0"),
}
IDENTITY, NONE = "def f(x):\n    return x\n", "def f(x):\n    return None\n"


def _builtin_rows(builtin: str) -> dict:
    check = BUILTIN_ASSERTS[builtin][0]
    by_argument = re.sub(r"\bf\(", "candidate(", check)
    return {
        "mbpp": {"test_list": [f"assert {check}"]},
        "humaneval": {"entry_point": "f", "test": f"def check(candidate):\n    assert {by_argument}\n"},
        "humaneval_by_name": {"entry_point": "f", "test": f"def check(candidate):\n    assert {check}\n"},
    }


@pytest.mark.parametrize("fmt", ["mbpp", "humaneval", "humaneval_by_name"])
@pytest.mark.parametrize("builtin", sorted(BUILTIN_ASSERTS))
def test_a_builtin_shadowed_by_the_solution_never_reaches_the_tests(sandbox, builtin, fmt):
    row = _builtin_rows(builtin)[fmt]
    shadow = f"def {builtin}(*args, **kwargs):\n    return {BUILTIN_ASSERTS[builtin][1]}\n"
    assert scores(sandbox, row, [IDENTITY, NONE + shadow]) == [1.0, 0.0], builtin


def test_the_reported_mbpp_hack_scores_zero(sandbox):
    # issue 21: three shadowing definitions made a solution returning None pass 2 of 3 asserts
    row = {"test_list": ["assert set(f([1, 2, 2])) == set([1, 2])", "assert sorted(f([3, 1])) == [1, 3]",
                         "assert abs(f(-2)) == 2"]}
    hack = NONE + "def set(x):\n    return 0\ndef sorted(x):\n    return [1, 3]\ndef abs(x):\n    return 2\n"
    assert scores(sandbox, row, [IDENTITY, hack]) == [1.0, 0.0]


def test_modules_come_from_the_checker_never_the_solution(sandbox):
    imported = {"test_list": ["assert math.isclose(f(0.5), 0.5)"], "test_imports": ["import math"]}
    relied_on = {"test_list": ["assert math.isclose(f(0.5), 0.5)"]}  # MBPP tests that count on the solution's import
    shadows = {
        "function": "def math(*a, **k):\n    return True\n",
        "patched_module": "import math\nmath.isclose = lambda *a, **k: True\n",
        "class": "class math:\n    isclose = staticmethod(lambda *a, **k: True)\n",
    }
    for row in (imported, relied_on):
        assert scores(sandbox, row, ["import math\n" + IDENTITY]) == [1.0]
        assert scores(sandbox, row, [NONE + code for code in shadows.values()]) == [0.0] * 3


def test_tests_get_only_the_names_they_read(sandbox):
    row = {"test_list": ["assert f(2) == 4", "assert 'g' not in globals() and 'CONST' not in globals()",
                         "x = f(3)", "assert x == 6"]}
    code = "CONST = 1\ndef g():\n    return 0\ndef f(n):\n    return 2 * n\n"
    assert scores(sandbox, row, [code]) == [1.0]


def test_humaneval_helpers_come_from_the_prompt(sandbox):
    prompt = ("def encode(s):\n    return s[1:] + s[:1]\n\n"
              "def decode(s):\n    \"\"\"Undo encode.\"\"\"\n")
    row = {"entry_point": "decode",
           "test": "def check(candidate):\n    for s in ('abc', 'hello'):\n        assert candidate(encode(s)) == s\n"}
    honest_body = "    return s[-1:] + s[:-1]\n"
    rigged = "def encode(s):\n    return s\ndef decode(s):\n    return s\n"  # both identity: would pass
    assert scores(sandbox, row, [honest_body, rigged], prompt_code=prompt) == [1.0, 0.0]
    assert scores(sandbox, row, [rigged]) == [0.0]  # no prompt: the test lacks `encode`, never takes the solution's


def test_the_checker_survives_when_the_candidate_misbehaves_later(sandbox):
    # the first assert passes, then the candidate dies: what passed before counts, the rest fails
    code = "calls = []\ndef mul(a, b):\n    calls.append(1)\n    if len(calls) > 1:\n        import os\n" \
           "        os._exit(0)\n    return a * b\n"
    assert scores(sandbox, MBPP_ROW, [code]) == [pytest.approx(1 / 3)]


def test_a_slow_test_ends_the_run_but_keeps_earlier_passes():
    try:
        box = Sandbox(slots=1, limits=Limits(timeout_s=6.0, cpu_s=6, test_timeout_s=1.0))
    except SandboxUnavailable as err:
        pytest.skip(str(err))
    code = "def mul(a, b):\n    while a < 0:\n        pass\n    return a * b\n"
    run = box.execute(make_job(MBPP_ROW, code))
    assert run.status == "ran" and run.passed == {0} and "stopped answering" in run.errors[1]
    assert score(run, MBPP_ROW) == pytest.approx(1 / 3)
    box.close()


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -7, 2**70, 1.5, float("inf"), "é", b"\x00\xff", 1 + 2j, [1, [2]], (1, (2,)), {1, 2},
     frozenset({3}), {"a": 1, (1, 2): [3]}, []],
)
def test_plain_data_round_trips_exactly(value):
    back = plain.decode(plain.encode(value))
    assert back == value and type(back) is type(value)


def test_plain_data_refuses_everything_else():
    class Rigged(int):
        def __eq__(self, other):
            return True

    for value in (Rigged(1), object(), [1, Rigged(2)], {"k": lambda: 0}, iter([1])):
        with pytest.raises(TypeError):
            plain.encode(value)
    nested = []
    for _ in range(200):
        nested = [nested]
    with pytest.raises(TypeError, match="nested too deeply"):
        plain.encode(nested)
    with pytest.raises(ValueError):
        plain.decode({"x": 1})
    nan = plain.decode(plain.encode(float("nan")))
    assert math.isnan(nan)
