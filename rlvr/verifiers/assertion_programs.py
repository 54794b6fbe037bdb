"""MultiPL-E's assertion programs (prompt + completion + tests), assembled so that only running every test passes.

A naive harness passes a program that exits 0. Here the run passes only if its last line is ``NONCE N``: a nonce
the harness gives the run (argv) and N, the number of distinct assertion lines of the tests that ran - printed by
a trailer the harness appends, after the tests' own main returned. So an early exit (``exit(0)``, a static
initialiser, an exit or signal handler, ``System.exit``, ``process.exit``, ``std::process::exit``) fails. Per
language:

- C, C++: the completion and the tests are separate translation units linked together: no macro (``#define
  assert``), overload (``operator==``) or ``NDEBUG`` of the completion reaches the tests, which see the prompt's
  declarations only; their ``assert`` is the harness's (a trap, no ``__assert_fail`` to replace).
- Rust: the tests' assertion macros are called by path (``::std::assert_eq!``), which ``macro_rules!`` cannot shadow.
- Java: run with ``-ea``; the trailer is a class of its own; a class the completion declares under a name the
  tests use fails (``compiled.judge_assertions``).
- JavaScript: the tests get the assert functions captured before the completion ran (frozen), and the program is
  read from stdin, so it cannot read its own tests from a file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rlvr.verifiers.languages import Language, java_main_class

JAVATUPLES = "/usr/share/java/javatuples.jar"  # MultiPL-E's Java rows import org.javatuples (apt: libjavatuples-java)
_FENCE = re.compile(r"```([A-Za-z0-9_+#-]*)[ \t]*\n(.*?)```", re.DOTALL)
_ASSERT_LINE = re.compile(r"^([ \t]*)((?:::std::)?assert\w*\b.*;)[ \t]*$", re.MULTILINE)


@dataclass(frozen=True)
class Assembled:
    files: dict[str, str]  # file name -> source; the first is the program's (or the completion's unit)
    main: str  # Java: the class the run starts; else ""
    sites: int  # assertion lines instrumented: the trailer must report this many


# -- the completion's code -------------------------------------------------------------------------------------------
def fenced_code(text: str, lang: Language) -> str | None:
    """The last fenced block tagged with the language (else the last block); None without one."""
    blocks = _FENCE.findall(text)
    tagged = [body for tag, body in blocks if tag.lower() in (lang.name, *lang.aliases)]
    if tagged:
        return tagged[-1]
    return blocks[-1][1] if blocks else None


def truncate(text: str, stops) -> str:
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


def _signature_line(prompt: str) -> str:
    lines = [line for line in prompt.rstrip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def solution_part(prompt: str, completion: str, tests: str, lang: Language, stops=None) -> tuple[str, str, str]:
    """(trusted head, the model's code, tests). A completion that continues the prompt is cut at the first stop
    sequence; a fenced block that repeats the prompt's signature replaces the function (then the tests' first
    line, which closes the function in MultiPL-E's form, is dropped)."""
    block = fenced_code(completion, lang)
    if block is None:
        return prompt, truncate(completion, stops or lang.stop), tests
    signature = _signature_line(prompt)
    at = prompt.rfind(signature) if signature else -1
    if signature and at >= 0 and _defines(block, signature):
        first, _, rest = tests.partition("\n")
        return prompt[:at], block, rest if first.strip() == "}" else tests
    return prompt, block, tests


def _defines(block: str, signature: str) -> bool:
    """Whether ``block`` defines the prompt's function: its signature whitespace aside, or a definition header of
    the same name (other parameter names; other types then fail to compile against the prompt's declaration)."""
    if re.sub(r"\s+", "", signature) in re.sub(r"\s+", "", block):
        return True
    name = re.search(r"([A-Za-z_$][\w$]*)\s*\($", signature.split("(")[0] + "(")
    if not name:
        return False
    header = (rf"(?m)^[ \t]*(?!(?:if|while|for|return|else|switch|do)\b)[\w:<>\[\],*& \t]*\b{re.escape(name.group(1))}"
              r"\s*\([^;{}]*\)[^;{}]*\{")
    return re.search(header, block) is not None


def _rename_main(tests: str, pattern: str, replacement: str, what: str) -> str:
    """The tests with their entry point renamed (the harness's trailer calls it); ValueError when there is none."""
    renamed, n = re.subn(pattern, replacement, tests, count=1)
    if not n:
        raise ValueError(f"the tests define no {what}")
    return renamed


def _instrument(tests: str, call: str) -> tuple[str, int]:
    """Append ``call.format(k)`` to the k-th one-line assertion statement of the tests."""
    count = 0

    def mark(match: re.Match) -> str:
        nonlocal count
        count += 1
        return f"{match.group(1)}{match.group(2)} {call.format(count - 1)}"

    return _ASSERT_LINE.sub(mark, tests), count


# -- per language ------------------------------------------------------------------------------------------------
def assemble(lang: Language, prompt: str, head: str, code: str, tests: str) -> Assembled:
    if lang.name in ("c", "cpp"):
        return _c_family(lang, prompt, head, code, tests)
    if lang.name == "rust":
        return _rust(head, code, tests)
    if lang.name == "java":
        return _java(head, code, tests)
    if lang.name == "javascript":
        return _javascript(head, code, tests)
    raise ValueError(f"no assertion-program form for {lang.name}")


def _c_family(lang: Language, prompt: str, head: str, code: str, tests: str) -> Assembled:
    first, _, rest = tests.partition("\n")
    closing = first + "\n" if first.strip() == "}" else ""
    tests = rest if closing else tests
    signature = _signature_line(prompt)
    if not signature.endswith("{"):
        raise ValueError("a C/C++ prompt must end with the function's signature and '{'")
    at = prompt.rfind(signature)
    declarations = prompt[:at] + signature[:-1].rstrip() + ";\n"
    tests = _rename_main(tests, r"\bint\s+main\s*\(\s*(void)?\s*\)", "static int rlvr_tests_main(void)", "int main()")
    end = tests.rstrip().rfind("}")
    tests = tests[:end] + "return 0;\n" + tests[end:]  # falling off a renamed main is not a return of 0
    tests, sites = _instrument(tests, "rlvr_site({});")
    guard = ("\n#undef NDEBUG\n#undef assert\n#define assert(e) ((e) ? (void)0 : __builtin_trap())\n"
             f"static unsigned char rlvr_seen[{sites + 1}];\nstatic int rlvr_count;\n"
             "static void rlvr_site(int k) { if (!rlvr_seen[k]) { rlvr_seen[k] = 1; rlvr_count++; } }\n")
    trailer = ("\nint main(int argc, char **argv) {\n  int rc = rlvr_tests_main();\n"
               "  if (rc == 0 && argc > 1) printf(\"%s %d\\n\", argv[1], rlvr_count);\n  return rc;\n}\n")
    ext = ".c" if lang.name == "c" else ".cpp"
    if not head.rstrip().endswith(signature):  # the completion brought the whole function: it must match the
        head = declarations  # prompt's declaration (another return type would link and return garbage)
    return Assembled({f"solution{ext}": head + code + "\n" + closing,
                      f"tests{ext}": "#include <stdio.h>\n" + declarations + guard + tests + trailer}, "", sites)


def _rust(head: str, code: str, tests: str) -> Assembled:
    tests = re.sub(r"(?<![\w:])(assert|assert_eq|assert_ne|debug_assert|debug_assert_eq|debug_assert_ne)!",
                   r"::std::\1!", tests)
    tests = _rename_main(tests, r"\bfn\s+main\s*\(\s*\)", "fn rlvr_tests_main()", "fn main()")
    tests, sites = _instrument(tests, "rlvr_site({});")
    atomic = "::std::sync::atomic"
    trailer = (f"\nstatic RLVR_SEEN: [{atomic}::AtomicBool; {sites + 1}] = "
               f"[const {{ {atomic}::AtomicBool::new(false) }}; {sites + 1}];\n"
               f"fn rlvr_site(k: usize) {{ RLVR_SEEN[k].store(true, {atomic}::Ordering::SeqCst); }}\n"
               "fn main() {\n    rlvr_tests_main();\n    let mut n = 0;\n"
               f"    for seen in RLVR_SEEN.iter() {{ if seen.load({atomic}::Ordering::SeqCst) {{ n += 1; }} }}\n"
               "    if let ::std::option::Option::Some(a) = ::std::env::args().nth(1) {\n"
               "        ::std::println!(\"{} {}\", a, n);\n    }\n}\n")
    return Assembled({"prog.rs": head + code + "\n" + tests + trailer}, "", sites)


def _java(head: str, code: str, tests: str) -> Assembled:
    if not os.path.exists(JAVATUPLES):  # MultiPL-E imports it; rows that use Pair then fail to compile
        head = re.sub(r"(?m)^import org\.javatuples\.\*;\n", "", head)
    owners = re.findall(r"\bclass\s+([A-Za-z_$][\w$]*)", head)
    owner = owners[-1] if owners else java_main_class(tests)
    tests = _rename_main(tests, r"public\s+static\s+void\s+main\s*\(\s*String\s*(\[\]\s*\w+|\w+\s*\[\])\s*\)",
                         "static void rlvrTests()", "public static void main(String[] args)")
    tests, sites = _instrument(tests, "RlvrMain.site({});")
    trailer = (f"\nclass RlvrMain {{\n    static final boolean[] SEEN = new boolean[{sites + 1}];\n"
               "    static void site(int k) { SEEN[k] = true; }\n"
               f"    public static void main(String[] a) {{\n        {owner}.rlvrTests();\n        int n = 0;\n"
               "        for (boolean seen : SEEN) if (seen) n++;\n        System.out.println(a[0] + \" \" + n);\n"
               "    }\n}\n")
    return Assembled({"RlvrMain.java": head + code + "\n" + tests + trailer}, "RlvrMain", sites)


def _javascript(head: str, code: str, tests: str) -> Assembled:
    prelude = ("const [__rlvr_site, __rlvr_done] = ((seen, write, nonce) => [(k) => { seen[k] = 1; }, () => {\n"
               "  let n = 0;\n  for (const k in seen) n++;\n  write(1, nonce + ' ' + n + '\\n');\n}])"
               "(Object.create(null), require('node:fs').writeSync, process.argv.splice(2, 1)[0]);\n"
               "const __rlvr_assert = (() => {\n  const a = require('node:assert'), ok = a.ok;\n"
               "  const w = function assert(v, m) { return ok(v, m); };\n"
               "  for (const k of Object.keys(a)) w[k] = a[k];\n  return Object.freeze(w);\n})();\n")
    tests = re.sub(r"require\(\s*['\"](node:)?assert(/strict)?['\"]\s*\)", "__rlvr_assert", tests)
    tests, sites = _instrument(tests, "__rlvr_site({});")
    return Assembled({"prog.js": prelude + head + code + "\n" + tests + "\n;__rlvr_done();\n"}, "", sites)
