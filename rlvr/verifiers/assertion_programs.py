"""MultiPL-E's assertion programs (prompt + completion + tests), assembled so that only running every test passes.

A naive harness passes a program that exits 0. Here the run passes only if its last line is ``NONCE PROOF``: a
nonce the harness writes to the file ``rlvr_nonce`` for this run only (never on the command line or in the
environment), which the trailer's own code reads and deletes first, and PROOF, the XOR of a secret per assertion
line of the tests that ran (``site_secrets``: derived from a key of this process, so no dataset shows them and
the number of lines cannot be guessed), printed by a trailer after the tests' own main returned. So an early exit
(``exit(0)``, a static initialiser, an exit or signal handler, ``System.exit``, ``process.exit``) fails, and so
does printing a nonce read before the trailer deleted it. The completion never shares a source file, a
compilation unit or a scope with the tests or the trailer:

- C, C++: the completion's unit is compiled while the tests' source is absent (``compiled.py``'s build order), so
  ``#include "tests.c"`` or ``#include __FILE__`` finds no tests; the tests' unit holds the trailer and its counter
  (statics the completion cannot name), sees the prompt's declarations only - no macro (``#define assert``),
  overload (``operator==``) or ``NDEBUG`` of the completion reaches it - and asserts with a trap (no
  ``__assert_fail`` to replace); once compiled, the completion's object keeps one global symbol, the prompt's
  function (``compiled._export_only``), so no ``strcmp``, ``memcmp``, ``printf`` or ``operator==`` of its own
  replaces the one the tests' unit or the C library links to; the binary is stripped.
- Rust: the prompt and completion are a library crate built first (the prompt's function made ``pub``), the tests a
  binary crate built after, which imports that one function; the assertion macros are called by path
  (``::std::assert_eq!``), which ``macro_rules!`` cannot shadow; the library is compiled with ``-F unsafe_code``
  (no ``#[no_mangle]``, ``#[export_name]``, ``#[link_section]``, ``global_asm!`` or ``unsafe``).
- Java: run with ``-ea``; ``RlvrMain.main`` reads the nonce into a local variable, loads every class and deletes
  the class files before any of the completion's code runs (no test's constant is left to read from disk); the
  counter is a private map that grows as lines run; a class the completion declares under a name the tests use
  fails (``compiled.judge_assertions``), and so, refused by ``RlvrMain`` before any of the completion's code runs
  (``OVERRIDING``), does a class that declares ``equals`` or ``hashCode`` or is a collection, map,
  iterator, number or char sequence: no object of the completion's answers the tests' ``equals``.
- JavaScript: a trusted runner reads the nonce, the completion and the tests into memory and deletes the files
  (itself included); the completion runs in the main realm, the tests in a ``vm`` context of their own (its own
  builtins, so a patched ``Array.prototype`` does not reach them) compiled before the completion ran, strict, and
  reachable from no name of the completion's; the prompt's functions are handed to the tests through wrappers that
  copy arguments in and results out as plain data, and the assert module is captured (frozen) before the
  completion ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass

from rlvr.verifiers.languages import Language, java_main_class

JAVATUPLES = "/usr/share/java/javatuples.jar"  # MultiPL-E's Java rows import org.javatuples (apt: libjavatuples-java)
_FENCE = re.compile(r"```([A-Za-z0-9_+#-]*)[ \t]*\n(.*?)```", re.DOTALL)
_ASSERT_LINE = re.compile(r"^([ \t]*)((?:::std::)?assert\w*\b.*;)[ \t]*$", re.MULTILINE)
_KEY = secrets.token_bytes(32)  # this process's: the secrets of a row's lines stay the same (its builds cache)
NONCE_FILE = "rlvr_nonce"  # written for the run only; the trailer reads and deletes it before the tests run
OVERRIDING = "rlvr-overriding: "  # Java: what the trailer prints (stderr) before it refuses a class of the completion


@dataclass(frozen=True)
class Assembled:
    files: dict[str, str]  # file name -> source; the first is the program's (or the completion's unit)
    main: str  # Java: the class the run starts; else ""
    sites: int  # assertion lines instrumented
    proof: str  # what the trailer prints after the nonce when every line ran: the XOR of their secrets
    export: str = ""  # C, C++: the prompt's function, the one symbol the completion's unit keeps global


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


def site_secrets(tests: str, count: int) -> list[int]:
    """A non-zero 32-bit secret per assertion line, from this process's key and the tests (stable for a row)."""
    out = []
    for k in range(count):
        digest = hashlib.sha256(_KEY + tests.encode() + k.to_bytes(4, "little")).digest()
        out.append(int.from_bytes(digest[:4], "little") or 1)
    return out


def _instrument(tests: str, call: str) -> tuple[str, int, str]:
    """Append ``call.format(k, secret_k)`` to the k-th one-line assertion statement of the tests; (tests, the
    number of lines, the proof: the XOR of every line's secret)."""
    lines = _ASSERT_LINE.findall(tests)
    keys = site_secrets(tests, len(lines))
    count = 0

    def mark(match: re.Match) -> str:
        nonlocal count
        count += 1
        return f"{match.group(1)}{match.group(2)} {call.format(count - 1, keys[count - 1])}"

    proof = 0
    for key in keys:
        proof ^= key
    return _ASSERT_LINE.sub(mark, tests), count, str(proof)


def _closing(tests: str) -> tuple[str, str]:
    """(the tests' first line when it closes the prompt's function, the rest)."""
    first, _, rest = tests.partition("\n")
    return (first + "\n", rest) if first.strip() == "}" else ("", tests)


# -- per language ------------------------------------------------------------------------------------------------
def assemble(lang: Language, prompt: str, head: str, code: str, tests: str) -> Assembled:
    if lang.name in ("c", "cpp"):
        return _c_family(lang, prompt, head, code, tests)
    if lang.name == "rust":
        return _rust(prompt, head, code, tests)
    if lang.name == "java":
        return _java(head, code, tests)
    if lang.name == "javascript":
        return _javascript(prompt, head, code, tests)
    raise ValueError(f"no assertion-program form for {lang.name}")


def _c_family(lang: Language, prompt: str, head: str, code: str, tests: str) -> Assembled:
    closing, tests = _closing(tests)
    signature = _signature_line(prompt)
    if not signature.endswith("{"):
        raise ValueError("a C/C++ prompt must end with the function's signature and '{'")
    at = prompt.rfind(signature)
    declarations = prompt[:at] + signature[:-1].rstrip() + ";\n"
    tests = _rename_main(tests, r"\bint\s+main\s*\(\s*(void)?\s*\)", "static int rlvr_tests_main(void)", "int main()")
    end = tests.rstrip().rfind("}")
    tests = tests[:end] + "return 0;\n" + tests[end:]  # falling off a renamed main is not a return of 0
    tests, sites, proof = _instrument(tests, "rlvr_site({}, {}u);")
    guard = ("\n#undef NDEBUG\n#undef assert\n#define assert(e) ((e) ? (void)0 : __builtin_trap())\n"
             f"static unsigned rlvr_seen[{sites + 1}];\n"
             "static void rlvr_site(int k, unsigned secret) { rlvr_seen[k] = secret; }\n")
    trailer = ("\nint main(void) {\n  char nonce[80] = \"\";\n  FILE *f = fopen(\"" + NONCE_FILE + "\", \"r\");\n"
               "  int given = f != NULL && fgets(nonce, sizeof nonce, f) != NULL;\n  if (f) fclose(f);\n"
               "  remove(\"" + NONCE_FILE + "\");\n  int rc = rlvr_tests_main();\n  unsigned proof = 0;\n"
               f"  for (int k = 0; k < {sites + 1}; k++) proof ^= rlvr_seen[k];\n"
               "  if (rc == 0 && given) printf(\"%s %u\\n\", nonce, proof);\n  return rc;\n}\n")
    ext = ".c" if lang.name == "c" else ".cpp"
    if not head.rstrip().endswith(signature):  # the completion brought the whole function: it must match the
        head = declarations  # prompt's declaration (another return type would link and return garbage)
    name = re.search(r"([A-Za-z_]\w*)\s*\($", signature.split("(")[0].rstrip() + "(")
    if not name:
        raise ValueError("a C/C++ prompt must end with the function's signature and '{'")
    return Assembled({f"solution{ext}": head + code + "\n" + closing,
                      f"tests{ext}": "#include <stdio.h>\n" + declarations + guard + tests + trailer}, "", sites, proof,
                     name.group(1))


def _rust(prompt: str, head: str, code: str, tests: str) -> Assembled:
    """Two crates: ``solution.rs`` (prompt + completion, a library; the prompt's function made ``pub``) and
    ``tests.rs`` (the prompt's ``use`` lines, that one function imported, the tests, the trailer)."""
    closing, tests = _closing(tests)
    name = re.search(r"\bfn\s+([A-Za-z_]\w*)", _signature_line(prompt))
    if not name:
        raise ValueError("a Rust prompt must end with the function's signature")
    define = re.compile(rf"(?m)^([ \t]*)(?:pub(?:\([^)]*\))?\s+)?fn\s+{name.group(1)}\b")
    if head.rstrip().endswith(_signature_line(prompt)):  # the prompt's own signature: made pub there
        at = head.rfind(_signature_line(prompt))
        head = head[:at] + define.sub(rf"\1pub fn {name.group(1)}", head[at:], count=1)
    else:  # a fenced block brought the whole function
        code = define.sub(rf"\1pub fn {name.group(1)}", code, count=1)
    uses = "".join(m + "\n" for m in re.findall(r"(?ms)^use\s[^;]*;", head))
    tests = re.sub(r"(?<![\w:])(assert|assert_eq|assert_ne|debug_assert|debug_assert_eq|debug_assert_ne)!",
                   r"::std::\1!", tests)
    tests = _rename_main(tests, r"\bfn\s+main\s*\(\s*\)", "fn rlvr_tests_main()", "fn main()")
    tests, sites, proof = _instrument(tests, "rlvr_site({}, {});")
    atomic = "::std::sync::atomic"
    trailer = (f"\nstatic RLVR_SEEN: [{atomic}::AtomicU32; {sites + 1}] = "
               f"[const {{ {atomic}::AtomicU32::new(0) }}; {sites + 1}];\n"
               f"fn rlvr_site(k: usize, secret: u32) {{ RLVR_SEEN[k].store(secret, {atomic}::Ordering::SeqCst); }}\n"
               f"fn main() {{\n    let nonce = ::std::fs::read_to_string(\"{NONCE_FILE}\");\n"
               f"    let _ = ::std::fs::remove_file(\"{NONCE_FILE}\");\n    rlvr_tests_main();\n"
               "    let mut proof: u32 = 0;\n"
               f"    for seen in RLVR_SEEN.iter() {{ proof ^= seen.load({atomic}::Ordering::SeqCst); }}\n"
               "    if let ::std::result::Result::Ok(nonce) = nonce {\n"
               "        ::std::println!(\"{} {}\", nonce, proof);\n    }\n}\n")
    tests_crate = f"#![allow(unused_imports)]\n{uses}use rlvr_solution::{name.group(1)};\n{tests}{trailer}"
    return Assembled({"solution.rs": head + code + "\n" + closing, "tests.rs": tests_crate}, "", sites, proof)


def _java(head: str, code: str, tests: str) -> Assembled:
    if not os.path.exists(JAVATUPLES):  # MultiPL-E imports it; rows that use Pair then fail to compile
        head = re.sub(r"(?m)^import org\.javatuples\.\*;\n", "", head)
    owners = re.findall(r"\bclass\s+([A-Za-z_$][\w$]*)", head)
    owner = owners[-1] if owners else java_main_class(tests)
    tests = _rename_main(tests, r"public\s+static\s+void\s+main\s*\(\s*String\s*(\[\]\s*\w+|\w+\s*\[\])\s*\)",
                         "static void rlvrTests()", "public static void main(String[] args)")
    tests, sites, proof = _instrument(tests, "RlvrMain.site({}, 0x{:08x});")
    nio = "java.nio.file"
    trailer = ("\nclass RlvrMain {\n"
               "    private static final java.util.HashMap<Integer, Integer> SEEN = new java.util.HashMap<>();\n"
               "    static void site(int k, int secret) { SEEN.put(k, secret); }\n"
               "    public static void main(String[] a) throws Exception {\n"
               f"        {nio}.Path file = {nio}.Path.of(\"{NONCE_FILE}\");\n"
               f"        String nonce = new String({nio}.Files.readAllBytes(file), "
               "java.nio.charset.StandardCharsets.UTF_8);\n"
               f"        {nio}.Files.delete(file);\n"
               "        ClassLoader loader = RlvrMain.class.getClassLoader();\n"
               "        java.util.ArrayList<Class<?>> loaded = new java.util.ArrayList<>();\n"
               "        for (java.io.File f : new java.io.File(\".\").listFiles()) {  // loaded, not initialised\n"
               "            String name = f.getName();\n"
               "            if (name.endsWith(\".class\")) {\n"
               "                loaded.add(Class.forName(name.substring(0, name.length() - 6), false, loader));\n"
               "                f.delete();\n            }\n        }\n"
               "        for (Class<?> c : loaded) {\n"
               "            String why = c == RlvrMain.class ? null : overrides(c);\n"
               "            if (why != null) {\n"
               f"                System.err.println(\"{OVERRIDING}\" + c.getName() + \" \" + why);\n"
               "                Runtime.getRuntime().halt(3);\n            }\n        }\n"
               f"        {owner}.rlvrTests();\n        int proof = 0;\n"
               "        for (int secret : SEEN.values()) proof ^= secret;\n"
               "        System.out.println(nonce + \" \" + Integer.toUnsignedString(proof));\n    }\n"
               "    private static String overrides(Class<?> c) {  // reflection on a class not initialised\n"
               "        for (java.lang.reflect.Method m : c.getDeclaredMethods()) {  // runs none of its code\n"
               "            String n = m.getName();\n            int k = m.getParameterCount();\n"
               "            if (n.equals(\"equals\") && k == 1 || n.equals(\"hashCode\") && k == 0)\n"
               "                return \"declares \" + n;\n"
               "        }\n        Class<?>[] kinds = {java.util.Collection.class, java.util.Map.class,\n"
               "            java.util.Map.Entry.class, java.util.Iterator.class, Iterable.class, Number.class,\n"
               "            CharSequence.class};\n        for (Class<?> kind : kinds) {\n"
               "            if (kind.isAssignableFrom(c)) return \"is a \" + kind.getName();\n        }\n"
               "        return null;\n    }\n}\n")
    return Assembled({"RlvrMain.java": head + code + "\n" + tests + trailer}, "RlvrMain", sites, proof)


_JS_COPY_OUT = """(() => {
  'use strict';
  const copy = (v, depth) => {
    if (v === null || (typeof v !== 'object' && typeof v !== 'function')) return v;
    if (typeof v === 'function' || depth > 100) throw new TypeError('the solution returned no plain data');
    const out = Array.isArray(v) ? [] : {};
    for (const k of Object.keys(v)) {
      const value = copy(v[k], depth + 1);
      Object.defineProperty(out, k, { value, writable: true, enumerable: true, configurable: true });
    }
    return out;
  };
  return { copy, wrap: (call) => function candidate(...args) { return copy(call(args), 0); } };
})()"""

_JS_RUNNER = r"""'use strict';
// rlvr's runner: the completion runs in this realm, the tests in a vm context of their own (assertion_programs.py)
const fs = require('node:fs'), vm = require('node:vm'), assertModule = require('node:assert');
const { readFileSync, unlinkSync, writeSync } = fs;
const apply = Reflect.apply, isArray = Array.isArray, keys = Object.keys, define = Object.defineProperty;
const freeze = Object.freeze, TypeErr = TypeError, names = NAMES;
const take = (name) => { const text = readFileSync(name, 'utf8'); unlinkSync(name); return text; };
unlinkSync(__filename);
const nonce = take(NONCE_FILE), solution = take('solution.js'), tests = take('tests.js');
define(Error, 'prepareStackTrace', { __proto__: null, value: undefined, writable: false, configurable: false });
const realm = vm.createContext();
const { copy: copyOut, wrap: wrapperOf } = vm.runInContext(COPY_OUT, realm);
const runTests = vm.runInContext(`(function (require, __rlvr_site, ${names.join(', ')}) { 'use strict';\n${tests}\n})`,
                                 realm, { filename: 'tests.js', lineOffset: -1 });
const load = vm.compileFunction(
  `${solution}\n;return [${names.map((n) => `typeof ${n} === 'function' ? ${n} : undefined`).join(', ')}];`,
  ['exports', 'require', 'module', '__filename', '__dirname'], { filename: 'solution.js' });
const frozen = (m, strict) => {  // the assert functions as they are now, in an object the code cannot change
  const ok = m.ok, w = function assert(v, message) { return ok(v, message); };
  for (const k of keys(m)) w[k] = k === 'strict' ? strict || w : m[k];
  return freeze(w);
};
const assertStrict = frozen(assertModule.strict, null), assertLoose = frozen(assertModule, assertStrict);
const requireForTests = (name) => {
  if (name === 'assert' || name === 'node:assert') return assertLoose;
  if (name === 'assert/strict' || name === 'node:assert/strict') return assertStrict;
  throw new TypeErr('the tests may require node:assert only');
};
const seen = { __proto__: null };
const site = (k, secret) => { seen[k] = secret; };
const copyIn = (v, depth) => {  // the tests' values as this realm's plain data: no object of theirs reaches the code
  if (v === null || (typeof v !== 'object' && typeof v !== 'function')) return v;
  if (depth > 100) throw new TypeErr('the tests passed data nested too deep');
  if (typeof v === 'function') return (...a) => copyIn(apply(v, undefined, copyOut(a, 0)), 0);  // a callback
  const out = isArray(v) ? [] : {}, names = keys(v);
  for (let i = 0; i < names.length; i++) {
    define(out, names[i], { __proto__: null, value: copyIn(v[names[i]], depth + 1), writable: true, enumerable: true,
                            configurable: true });
  }
  return out;
};
const callIn = (fn) => (args) => apply(fn, undefined, copyIn(args, 0));
const moduleObject = { exports: {} };
// from here on the completion's code has run: only captured functions, own properties and operators are used
const found = apply(load, undefined, [moduleObject.exports, require, moduleObject, '/work/solution.js', '/work']);
const args = [requireForTests, site];
for (let i = 0; i < names.length; i++) {
  define(args, i + 2, { __proto__: null, value: wrapperOf(callIn(found[i])), writable: true, enumerable: true,
                        configurable: true });
}
apply(runTests, undefined, args);
let proof = 0;
for (const k in seen) proof ^= seen[k];
writeSync(1, nonce + ' ' + (proof >>> 0) + '\n');
"""


def _javascript(prompt: str, head: str, code: str, tests: str) -> Assembled:
    """Three files: ``solution.js`` (prompt + completion), ``tests.js`` (the tests, instrumented) and ``prog.js``,
    the runner the run starts (``_JS_RUNNER``)."""
    names = list(dict.fromkeys(re.findall(r"(?m)^[ \t]*function\s+([A-Za-z_$][\w$]*)", prompt)))
    if not names:
        raise ValueError("a JavaScript prompt must declare the function the tests call")
    tests, sites, proof = _instrument(tests, "__rlvr_site({}, {});")
    runner = (_JS_RUNNER.replace("NONCE_FILE", json.dumps(NONCE_FILE)).replace("COPY_OUT", json.dumps(_JS_COPY_OUT))
              .replace("NAMES", json.dumps(names)))
    return Assembled({"solution.js": head + code + "\n", "tests.js": tests, "prog.js": runner}, "prog.js", sites,
                     proof)
