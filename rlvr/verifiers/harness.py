"""The checker: runs inside the sandbox as its own user, drives the candidate process and reports results to
the trainer on a pipe only it holds. Standard library only.

The candidate (``candidate.py``, another uid) holds the model's code and answers calls; it never receives
a test. Every value it returns crosses a pipe as plain data (``plain.py``), so the checker compares fresh
built-in values. Records written to the trainer, one JSON object per line:

    {"ready": true}                        isolation is up and the candidate process answered
    {"load_error": "..."}                   the code did not load (every test fails)
    {"i": k, "out": "<json>"}              io format: the return value, graded by the trainer
    {"i": k, "passed": true}               humaneval / mbpp: test k ran to the end without an error
    {"i": k, "stdout": "...", "status": s}  program format: graded by the trainer
    {"build": s, "log": "...", "artifacts": {...}}  compiled format: how the build went (before any test)
    {"i": k, "stdout": "...", "status": s, "stderr": "..."}  compiled format: one run, graded by the trainer
    {"i": k, "error": "..."}                test k failed

A test that exceeds ``test_timeout_s``, or a candidate that dies, ends the execution: the tests not yet
reported fail.
"""

import builtins
import importlib
import json
import os
import select
import symtable
import sys

import plain


class CandidateGone(Exception):
    pass


class Candidate:
    """The checker's end of the pipes to the candidate process."""

    def __init__(self, request_fd: int, response_fd: int, timeout_s: float) -> None:
        self.request_fd, self.response_fd, self.timeout_s = request_fd, response_fd, timeout_s
        self._buffer = b""

    def ask(self, record: dict, timeout_s: float | None = None) -> dict:
        data = (json.dumps(record) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.request_fd, data):]
        except OSError:
            raise CandidateGone("the candidate exited") from None
        return self.receive(timeout_s)

    def receive(self, timeout_s: float | None = None) -> dict:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self.response_fd], [], [], timeout_s)
            if not ready:
                raise CandidateGone(f"no answer within {timeout_s:g} s")
            chunk = os.read(self.response_fd, 1 << 16)
            if not chunk:
                raise CandidateGone("the candidate exited")
            self._buffer += chunk
            if len(self._buffer) > 64 << 20:
                raise CandidateGone("answer too large")
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def function(self, name: str):
        """A callable that runs ``name`` in the candidate and returns its (plain) result."""

        def call(*args):
            answer = self.ask({"op": "call", "fn": name, "args": plain.encode(list(args))})
            if "error" in answer:
                raise CandidateError(answer["error"])
            return plain.decode(answer["value"])

        call.__name__ = name
        return call


class CandidateError(Exception):
    pass


def check(job: dict, candidate: Candidate, report) -> None:
    """Run the job's tests against the candidate; ``report(record)`` sends a record to the trainer."""
    fmt = job["format"]
    if fmt == "program":
        _programs(job, candidate, report)
        return
    if fmt == "compiled":
        _compiled(job, candidate, report)
        return
    loaded = candidate.ask({"op": "load", "sources": job["sources"], "entry_point": job.get("entry_point")})
    if "error" in loaded:
        report({"load_error": loaded["error"]})
        return
    if fmt == "io":
        entry = candidate.function(job["entry_point"])
        for i, args in enumerate(job["inputs"]):
            _run_test(i, report, lambda args=args: {"out": json.dumps(entry(*args))})
    elif fmt == "humaneval":
        namespace = test_namespace(job, [job["test"]], [job["entry_point"]], candidate)
        exec(compile(job["test"], "test.py", "exec"), namespace)  # noqa: S102 (the dataset's test code)
        entry = candidate.function(job["entry_point"])

        def run_check() -> dict:
            namespace["check"](entry)
            return {"passed": True}

        _run_test(0, report, run_check)
    elif fmt == "mbpp":
        setup, tests = job.get("setup_code") or "", job["test_list"]
        namespace = test_namespace(job, [setup, *tests], loaded["functions"], candidate)
        if setup:
            exec(compile(setup, "setup.py", "exec"), namespace)  # noqa: S102
        for i, test in enumerate(tests):
            code = compile(test, f"test_{i}.py", "exec")
            _run_test(i, report, lambda code=code: exec(code, namespace) or {"passed": True})  # noqa: S102
    else:
        raise ValueError(f"unknown format {fmt!r}")


def test_namespace(job: dict, sources: list[str], functions: list[str], candidate: Candidate) -> dict:
    """The globals the tests run in: only the names they read without binding them, each from a trusted
    place. Builtins and dunders are never set (the checker's own apply); a name the candidate must supply
    (MBPP: any function of the solution the tests call; HumanEval: the entry point only) is a proxy that
    returns plain data; a HumanEval test's other names (``poly``, ``encode_cyclic``) come from the prompt's
    code, run here; a standard-library module the tests use without importing it is imported here."""
    reads, bound = set(), set()
    for source in sources:
        source_reads, source_bound = names_read(source)
        reads |= source_reads
        bound |= source_bound
    namespace, prompt = {"__name__": "__check__"}, None
    for name in sorted(reads - bound):
        if name.startswith("__") or hasattr(builtins, name):
            continue
        if name in functions:
            namespace[name] = candidate.function(name)
            continue
        if job["format"] == "humaneval":
            prompt = _run_prompt(job.get("prompt_code")) if prompt is None else prompt
            if name in prompt:
                namespace[name] = prompt[name]
                continue
        if name in sys.stdlib_module_names:
            try:
                namespace[name] = importlib.import_module(name)
            except ImportError:
                pass
    return namespace


def names_read(source: str) -> tuple[set[str], set[str]]:
    """(global names ``source`` reads, global names it binds), from the compiler's own scope analysis."""
    top = symtable.symtable(source, "test.py", "exec")
    reads, bound, tables = set(), set(), [top]
    while tables:
        table = tables.pop()
        for sym in table.get_symbols():
            if table is top and (sym.is_assigned() or sym.is_imported()):
                bound.add(sym.get_name())
            elif table is not top and sym.is_declared_global() and sym.is_assigned():
                bound.add(sym.get_name())  # `global x; x = ...` in a function
            elif sym.is_referenced() and (table is top or sym.is_global()):
                reads.add(sym.get_name())
        tables.extend(table.get_children())
    return reads, bound


def _run_prompt(code: str | None) -> dict:
    """The names a HumanEval prompt defines (its helpers), or none when there is no prompt or it fails."""
    namespace = {"__name__": "__prompt__"}
    try:
        exec(compile(code or "", "prompt.py", "exec"), namespace)  # noqa: S102 (the dataset's prompt)
    except Exception:  # noqa: BLE001 (prose around the code: the tests then lack the helpers, and fail)
        return {}
    return namespace


def _run_test(i: int, report, test) -> None:
    """Report test ``i``: what ``test()`` returns when it returns, the error when it raises.
    CandidateGone propagates: the candidate cannot answer any further test."""
    try:
        result = test()
    except CandidateGone:
        report({"i": i, "error": "the candidate stopped answering"})
        raise
    except BaseException as err:  # noqa: BLE001 (a failed assert, a bad value: this test fails)
        report({"i": i, "error": f"{type(err).__name__}: {err}"[:500]})
        return
    report({"i": i, **result})


def _programs(job: dict, candidate: Candidate, report) -> None:
    source, per_test = job["sources"][0], job["test_timeout_s"]
    for i, stdin in enumerate(job["stdins"]):
        answer = candidate.ask({"op": "run", "source": source, "stdin": stdin, "timeout_s": per_test,
                                "output_bytes": job["output_bytes"]}, timeout_s=per_test + 5)
        report({"i": i, "stdout": answer["stdout"], "status": answer["status"]})


def _compiled(job: dict, candidate: Candidate, report) -> None:
    """Build (or install a cached build), then run the program once per stdin; the trainer grades the outputs."""
    build = job["build"]
    if job.get("cached"):
        answer = candidate.ask({"op": "install", "artifacts": job["cached"]}, timeout_s=60)
    else:
        answer = candidate.ask({"op": "build", **build}, timeout_s=build["wall_s"] * len(build["steps"]) + 10)
    if "error" in answer:
        report({"load_error": answer["error"]})
        return
    report({"build": answer["status"], "log": answer.get("log", ""), "artifacts": answer.get("artifacts", {})})
    if answer["status"] != "built":
        return
    run, files = job["run"], job.get("files") or [{}] * len(job["stdins"])  # files: a checker's, per run
    for i, stdin in enumerate(job["stdins"]):
        result = candidate.ask({"op": "exec", "argv": run["argv"], "stdin": stdin, "cpu_s": run["cpu_s"],
                                "wall_s": run["wall_s"], "output_bytes": job["output_bytes"], "files": files[i]},
                               timeout_s=run["wall_s"] + 10)
        if "error" in result:
            report({"load_error": result["error"]})
            return
        report({"i": i, "stdout": result["stdout"], "status": result["status"], "stderr": result["stderr"],
                "returncode": result["returncode"]})
