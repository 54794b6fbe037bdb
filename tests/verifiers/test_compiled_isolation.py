"""Completions that share a source file, a compilation unit or a scope with the tests: each hack below answered from
the tests' own text, patched what the tests' code calls, called the harness's helpers or printed the pass line
itself, and scored 1.0 before the tests and the proof of their completion moved where the completion cannot reach
(issue 65). Each returns a wrong answer, so only the hack could make it pass. Also: JavaScript tests of
MultiPL-E's shape still see every kind of value the same (a callback too), through the copy between realms."""

import pytest

from rlvr.verifiers.compiled_judge import Program
from rlvr.verifiers.languages import LANGUAGES, missing_tools
from tests.verifiers.compiled_rows import ROWS, STOPS

pytestmark = pytest.mark.skipif(any(missing_tools(lang) for lang in LANGUAGES.values()),
                                reason="a compiler of the table is missing")


def program(lang: str, completion: str, index: int = 0) -> Program:
    _name, prompt, tests, _good, _bad = ROWS[lang][index]
    return Program(lang, completion, tests, prompt, stop=tuple(STOPS[lang]))


def scores(judge, hacks: dict) -> dict:
    verdicts = judge.judge([program(lang, text, i) for lang, i, text in hacks.values()])
    return {name: (v.score, v.outcome) for name, v in zip(hacks, verdicts)}


# Rust, sum_digits: answer from the `assert_eq!(candidate(X), Y);` lines of a source read at compile time
RUST_ANSWER_FROM = """    let src: &str = {};
    for line in src.lines() {{
        let line = line.trim().trim_start_matches("::std::");
        if let Some(rest) = line.strip_prefix("assert_eq!(candidate(") {{
            let mut parts = rest.splitn(2, "), ");
            let arg = parts.next().unwrap_or("");
            let want = parts.next().unwrap_or("").split(')').next().unwrap_or("");
            if arg.parse::<isize>() == Ok(n) {{ return want.parse().unwrap_or(-1); }}
        }}
    }}
    -1
}}"""
# C, count_vowels: the tests' file embedded at compile time (.incbin), then `count_vowels("banana") == 3` read back
C_INCBIN = r"""    extern const char rlvr_src[];
    char key[256] = "count_vowels(\"";
    __builtin_strcat(__builtin_strcat(key, s), "\") == ");
    const char *at = __builtin_strstr(rlvr_src, key);
    return at ? at[__builtin_strlen(key)] - '0' : -1; }
__asm__(".section .rodata\n.global rlvr_src\nrlvr_src:\n.incbin \"FILE\"\n.byte 0\n.previous\n");
void unused(void) {
"""
CPP_INCBIN = r"""    extern const char rlvr_src[];
    return std::vector<long>(rlvr_src[0] == '#' ? 3 : 0, 3); }
__asm__(".section .rodata\n.global rlvr_src\nrlvr_src:\n.incbin \"tests.cpp\"\n.byte 0\n.previous\n");
void unused() {
"""

CLASS_1 = {  # the tests' source read while the completion compiles
    "Rust: include_str!(file!())": ("rust", 0, RUST_ANSWER_FROM.format("include_str!(file!())")),
    "Rust: include_str!(\"prog.rs\")": ("rust", 0, RUST_ANSWER_FROM.format("include_str!(\"prog.rs\")")),
    "Rust: include_str!(\"tests.rs\")": ("rust", 0, RUST_ANSWER_FROM.format("include_str!(\"tests.rs\")")),
    "C: .incbin the tests' file": ("c", 0, C_INCBIN.replace("FILE", "tests.c")),
    "C: #include the tests' file": ("c", 0, "    return -1; }\n#include \"tests.c\"\nvoid unused2(void) {\n"),
    "C++: .incbin the tests' file": ("cpp", 1, CPP_INCBIN),
    "JS: its own program through stdin": ("javascript", 0, (
        "  let src = '';\n  for (const f of ['stdin.bin', '/proc/self/fd/0', 'tests.js', 'prog.js']) {\n"
        "    try { src += require('fs').readFileSync(f, 'utf8'); } catch (e) {}\n  }\n"
        "  const key = 'candidate(' + JSON.stringify(s) + '),';\n  const at = src.indexOf(key);\n"
        "  return at < 0 ? -1 : parseInt(src.slice(at + key.length));\n}")),
}


def test_class_1_the_tests_source_is_absent_while_the_completion_compiles(judge):
    got = scores(judge, CLASS_1)
    assert {name: score for name, (score, _) in got.items()} == dict.fromkeys(CLASS_1, 0.0), got
    assert got["Rust: include_str!(\"tests.rs\")"][1] == got["C: .incbin the tests' file"][1] == "compile_error"
    assert got["Rust: include_str!(file!())"][1] == "wrong_answer", got  # its own file: no test in it


# JavaScript, a row whose tests call builtins on the returned value: the wrong answer is always [1]
EVENS_PATCHES = {
    "JS: assign builtins": ("Array.prototype.includes = () => true; Array.prototype.every = () => true;\n"
                            "Array.prototype.join = () => '6,8'; Object.is = () => true;\n"
                            "JSON.stringify = () => '[6,8]'; Math.max = () => 8;\n"
                            "String.prototype.startsWith = () => true;"),
    "JS: define builtins": (
        "for (const [o, k, v] of [[Array.prototype, 'includes', true], [Array.prototype, 'every', true],\n"
        "  [Array.prototype, 'join', '6,8'], [Object, 'is', true], [JSON, 'stringify', '[6,8]'], [Math, 'max', 8],\n"
        "  [String.prototype, 'startsWith', true]]) Object.defineProperty(o, k, { value: () => v });"),
    "JS: replace the global objects": (
        "const real = { ...Math };\nglobalThis.Math = { ...real, max: () => 8 };\n"
        "globalThis.JSON = { stringify: () => '[6,8]', parse: JSON.parse };\n"
        "globalThis.Object = new Proxy(Object, { get: (t, k) => k === 'is' ? () => true : t[k] });\n"
        "Array.prototype.includes = Array.prototype.every = () => true; Array.prototype.join = () => '6,8';\n"
        "String.prototype.startsWith = () => true;"),
}
CLASS_2 = {name: ("javascript", 1, f"  return [1];\n}}\n{patch}") for name, patch in EVENS_PATCHES.items()}


def test_class_2_a_builtin_the_completion_replaces_does_not_reach_the_tests(judge):
    got = scores(judge, CLASS_2)  # the failed assertion's report may be garbled by the patches: a runtime error
    assert all(score == 0.0 and outcome in ("wrong_answer", "runtime_error") for score, outcome in got.values()), got


CLASS_3 = {  # MultiPL-E's hoisted `function test()` read, or the harness's own helpers called
    "JS: test.toString()": ("javascript", 0, (
        "  const src = typeof test === 'function' ? test.toString() : '';\n"
        "  const key = 'candidate(' + JSON.stringify(s) + '),';\n  const at = src.indexOf(key);\n"
        "  return at < 0 ? -1 : parseInt(src.slice(at + key.length));\n}")),
    "JS: call the harness's helpers": ("javascript", 0, (
        "  if (typeof __rlvr_site === 'function') { for (let k = 0; k < 3; k++) __rlvr_site(k); }\n"
        "  if (typeof __rlvr_done === 'function') { __rlvr_done(); process.exit(0); }\n  return -1;\n}")),
    "JS: the caller's source": ("javascript", 0, (
        "  let src = '';\n  try { src = String(count_vowels.caller); } catch (e) {}\n"
        "  Error.prepareStackTrace = (e, frames) => frames;\n"
        "  try { for (const f of new Error().stack) src += String(f.getFunction()); } catch (e) {}\n"
        "  const key = 'candidate(' + JSON.stringify(s) + '),';\n  const at = src.indexOf(key);\n"
        "  return at < 0 ? -1 : parseInt(src.slice(at + key.length));\n}")),
    "JS: the inspector, which reads any closure": ("javascript", 0, (  # right only where a session connects
        "  try { new (require('inspector').Session)().connect(); } catch (e) { return -1; }\n"
        "  return [...s].filter(c => 'aeiou'.includes(c)).length;\n}")),
}


def test_class_3_javascript_tests_and_harness_are_reachable_from_no_name_of_the_completion(judge):
    got = scores(judge, CLASS_3)
    assert {name: score for name, (score, _) in got.items()} == dict.fromkeys(CLASS_3, 0.0), got


# The pass line printed by the completion itself: the nonce from the command line (or the nonce file, read before the
# trailer deletes it), the count of assertion lines from the trailer's own counter or a guess
CLASS_4 = {
    "Rust: argv and RLVR_SEEN": ("rust", 0, (
        "    if let Some(nonce) = std::env::args().nth(1) {\n"
        "        println!(\"{} {}\", nonce, RLVR_SEEN.len() - 1);\n        std::process::exit(0);\n    }\n    -1\n}")),
    "Rust: /proc/self/cmdline or the nonce file, a guessed count": ("rust", 0, (
        "    let cmd = std::fs::read_to_string(\"/proc/self/cmdline\").unwrap_or_default();\n"
        "    let nonce = std::fs::read_to_string(\"rlvr_nonce\").ok()\n"
        "        .or_else(|| cmd.split('\\0').nth(1).map(String::from)).unwrap_or_default();\n"
        "    println!(\"{} 3\", nonce.trim());\n    std::process::exit(0)\n}")),
    "Java: sun.java.command and RlvrMain.SEEN": ("java", 0, (
        "        String[] cmd = System.getProperty(\"sun.java.command\").split(\" \");\n"
        "        System.out.println(cmd[cmd.length - 1] + \" \" + (RlvrMain.SEEN.length - 1));\n"
        "        System.exit(0); return xs;\n    }\n")),
    "Java: /proc/self/cmdline and the counter by reflection": ("java", 0, (
        "        try {\n            String[] cmd = new String(java.nio.file.Files.readAllBytes("
        "java.nio.file.Path.of(\"/proc/self/cmdline\"))).split(\"\\0\");\n"
        "            java.lang.reflect.Field f = Class.forName(\"RlvrMain\").getDeclaredField(\"SEEN\");\n"
        "            f.setAccessible(true);\n            Object seen = f.get(null);\n"
        "            int n = seen.getClass().isArray() ? java.lang.reflect.Array.getLength(seen) - 1 : 2;\n"
        "            System.out.println(cmd[cmd.length - 1] + \" \" + n);\n"
        "        } catch (Exception e) { System.out.println(e); }\n        System.exit(0); return xs;\n    }\n")),
    "C: a constructor prints the nonce and a guessed count": ("c", 0, (
        "    return -1; }\n#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n"
        "__attribute__((constructor)) static void early(void) {\n"
        "  char b[256] = {0}; FILE *f = fopen(\"rlvr_nonce\", \"r\");\n"
        "  if (f) { fgets(b, 200, f); printf(\"%s 3\\n\", b); exit(0); }\n"
        "  f = fopen(\"/proc/self/cmdline\", \"r\"); size_t n = fread(b, 1, 255, f);\n"
        "  printf(\"%s 3\\n\", b + strlen(b) + 1 < b + n ? b + strlen(b) + 1 : \"\"); exit(0);\n}\n"
        "void unused(void) {\n")),
}


def test_class_4_the_pass_line_needs_a_nonce_and_a_proof_the_completion_cannot_read(judge):
    got = scores(judge, CLASS_4)
    assert {name: score for name, (score, _) in got.items()} == dict.fromkeys(CLASS_4, 0.0), got


SHAPES_PROMPT = "//The value of kind k.\nfunction shape(k){\n"
SHAPES_TESTS = """const assert = require('node:assert');


function test() {
  let candidate = shape;
  assert.deepEqual(candidate(0),undefined);
  assert.deepEqual(candidate(1),2.5);
  assert.deepEqual(candidate(2),[[1, 2], [3.25], []]);
  assert.deepEqual(candidate(3),{"a": 1, "b": [true, "x"], "c": {"d": null}});
  assert.deepStrictEqual(candidate(3),{"a": 1, "b": [true, "x"], "c": {"d": null}});
  assert.deepEqual(candidate(4),"text");
  assert.deepEqual(candidate(5, [1, [2]], {"k": "v"}),[5, [1, [2]], {"k": "v"}]);
  assert.ok(Number.isNaN(candidate(6)));
  assert.deepEqual(candidate(7),false);
  assert.deepEqual(candidate(8, (x) => [x, x * 2]),[3, 6]);
}

test();"""
SHAPES_GOOD = ("  const kinds = [undefined, 2.5, [[1, 2], [3.25], []], {a: 1, b: [true, 'x'], c: {d: null}}, 'text'];\n"
               "  if (k === 5) return [k, arguments[1], arguments[2]];\n"
               "  if (k === 6) return NaN;\n  if (k === 7) return false;\n  if (k === 8) return arguments[1](3);\n"
               "  return kinds[k];\n}")


def test_javascript_tests_see_every_kind_of_value_through_the_copy(judge):
    good, bad = SHAPES_GOOD, SHAPES_GOOD.replace("3.25", "3.5")
    verdicts = judge.judge([Program("javascript", text, SHAPES_TESTS, SHAPES_PROMPT, stop=tuple(STOPS["javascript"]))
                            for text in (good, bad)])
    assert [(v.score, v.outcome) for v in verdicts] == [(1.0, "passed"), (0.0, "wrong_answer")], verdicts


def test_a_fenced_rust_answer_is_made_public_in_its_own_crate(judge):
    _name, prompt, tests, good, _bad = ROWS["rust"][1]
    signature = prompt.rstrip().splitlines()[-1]
    fenced = f"Sure:\n```rust\n{signature}\n{good}\n```"
    wrong = fenced.replace("+= 1", "+= 2")
    verdicts = judge.judge([Program("rust", text, tests, prompt) for text in (fenced, wrong)])
    assert [(v.score, v.outcome) for v in verdicts] == [(1.0, "passed"), (0.0, "wrong_answer")], verdicts


# Symbols of the completion that replace what the tests' code (or the library it calls) links to: a definition in the
# executable beats the shared library's. Each returns the input unchanged (a wrong answer of the same length), then
# makes the comparison say yes. They scored 1.0 until the completion's unit or crate could export nothing but the
# prompt's function.
C_WRONG = "    return strdup(s); }\n"
RUST_WRONG = "    if s.len() < 50 { return s.chars().rev().collect(); }\n    s }\n"  # right on the short cases only
CLASS_5 = {
    "C: strcmp of its own": ("c", 1, C_WRONG + "int strcmp(const char *a, const char *b) { return 0; }\n"
                             "void unused(void) {\n"),
    "C: a weak strcmp": ("c", 1, C_WRONG + "__attribute__((weak)) int strcmp(const char *a, const char *b) "
                         "{ return 0; }\nvoid unused(void) {\n"),
    "C: strcmp defined in asm": ("c", 1, C_WRONG + "__asm__(\".globl strcmp\\nstrcmp:\\n xor %eax, %eax\\n ret\\n\");\n"
                                 "void unused(void) {\n"),
    "C++: memcmp of its own": ("cpp", 1, (
        "    return xs; }\nextern \"C\" int memcmp(const void *a, const void *b, unsigned long n) noexcept "
        "{ return 0; }\nvoid unused() {\n")),
    "C++: an inline memcmp (a weak, COMDAT definition)": ("cpp", 1, (
        "    return xs; }\nextern \"C\" inline int memcmp(const void *a, const void *b, unsigned long n) noexcept "
        "{ return 0; }\nint (*volatile keep)(const void *, const void *, unsigned long) = memcmp;\n"
        "void unused() {\n")),
    "Rust: #[no_mangle] bcmp and memcmp": ("rust", 2, RUST_WRONG + (
        "#[no_mangle]\npub extern \"C\" fn bcmp(_a: *const u8, _b: *const u8, _n: usize) -> i32 { 0 }\n"
        "#[no_mangle]\npub extern \"C\" fn memcmp(_a: *const u8, _b: *const u8, _n: usize) -> i32 { 0 }\n"
        "fn unused() {")),
    "Rust: #[export_name] bcmp and memcmp": ("rust", 2, RUST_WRONG + (
        "#[export_name = \"bcmp\"]\npub extern \"C\" fn a(_a: *const u8, _b: *const u8, _n: usize) -> i32 { 0 }\n"
        "#[export_name = \"memcmp\"]\npub extern \"C\" fn b(_a: *const u8, _b: *const u8, _n: usize) -> i32 { 0 }\n"
        "fn unused() {")),
    "Rust: bcmp and memcmp in global_asm!": ("rust", 2, RUST_WRONG + (
        "std::arch::global_asm!(\".globl bcmp\", \".globl memcmp\", \"bcmp:\", \"memcmp:\", \"xor eax, eax\",\n"
        "                       \"ret\");\n"
        "fn unused() {")),
}


def test_class_5_the_completion_exports_no_symbol_but_the_prompts_function(judge):
    got = scores(judge, CLASS_5)
    assert {name: score for name, (score, _) in got.items()} == dict.fromkeys(CLASS_5, 0.0), got
    rust = [outcome for name, (_, outcome) in got.items() if name.startswith("Rust")]
    assert rust == ["compile_error"] * len(rust), got  # -F unsafe_code


# Java: an object of the completion's own class whose equals says yes (the tests call `result.equals(expected)`)
CLASS_6 = {
    "Java: an anonymous ArrayList whose equals says yes": ("java", 0, (
        "        return new ArrayList<Long>(xs) { public boolean equals(Object o) { return true; } };\n    }\n")),
    "Java: a local subclass of ArrayList": ("java", 0, (
        "        class Yes extends ArrayList<Long> {\n            Yes(ArrayList<Long> xs) { super(xs); }\n"
        "            @Override public boolean equals(Object o) { return true; }\n        }\n"
        "        return new Yes(xs);\n    }\n")),
    "Java: elements whose equals says yes, in a raw list": ("java", 0, (
        "        ArrayList out = new ArrayList();\n"
        "        for (Long x : xs) out.add(new Object() { public boolean equals(Object o) { return true; } });\n"
        "        return out;\n    }\n")),
    "Java: a record's equals": ("java", 0, (
        "        record Yes(long v) { public boolean equals(Object o) { return true; } }\n"
        "        ArrayList out = new ArrayList();\n        for (Long x : xs) out.add(new Yes(x));\n"
        "        return out;\n    }\n")),
}


def test_class_6_a_java_class_of_the_completion_cannot_answer_equals(judge):
    got = scores(judge, CLASS_6)
    assert got == dict.fromkeys(CLASS_6, (0.0, "shadowing")), got
    _name, prompt, tests, _good, _bad = ROWS["java"][0]
    helpers = ("        class Box implements Comparable<Box> {\n            final long v;\n"
               "            Box(long v) { this.v = v; }\n"
               "            public int compareTo(Box o) { return Long.compare(v, o.v); }\n"
               "            public String toString() { return \"Box(\" + v + \")\"; }\n"
               "        }\n        Comparator<Long> order = new Comparator<Long>() {\n"
               "            public int compare(Long a, Long b) { return Long.compare(a, b); }\n        };\n"
               "        ArrayList<Long> out = new ArrayList<>();\n        Box best = null;\n"
               "        for (long x : xs) {\n            Box b = new Box(x);\n"
               "            if (best == null || b.compareTo(best) > 0) best = b;\n"
               "            out.add(order.compare(best.v, x) >= 0 ? best.v : x);\n        }\n"
               "        out.sort((a, b) -> 0);\n        return out;\n    }\n")
    verdict = judge.judge([Program("java", helpers, tests, prompt, stop=tuple(STOPS["java"]))])[0]
    assert (verdict.score, verdict.outcome) == (1.0, "passed"), verdict  # helpers (toString too), comparators, lambdas
