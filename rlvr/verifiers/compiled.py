"""Judge programs in compiled languages (``languages.py``) in the sandbox, in the two test styles datasets carry.

| style      | row columns                                                   | pass                                  |
|------------|---------------------------------------------------------------|---------------------------------------|
| assertions | ``language``, ``tests`` (a test program, MultiPL-E's form),   | builds, runs every test to the end    |
|            | the prompt the completion continues, ``stop_tokens``?         | (a marker), exits 0                   |
| stdio      | ``language``, ``tests: [{"input": str, "output": str}]``      | each case: the output's tokens equal  |
|            | (or ``stdin`` / ``stdout`` keys)                              | the expected ones (floats: tolerance) |
|            |                                                               | or a checker accepts it               |

Assertion programs are assembled by ``assertion_programs.py`` (what each language's guards stop, and how, is there
and in docs/concepts/sandbox.md). Their build compiles the completion while the tests' source is absent: each file
is written just before the first build step that names it (``candidate.py``), and the steps compile the
completion's unit (C, C++; then made to export the prompt's function only) or crate (Rust; no unsafe code) first.
Sources and intermediate files (``scratch``: object files, the
completion's crate) are deleted once built, the nonce is a file of the run's own, never an argument; the expected
outputs of stdio cases never enter the solution's sandbox: the trainer compares them, or a checker program reads
them in a job of its own. A build is cached by content (``CompileCache``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from fnmatch import fnmatch

from rlvr.verifiers.assertion_programs import JAVATUPLES, NONCE_FILE, OVERRIDING, assemble
from rlvr.verifiers.languages import Language, java_main_class, node_permission_flags, tool_path, toolchain_version
from rlvr.verifiers.sandbox import Execution

OUTCOMES = ("passed", "wrong_answer", "compile_error", "compile_timeout", "timeout", "runtime_error", "memory",
            "output_limit", "exited_early", "shadowing", "checker_error", "infra_error")
CHECKER_FILES = ("input.txt", "output.txt", "answer.txt")  # a checker's arguments, in testlib's order
_IDENT = re.compile(r"[A-Za-z_$][\w$]*")
_MEMORY_SIGNS = ("bad_alloc", "OutOfMemoryError", "heap out of memory", "memory allocation of", "Cannot allocate")


@dataclass(frozen=True)
class Settings:
    cpu_s: float = 2.0  # CPU seconds per test run (what decides a timeout; the wall limit is looser)
    compile_cpu_s: float = 20.0
    output_bytes: int = 64 * 1024
    float_tolerance: float = 0.0  # stdio: numbers within this absolute or relative error are equal; 0: exact text

    def wall_s(self, cpu_s: float) -> float:
        return 3 * cpu_s + 2  # a loaded machine stretches the wall clock, not the CPU time


@dataclass
class Verdict:
    score: float | None  # fraction of tests passed; None: the sandbox failed (excluded from training)
    outcome: str  # one of OUTCOMES: the first failure's kind, or "passed"
    detail: str = ""


# -- jobs ------------------------------------------------------------------------------------------------------------
def _classpath(argv) -> list[str]:
    """Java's class path with javatuples where it is installed."""
    argv = list(argv)
    if os.path.exists(JAVATUPLES):
        if "-cp" in argv:
            argv[argv.index("-cp") + 1] = "." + os.pathsep + JAVATUPLES
        if argv and argv[0].endswith("javac"):
            argv[1:1] = ["-cp", "." + os.pathsep + JAVATUPLES]
    return argv


def _steps(lang: Language, files: list[str], main: str, export: str = "") -> list[list[str]]:
    """The build commands for ``files``: the table's (one source), or an assertion program's, the completion's
    unit first (C/C++: the units compiled apart, the completion's made to export ``export`` only, then linked and
    stripped; Rust: the completion's library crate, without unsafe code, then the tests' binary crate linked
    against it; JavaScript: the completion's syntax checked)."""
    if len(files) > 1 and lang.name in ("c", "cpp"):  # the tests' unit is linked first: where both units define a
        # name (a helper function the prompt defines), the tests' definition is used
        cc = [tool_path(lang.compiler[0]), *lang.compiler[1:]]
        objects = [name.rsplit(".", 1)[0] + ".o" for name in files]
        link = sorted(objects, key=lambda obj: not obj.startswith("tests."))
        steps = [[*cc, "-c", "-o", obj, name] for name, obj in zip(files, objects)]
        return [steps[0], *_export_only(objects[0], export), *steps[1:],
                [*cc, "-s", "-Wl,--allow-multiple-definition", "-o", "prog", *link, *lang.link]]
    if len(files) > 1 and lang.name == "rust":  # -F unsafe_code: no #[no_mangle], #[export_name], #[link_section],
        # global_asm!, unsafe block or impl in the completion's crate (and no #![allow] undoes a forbid)
        rustc = [tool_path(lang.compiler[0]), *lang.compiler[1:]]
        return [[*rustc, "--crate-type", "rlib", "--crate-name", "rlvr_solution", "-F", "unsafe_code",
                 "-o", "librlvr_solution.rlib", files[0]],
                [*rustc, "--extern", "rlvr_solution=librlvr_solution.rlib", "-o", "prog", files[1]]]
    if len(files) > 1 and lang.name == "javascript":
        return [[tool_path("node"), "--check", files[0]]]
    steps = [[tool_path(a) if i == 0 else a.format(src=files[0], main=main) for i, a in enumerate(step)]
             for step in lang.build]
    return [_classpath(step) for step in steps] if lang.name == "java" else steps


def _export_only(obj: str, name: str) -> list[list[str]]:
    """The steps that leave the object file ``obj`` defining no global symbol but the function ``name`` (C's name,
    C++'s ``_Z<len><name>`` with any parameter list): a ``memcmp``, ``strcmp``, ``printf``, ``operator==``
    specialisation, ``main`` (strong, weak, an alias or inline asm) of the completion's would otherwise replace the
    one the tests' unit or the C library links to. ``ld -r -d`` makes common symbols definitions (objcopy leaves
    commons global); the COMDAT groups are dropped, so a template instantiation both units have stays in both
    (local here: one the linker discarded from this unit would leave its local references dangling)."""
    staged = obj[:-2] + ".r.o"
    keep = [f"--keep-global-symbol={name}", f"--keep-global-symbol=_Z{len(name)}{name}*"] if name else []
    return [["ld", "-r", "-d", "-o", staged, obj],
            ["objcopy", "--remove-section=.group", "--wildcard", *keep, staged, obj]]


def _build(lang: Language, files: dict[str, str], main: str, settings: Settings, artifacts: list[str],
           scratch: tuple[str, ...] = (), export: str = "") -> dict:
    """``artifacts``: what the run needs (globs; kept in the cache); ``scratch``: what the build leaves that is
    deleted before the run (globs); ``export``: C, C++ assertion programs: the one symbol the completion's unit
    keeps global."""
    return {"files": dict(files), "steps": _steps(lang, list(files), main, export), "artifacts": list(artifacts),
            "scratch": list(scratch), "cpu_s": settings.compile_cpu_s,
            "wall_s": settings.wall_s(settings.compile_cpu_s), "output_bytes": settings.output_bytes}


def installable(build: dict, artifacts: dict) -> dict:
    """A cached build's files that its run needs: the scratch (the tests' object file, kept for the cache of
    shared units) left out."""
    return {k: v for k, v in artifacts.items() if not any(fnmatch(k, p) for p in build.get("scratch", ()))}


def cache_key(lang: Language, build: dict) -> str:
    blob = json.dumps([lang.name, toolchain_version(lang.name), build["steps"], build["files"]], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def shared_unit(lang: Language, build: dict) -> tuple[str, str, list[str]] | None:
    """(cache key, object file, its compile command) of the tests' own unit of a C/C++ assertion program: the same
    for every completion of a row, so it is built once and linked with each completion's unit."""
    tests = [name for name in build["files"] if name.startswith("tests.")]
    if not tests or lang.name not in ("c", "cpp"):
        return None
    obj = tests[0].rsplit(".", 1)[0] + ".o"
    step = next(s for s in build["steps"] if obj in s and "-c" in s)
    blob = json.dumps([lang.name, toolchain_version(lang.name), step, build["files"][tests[0]]])
    return hashlib.sha256(blob.encode()).hexdigest(), obj, step


def use_prebuilt(build: dict, obj: str, step: list[str], data: str) -> dict:
    """``build`` with the unit ``obj`` installed from the cache instead of compiled."""
    source = next(name for name in build["files"] if name.startswith(obj[:-2] + "."))
    return {**build, "files": {k: v for k, v in build["files"].items() if k != source}, "prebuilt": {obj: data},
            "steps": [s for s in build["steps"] if s != step]}


def _run(lang: Language, src: str, main: str, settings: Settings) -> dict:
    argv = [a.format(src=src, main=main) for a in lang.run]
    cpu = settings.cpu_s + lang.run_cpu_extra_s
    return {"argv": _classpath(argv) if lang.name == "java" else argv, "cpu_s": cpu, "wall_s": settings.wall_s(cpu)}


def assertion_job(lang: Language, prompt: str, head: str, code: str, tests: str,
                  settings: Settings) -> tuple[dict, str]:
    """(the sandbox job, the last line a run that finished every test prints) for an assertion program."""
    program = assemble(lang, prompt, head, code, tests)
    nonce = secrets.token_hex(16)
    names = list(program.files)
    needs = {"c": ["prog", "tests.o"], "cpp": ["prog", "tests.o"], "rust": ["prog"]}.get(lang.name)
    build = _build(lang, program.files, program.main, settings,
                   needs or (names if lang.name == "javascript" else list(lang.artifacts)),
                   ("*.o", "*.rlib") if needs else (), program.export)
    run = _run(lang, program.main if lang.name == "javascript" else names[0], program.main, settings)
    if lang.name == "javascript":
        run["argv"][1:1] = node_permission_flags()
    job = {"format": "compiled", "build": build, "run": run, "stdins": [""], "files": [{NONCE_FILE: nonce}]}
    return job, f"{nonce} {program.proof}"


def stdio_job(lang: Language, code: str, stdins: list[str], settings: Settings) -> dict:
    main = java_main_class(code) if lang.name == "java" else ""
    name = lang.source.format(main=main or "Main")
    return {"format": "compiled", "build": _build(lang, {name: code}, main, settings, list(lang.artifacts)),
            "run": _run(lang, name, main, settings), "stdins": list(stdins)}


def checker_job(lang: Language, source: str, runs: list[tuple[str, str, str]], settings: Settings) -> dict:
    """The sandbox job that builds a checker program and runs it once per (stdin, output, expected), as testlib
    checkers run: ``checker input.txt output.txt answer.txt``. The three files exist only for their run; the
    solution never runs in this job, so it never sees an expected output."""
    main = java_main_class(source) if lang.name == "java" else ""
    name = lang.source.format(main=main or "Main")
    run = _run(lang, name, main, settings)
    run["argv"] += list(CHECKER_FILES)
    return {"format": "compiled", "build": _build(lang, {name: source}, main, settings, list(lang.artifacts)),
            "run": run, "stdins": [""] * len(runs), "files": [dict(zip(CHECKER_FILES, r)) for r in runs]}


def checker_answers(execution: Execution, count: int) -> list[bool | None]:
    """Per checked run: True accepted (exit 0), False rejected (testlib's 1: wrong answer, 2: presentation error),
    None when the checker itself failed (testlib's 3, a crash, a timeout, no build): the problem's fault, never the
    answer's, so never a score."""
    if execution.build != "built":
        return [None] * count
    answers: list[bool | None] = []
    for i in range(count):
        status = execution.stdouts.get(i, ("", "missing"))[1]
        code = execution.returncodes.get(i)
        answers.append(True if status == "exit" else False if status == "error" and code in (1, 2) else None)
    return answers


def job_timeout(job: dict) -> float:
    """The whole execution's wall-clock limit: the build's and every run's, plus the sandbox's start."""
    build = job["build"]
    return build["wall_s"] * max(1, len(build["steps"])) + job["run"]["wall_s"] * len(job["stdins"]) + 10


# -- grading -----------------------------------------------------------------------------------------------------
def run_outcome(status: str, stderr: str) -> str:
    if status in ("cpu", "timeout"):
        return "timeout"
    if status == "output_limit":
        return "output_limit"
    if any(sign in stderr for sign in _MEMORY_SIGNS):
        return "memory"
    return "runtime_error"


def build_failure(execution: Execution) -> Verdict | None:
    """The verdict when the program never ran (infrastructure, build), else None."""
    if execution.status == "infra_error" or (not execution.build and execution.status == "ran"):
        return Verdict(None, "infra_error", execution.load_error[:300])
    if execution.build in ("compile_error", "compile_timeout"):
        return Verdict(0.0, execution.build, execution.build_log[-500:])
    if execution.status == "timeout" and execution.build != "built":
        return Verdict(0.0, "compile_timeout", "")
    if execution.status == "output_limit" and not execution.stdouts:
        return Verdict(0.0, "output_limit", "")
    return None


def judge_assertions(execution: Execution, finished: str, lang: Language, tests: str, trusted: str = "",
                     artifacts: dict | None = None) -> Verdict:
    """``finished``: the last line of a run that finished every test (``assertion_job``); ``tests`` and
    ``trusted`` (the prompt's head and the tests) as given; ``artifacts``: the build's files when it came from
    the cache."""
    failed = build_failure(execution)
    if failed is not None:
        return failed
    shadow = _shadowing(lang, artifacts if artifacts is not None else execution.artifacts, tests, trusted)
    if shadow:
        return Verdict(0.0, "shadowing", f"the solution declares {shadow}, a name the tests use")
    if 0 not in execution.stdouts:
        return Verdict(0.0, "timeout" if execution.status == "timeout" else "runtime_error", execution.load_error)
    stdout, status = execution.stdouts[0]
    stderr = execution.stderrs.get(0, "")
    lines = stdout.rstrip("\n").split("\n")
    if status == "exit" and lines[-1] == finished:
        return Verdict(1.0, "passed")
    if status == "exit":
        return Verdict(0.0, "exited_early", "exit status 0 before the tests finished")
    if lang.name == "java" and status == "error" and OVERRIDING in stderr:  # refused before its code ran: a class
        return Verdict(0.0, "shadowing", stderr[stderr.rfind(OVERRIDING):][:300].strip())  # of its stands in for
        # the tests' types (its equals would answer their comparisons)
    if status == "error" and (execution.returncodes.get(0) == -4 or "AssertionError" in stderr
                              or "assertion" in stderr):  # C/C++: the harness's trap (SIGILL); Rust: a panic
        return Verdict(0.0, "wrong_answer", stderr[-300:])
    return Verdict(0.0, run_outcome(status, stderr), stderr[-300:])


def _shadowing(lang: Language, artifacts, tests: str, trusted: str) -> str:
    """Java: a class the completion declared (nested or top-level) under a name the tests use: its equals or
    static methods would answer for the tests (``new ArrayList<>(...)`` resolving to the completion's class)."""
    if lang.name != "java":
        return ""
    declared = set(re.findall(r"\bclass\s+([A-Za-z_$][\w$]*)", trusted)) | {"RlvrMain"}
    used = set(_IDENT.findall(tests))
    for name in artifacts:
        simple = name.removesuffix(".class").rsplit("$", 1)[-1]
        if simple in used and simple not in declared:
            return simple
    return ""


def tokens_equal(got: str, want: str, tolerance: float) -> bool:
    """Whitespace-insensitive token comparison; with ``tolerance``, numeric tokens within it (absolute or
    relative) are equal."""
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if tolerance <= 0:
            return False
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not (abs(fx - fy) <= tolerance * max(1.0, abs(fy))):
            return False
    return True


def judge_stdio(execution: Execution, cases: list[tuple[str, str]], tolerance: float, checker=None,
                checked: dict[int, bool | None] | None = None) -> Verdict:
    """Each case passes when the run exited 0 and its output matches: ``checked[i]`` (a checker program's answer
    for case i, ``checker_answers``) when given, else ``checker(stdin, output, expected)`` (the user's function,
    given plain strings) when there is one, else ``tokens_equal`` within ``tolerance``."""
    failed = build_failure(execution)
    if failed is not None:
        return failed
    if checked is not None and None in checked.values():
        case = next(i for i, answer in checked.items() if answer is None)
        return Verdict(None, "checker_error", f"the checker failed on case {case}")
    passed, first = 0, ""
    for i, (stdin, want) in enumerate(cases):
        if i not in execution.stdouts:
            first = first or ("timeout" if execution.status == "timeout" else "runtime_error")
            continue
        stdout, status = execution.stdouts[i]
        if checked is not None:
            right = status == "exit" and bool(checked.get(i))
        else:
            right = status == "exit" and (bool(checker(stdin, stdout, want)) if checker else
                                          tokens_equal(stdout, want, tolerance))
        if right:
            passed += 1
        elif status == "exit":
            first = first or "wrong_answer"
        else:
            first = first or run_outcome(status, execution.stderrs.get(i, ""))
    return Verdict(passed / len(cases) if cases else 0.0, first or "passed")


# -- the compile cache ---------------------------------------------------------------------------------------------
class CompileCache:
    """Builds by content hash (language, compiler version, commands, sources): what a successful build left
    (base64) or the compiler's verdict on a failed one. Least recently used first out past ``max_bytes``."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes, self.size, self.hits, self.misses = max_bytes, 0, 0, 0
        self._entries: OrderedDict[str, tuple[str, str, dict]] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:  # no use counted, no order changed
        with self._lock:
            return key in self._entries

    def get(self, key: str) -> tuple[str, str, dict] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: str, status: str, log: str, artifacts: dict) -> None:
        if status not in ("built", "compile_error"):
            return  # a compile timeout may be the machine's load
        size = sum(len(v) for v in artifacts.values()) + len(log)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (status, log, artifacts)
            self.size += size
            while self.size > self.max_bytes:
                _, (_, old_log, old) = self._entries.popitem(last=False)
                self.size -= sum(len(v) for v in old.values()) + len(old_log)
