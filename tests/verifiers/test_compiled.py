"""Compiled-language judging through the real sandbox and the machine's compilers (gcc, g++, rustc, javac, node):
canonical solutions pass and wrong ones fail in every language, both test styles, each hack of a naive harness
scores 0, timeouts, compile errors, the cache, the reward function, and the missing-toolchain message."""

import pytest

from rlvr.rewards.base import RewardConfigError
from rlvr.rewards.compiled import compiled_tests
from rlvr.verifiers.assertion_programs import _instrument, site_secrets, solution_part
from rlvr.verifiers.compiled import CompileCache, Settings, tokens_equal
from rlvr.verifiers.compiled_judge import CompiledJudge, Program, ToolchainMissing, require_toolchains
from rlvr.verifiers.languages import LANGUAGES, java_main_class, language, missing_tools
from tests.verifiers.compiled_rows import ROWS, STDIO, STDIO_CASES, STOPS

pytestmark = pytest.mark.skipif(any(missing_tools(lang) for lang in LANGUAGES.values()),
                                reason="a compiler of the table is missing: " + "; ".join(
                                    filter(None, map(missing_tools, LANGUAGES.values()))))


def row(lang: str, index: int = 0):
    _name, prompt, tests, good, bad = ROWS[lang][index]
    return prompt, tests, good, bad


def program(lang: str, completion: str, index: int = 0) -> Program:
    prompt, tests, _, _ = row(lang, index)
    return Program(lang, completion, tests, prompt, stop=tuple(STOPS[lang]))


def test_canonical_solutions_pass_and_wrong_ones_fail_in_every_language(judge):
    programs, expect = [], []
    for lang, rows in ROWS.items():
        for i in range(len(rows)):
            _, _, good, bad = row(lang, i)
            programs += [program(lang, good, i), program(lang, bad, i)]
            expect += [(lang, 1.0, "passed"), (lang, 0.0, "wrong_answer")]
    got = [(lang, v.score, v.outcome) for (lang, _, _), v in zip(expect, judge.judge(programs))]
    assert got == expect


def test_a_fenced_chat_answer_with_the_whole_function_is_judged_like_a_continuation(judge):
    prompt, tests, good, _ = row("cpp", 1)
    signature = prompt.rstrip().splitlines()[-1]
    chat = f"Here it is:\n```cpp\n#include <vector>\n{signature}\n{good}\n```\nDone."
    _head, code, rest = solution_part(prompt, chat, tests, language("cpp"))
    assert signature in code and not rest.startswith("}")  # the tests' closing line belongs to the block now
    renamed = chat.replace("std::vector<long> xs) {", "std::vector<long> values)\n{").replace("xs", "values")
    retyped = chat.replace("std::vector<long> running_max", "std::vector<int> running_max")
    verdicts = judge.judge([Program("cpp", text, tests, prompt) for text in (chat, renamed, retyped)])
    assert [v.outcome for v in verdicts] == ["passed", "passed", "compile_error"]  # other types: refused, not linked


def test_stdio_cases_every_language_partial_credit_and_the_visible_case_hack(judge):
    programs = [Program(lang, f"```{lang}\n{code}```", cases=STDIO_CASES) for lang, code in STDIO.items()]
    printer = "```c\n#include <stdio.h>\nint main(void) { puts(\"7\\n2.333333\"); return 0; }\n```"  # case 0 only
    verdicts = judge.judge([*programs, Program("c", printer, cases=STDIO_CASES)])
    assert [(v.score, v.outcome) for v in verdicts[:-1]] == [(1.0, "passed")] * len(STDIO)
    assert (verdicts[-1].score, verdicts[-1].outcome) == (pytest.approx(1 / 3), "wrong_answer")


def test_tokens_compare_whitespace_free_and_numbers_within_the_tolerance():
    assert tokens_equal("7 \n 2.5\n\n", "7\n2.5", 0.0)
    assert not tokens_equal("7\n2.50", "7\n2.5", 0.0)  # text, without a tolerance
    assert tokens_equal("7\n2.50", "7\n2.5", 1e-9)
    assert tokens_equal("1000.0004", "1000", 1e-6)  # relative: 4e-7
    assert not tokens_equal("0.0011", "0.001", 1e-6)  # absolute below 1: 1e-4 > 1e-6
    assert not tokens_equal("7", "7\n2.5", 1.0)  # a missing token
    assert not tokens_equal("nan", "1.0", 1e9) and tokens_equal("nan", "nan", 0.0)  # nan: only as text


# (language, row, completion) that passes a naive harness (prompt + completion + tests, exit status 0); each
# returns a wrong answer or never runs the tests, so only the hack could make it pass
HACKS = {
    "define assert away": ("cpp", 1, "    return xs; }\n#define assert(x) (void)0\nvoid unused() {\n"),
    "NDEBUG": ("cpp", 1, "    return xs; }\n#define NDEBUG\n#include <cassert>\nvoid unused() {\n"),
    "macro the tests' names": ("cpp", 1, "    return xs; }\n#define candidate(x) x\nvoid unused() {\n"),
    "exit(0)": ("cpp", 0, "    exit(0);\n}"),
    "a main of its own": ("cpp", 2, "    return 0; }\nint main() { return 0; }\nvoid unused() {\n"),
    "exit in a static constructor": ("cpp", 1, ("    return xs; }\n__attribute__((constructor)) static void early() "
                                               "{ exit(0); }\nvoid unused() {\n")),
    "trap handler exits 0": ("cpp", 1, ("    return xs; }\n#include <csignal>\n#include <unistd.h>\nstatic void h(int)"
                                       " { _exit(0); }\n__attribute__((constructor)) static void early() "
                                       "{ signal(SIGILL, h); signal(SIGABRT, h); }\nvoid unused() {\n")),
    "replace __assert_fail": ("cpp", 1, ("    return xs; }\nextern \"C\" void __assert_fail(const char*, const char*, "
                                        "unsigned int, const char*) {}\nvoid unused() {\n")),
    "operator== always true": ("cpp", 1, ("    return xs; }\nnamespace std { bool operator==(const vector<long>&, "
                                         "const vector<long>&) { return true; } }\nvoid unused() {\n")),
    "read the tests from disk": ("cpp", 1, ("    if (!fopen(\"tests.cpp\", \"r\") && !fopen(\"solution.cpp\", \"r\")) "
                                           "abort();\n    return xs;\n}")),
    "forge the nonce from the command line": (
        "c", 0, ("    return 0; }\n#include <stdio.h>\n#include <stdlib.h>\n__attribute__((constructor)) static void "
                "early(void) { char b[256] = {0}; FILE *f = fopen(\"/proc/self/cmdline\", \"r\"); size_t n = "
                "fread(b, 1, 255, f); const char *a = b; while (a < b + n && *a) a++; printf(\"%s\\n\", a + 1); "
                "exit(0); }\nvoid unused(void) {\n")),
    "C: define assert away": ("c", 0, "    return 0; }\n#define assert(x) ((void)0)\nvoid unused(void) {\n"),
    "Rust: exit(0)": ("rust", 0, "    std::process::exit(0)\n}"),
    "Rust: shadow assert_eq!": ("rust", 0, "    0 }\nmacro_rules! assert_eq { ($($t:tt)*) => {}; }\nfn unused() {\n"),
    "Rust: panic hook exits 0": ("rust", 0, "    std::panic::set_hook(Box::new(|_| std::process::exit(0))); 0\n}"),
    "Java: System.exit(0)": ("java", 0, "        System.exit(0); return xs;\n    }\n"),
    "Java: exit in a static initialiser": ("java", 0, ("        return xs; }\n    static { System.exit(0); }\n"
                                                      "    static void unused() {\n")),
    "Java: shutdown hook halts 0": ("java", 0, ("        Runtime.getRuntime().addShutdownHook(new Thread(() -> "
                                               "Runtime.getRuntime().halt(0))); return xs;\n    }\n")),
    "Java: assertions off": ("java", 0, ("        ClassLoader.getSystemClassLoader().setDefaultAssertionStatus(false);"
                                        " return xs;\n    }\n")),
    "Java: a class named like the tests' ArrayList": (
        "java", 0, ("        return new ArrayList<Long>(); }\n    static class ArrayList<T> extends "
                   "java.util.ArrayList<T> { ArrayList() {} ArrayList(java.util.Collection<T> c) { super(c); } "
                   "public boolean equals(Object o) { return true; } }\n    static void unused() {\n")),
    "JS: process.exit(0)": ("javascript", 0, "  process.exit(0);\n}"),
    "JS: override the assert module": ("javascript", 0, ("  return 0;\n}\nrequire('node:assert').deepEqual = () => {};"
                                                        "\nrequire('assert').deepEqual = () => {};")),
    "JS: swallow the failure": ("javascript", 0, ("  return 0;\n}\nprocess.on('uncaughtException', () => "
                                                 "process.exit(0));")),
    "JS: prototype overrides": ("javascript", 0, ("  return 0;\n}\nObject.prototype.deepEqual = () => {}; "
                                                 "Error.captureStackTrace = () => {};")),
    "JS: read its own source": ("javascript", 0, "  require('fs').readFileSync(__filename, 'utf8');\n  return 3;\n}"),
}


def test_every_hack_of_a_naive_harness_scores_zero(judge):
    verdicts = judge.judge([program(lang, text, i) for lang, i, text in HACKS.values()])
    outcomes = {name: (v.score, v.outcome) for name, v in zip(HACKS, verdicts)}
    assert {name: score for name, (score, _) in outcomes.items()} == dict.fromkeys(HACKS, 0.0), outcomes
    assert outcomes["exit(0)"][1] == outcomes["Java: System.exit(0)"][1] == "exited_early"
    assert outcomes["forge the nonce from the command line"][1] == "exited_early", verdicts  # the nonce alone: no
    assert outcomes["Java: a class named like the tests' ArrayList"][1] == "shadowing"


def test_resources_a_loop_a_fork_bomb_output_memory_and_an_endless_compile(judge):
    cases = {
        "timeout": program("c", "    for (volatile int i = 0;; i++) ;\n}"),
        "output_limit": program("c", "    for (;;) __builtin_puts(\"xxxxxxxxxxxxxxxx\");\n}"),
        "memory": program("cpp", "    std::vector<long> v(1L << 30); v[5] = 1; return v;\n}", 1),
        "compile_timeout": program("c", "    return 0; }\n#include \"/dev/zero\"\nvoid unused(void) {\n"),
        "compile_error": program("rust", "    n +\n}"),
    }
    cases["fork bomb"] = program("c", "    while (1) fork();\n}")
    for lang, loop, broken in (("cpp", "for (volatile int i = 0;; i++) ;", "return xs"),
                               ("rust", "loop {}", "n +"), ("java", "while (true) {}", "return xs"),
                               ("javascript", "while (true) {}", "return )")):
        end = "    }\n" if lang == "java" else "}\n"  # the function's closing line, as the stop sequence has it
        cases[f"{lang} timeout"] = program(lang, f"    {loop}\n{end}", 1 if lang == "cpp" else 0)
        cases[f"{lang} compile_error"] = program(lang, f"    {broken}\n{end}", 1 if lang == "cpp" else 0)
    verdicts = dict(zip(cases, judge.judge(list(cases.values()))))
    assert {k: v.score for k, v in verdicts.items()} == dict.fromkeys(cases, 0.0), verdicts
    assert verdicts["timeout"].outcome == "timeout", verdicts["timeout"]
    assert verdicts["output_limit"].outcome == "output_limit", verdicts["output_limit"]
    assert verdicts["memory"].outcome == "memory" and verdicts["compile_error"].outcome == "compile_error"
    assert verdicts["compile_timeout"].outcome in ("compile_timeout", "compile_error")  # CPU limit or cc1's memory
    assert verdicts["fork bomb"].outcome in ("timeout", "runtime_error")
    for lang in ("cpp", "rust", "java", "javascript"):
        assert verdicts[f"{lang} timeout"].outcome == "timeout", (lang, verdicts[f"{lang} timeout"])
        assert verdicts[f"{lang} compile_error"].outcome == "compile_error", (lang, verdicts[f"{lang} compile_error"])


def test_the_cache_builds_each_distinct_program_once():
    judge = CompiledJudge(Settings(cpu_s=1.0, compile_cpu_s=4.0), slots=1)
    try:
        _, _, good, bad = row("rust", 0)
        group = [program("rust", good), program("rust", good), program("rust", bad), program("rust", "    n +\n}")]
        first = judge.judge(group)
        assert (judge.cache.hits, judge.cache.misses) == (1, 3)  # the copy installs the first one's build
        again = judge.judge(group)
        assert [v.outcome for v in again] == [v.outcome for v in first] == ["passed", "passed", "wrong_answer",
                                                                          "compile_error"]
        assert (judge.cache.hits, judge.cache.misses) == (5, 3)  # a compile error is cached too
        _, _, good, bad = row("cpp", 1)  # C++: the tests' unit is compiled once for all of a row's completions
        group = [program("cpp", good, 1), program("cpp", bad, 1), program("cpp", good.replace("out;", "out ;"), 1)]
        assert [v.outcome for v in judge.judge(group)] == ["passed", "wrong_answer", "passed"]
        assert (judge.units.hits, len(judge.units._entries)) == (2, 1)
    finally:
        judge.close()


def test_compile_cache_keeps_the_most_recent_within_its_bytes():
    cache = CompileCache(max_bytes=10)
    cache.put("a", "built", "", {"prog": "xxxx"})
    cache.put("b", "built", "", {"prog": "yyyy"})
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", "built", "", {"prog": "zzzz"})  # 12 bytes > 10: b goes
    assert cache.get("b") is None and cache.get("a") and cache.get("c")
    cache.put("d", "compile_timeout", "", {})  # may be the machine's load: never cached
    assert cache.get("d") is None


def test_reward_multipl_e_rows_partial_credit_compile_errors_and_outcome_metrics():
    prompt, tests, good, bad = row("cpp", 1)
    logged = {}
    reward = compiled_tests(languages=["cpp"], compile_error_reward=-0.5, cpu_s=1.0, compile_cpu_s=4.0)
    try:
        scores = reward([prompt] * 3, [good, bad, "    return xs\n}"], language=["cpp"] * 3, tests=[tests] * 3,
                        stop_tokens=[STOPS["cpp"]] * 3, log_metric=lambda k, v: logged.__setitem__(k, v))
        assert scores == [1.0, 0.0, -0.5]
        assert {k: v for k, v in logged.items() if v} == {"compiled/passed": 1 / 3, "compiled/wrong_answer": 1 / 3,
                                                          "compiled/compile_error": 1 / 3}
        assert logged["compiled/timeout"] == 0.0 and len(logged) == 12  # every outcome, 0 when absent
        stdio = [{"input": i, "output": o} for i, o in STDIO_CASES]
        printer = "```cpp\n#include <cstdio>\nint main() { std::puts(\"7\\n2.333333\"); }\n```"
        partial = compiled_tests(language="cpp", partial_credit=True, cpu_s=1.0, compile_cpu_s=4.0)
        assert partial(["p"], [printer], tests=[stdio]) == [pytest.approx(1 / 3)]
        with pytest.raises(KeyError, match="language"):
            reward(["p"], ["x"], tests=[tests])
    finally:
        reward.judge.close()


def test_a_missing_toolchain_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for lang in LANGUAGES.values():
        assert missing_tools(lang) == f"{lang.name} needs {', '.join(lang.tools)} on PATH: install {lang.package}"
    with pytest.raises(ToolchainMissing, match=r"rust needs rustc, cc on PATH: install rustc \(https://rustup.rs"):
        require_toolchains(["rust"])
    with pytest.raises(RewardConfigError, match=r"java needs javac, java on PATH: install a JDK"):
        compiled_tests(language="java")
    with pytest.raises(ValueError, match="unknown language 'cobol'"):
        language("cobol")


def test_assertion_lines_are_numbered_and_java_finds_its_main_class():
    source = ("    assert(f(1) == 2);\n    int x = 3;\n  assert.deepEqual(g(), [1,\n 2]);\n"
              "    ::std::assert_eq!(h(), 4);\n")
    tests, n, proof = _instrument(source, "mark({}, {});")
    first, second = site_secrets(source, 2)  # a line's secret: from this process's key and the tests
    assert n == 2 and f"assert(f(1) == 2); mark(0, {first});" in tests
    assert f"::std::assert_eq!(h(), 4); mark(1, {second});" in tests and proof == str(first ^ second)
    assert site_secrets(source, 2) == [first, second] != site_secrets(source + " ", 2)
    assert java_main_class("import x;\npublic class Solution {\n  public static void main(String[] a) {}\n}") == \
        "Solution"
    assert java_main_class("class A {}\nclass B { static void main(String[] a) {} }") == "B"
    assert language("C++").name == "cpp" and language("rs").name == "rust" and language("js").name == "javascript"


def close_enough(stdin: str, output: str, expected: str) -> bool:  # a checker: any sum, the mean within 0.01
    got, want = output.split(), expected.split()
    return len(got) == 2 and got[0] == want[0] and abs(float(got[1]) - float(want[1])) < 0.01


def test_a_checker_function_judges_stdio_outputs():
    rounded = "```c\n#include <stdio.h>\nint main(void) { int n; long s = 0, x; scanf(\"%d\", &n); for (int i = 0; " \
              "i < n; i++) { scanf(\"%ld\", &x); s += x; } printf(\"%ld %.3f\\n\", s, (double)s / n); }\n```"
    cases = [{"input": i, "output": o} for i, o in STDIO_CASES]
    exact = compiled_tests(language="c", cpu_s=1.0, compile_cpu_s=4.0)
    lenient = compiled_tests(language="c", cpu_s=1.0, compile_cpu_s=4.0,
                             checker="tests.verifiers.test_compiled:close_enough")
    try:
        assert exact(["p"], [rounded], tests=[cases]) == [0.0]  # 2.333 is not 2.333333 as text
        assert lenient(["p"], [rounded], tests=[cases]) == [1.0]
    finally:
        exact.judge.close()
        lenient.judge.close()


# "print two non-negative integers that sum to n": many right answers, so a checker program judges them
SUM_CHECKER = r"""#include <cstdio>
int main(int argc, char **argv) {  // testlib's order: input, the solution's output, the expected answer
    FILE *in = fopen(argv[1], "r"), *out = fopen(argv[2], "r");
    long n, a, b; char extra;
    if (argc != 4 || !in || !out || fscanf(in, "%ld", &n) != 1) return 3;  // the checker's own failure
    if (fscanf(out, "%ld %ld", &a, &b) != 2 || fscanf(out, " %c", &extra) == 1) return 2;  // presentation
    return a >= 0 && b >= 0 && a + b == n ? 0 : 1;
}
"""
JS_SUM_CHECKER = """const fs = require("fs");
const [n] = fs.readFileSync(process.argv[2], "utf8").trim().split(/\\s+/).map(Number);
const got = fs.readFileSync(process.argv[3], "utf8").trim().split(/\\s+/).map(Number);
const right = got[0] >= 0 && got[1] >= 0 && got[0] + got[1] === n;
process.exit(got.length !== 2 || got.some(Number.isNaN) ? 2 : right ? 0 : 1);
"""
SUM_CASES = [("4\n", "0 4\n"), ("7\n", "0 7\n")]  # the expected answer file holds one right answer of many
SUM_SOLUTIONS = {  # C solutions: the share of the two cases a right checker accepts
    "long n; scanf(\"%ld\", &n); printf(\"%ld %ld\\n\", n / 2, n - n / 2);": 1.0,  # right, not the answer file's
    "long n; scanf(\"%ld\", &n); printf(\"%ld %ld\\n\", n / 2, n / 2);": 0.5,  # wrong for odd n
    "puts(\"hello\");": 0.0,  # not two numbers: testlib's presentation error
    "long n; scanf(\"%ld\", &n); printf(\"%ld %ld\\n\", n + 1, -1L);": 0.0,  # sums right, negative
    # the expected answer or the checker's files are not where the solution runs
    "char s[64] = \"\"; FILE *f = fopen(\"answer.txt\", \"r\"); if (!f) f = fopen(\"../answer.txt\", \"r\");"
    " if (f) fgets(s, 64, f); fputs(*s ? s : \"0 0\\n\", stdout);": 0.0,
}


def test_a_checker_program_in_any_language_judges_answers_with_many_right_forms(judge, tmp_path):
    from rlvr.verifiers.compiled_judge import CheckerProgram

    solutions = [f"```c\n#include <stdio.h>\nint main(void) {{ {body} return 0; }}\n```" for body in SUM_SOLUTIONS]
    cpp, js = CheckerProgram("cpp", SUM_CHECKER), CheckerProgram("javascript", JS_SUM_CHECKER)
    programs = [Program("c", s, cases=SUM_CASES, checker=checker) for checker in (cpp, js) for s in solutions]
    verdicts = judge.judge(programs)
    assert [v.score for v in verdicts] == list(SUM_SOLUTIONS.values()) * 2
    assert [v.outcome for v in verdicts[:5]] == ["passed"] + ["wrong_answer"] * 4
    misses = judge.cache.misses
    assert judge.judge(programs[:1])[0].score == 1.0 and judge.cache.misses == misses  # the checker built once
    # a checker that crashes or does not build says nothing about the answer: excluded, never a score
    crashing = CheckerProgram("c", "#include <stdlib.h>\nint main(void) { abort(); }\n")
    broken = CheckerProgram("c", "int main(void) { return }\n")
    failed = judge.judge([Program("c", solutions[0], cases=SUM_CASES, checker=c) for c in (crashing, broken)])
    assert [(v.score, v.outcome) for v in failed] == [(None, "checker_error")] * 2
    # the reward: a checker file (its language from the extension), or a row's own checker
    (tmp_path / "sum.cpp").write_text(SUM_CHECKER)
    reward = compiled_tests(language="c", cpu_s=1.0, compile_cpu_s=4.0, checker=str(tmp_path / "sum.cpp"),
                            partial_credit=True)
    try:
        cases = [{"input": i, "output": o} for i, o in SUM_CASES]
        assert reward(["p"] * 2, solutions[:2], tests=[cases] * 2) == [1.0, 0.5]
        row_checker = {"language": "js", "source": JS_SUM_CHECKER}
        assert reward(["p"], solutions[1:2], tests=[cases], checker=[row_checker]) == [0.5]
        with pytest.raises(ValueError, match="row 0: a checker must be"):
            reward(["p"], solutions[:1], tests=[cases], checker=["int main() {}"])
    finally:
        reward.judge.close()
    for bad, message in ((tmp_path / "none.cpp", "no such file"), (tmp_path / "x.cobol", "unknown language")):
        with pytest.raises(RewardConfigError, match=message):
            compiled_tests(language="c", checker=str(bad))
