"""Judge many programs at once: a sandbox pool sized for compilers, the compile cache, and a build per distinct
program (a group's identical completions are built once; the copies install the first one's build)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlvr.verifiers.assertion_programs import fenced_code, solution_part
from rlvr.verifiers.compiled import (
    CompileCache,
    Settings,
    Verdict,
    assertion_job,
    cache_key,
    checker_answers,
    checker_job,
    installable,
    job_timeout,
    judge_assertions,
    judge_stdio,
    shared_unit,
    stdio_job,
    use_prebuilt,
)
from rlvr.verifiers.languages import LANGUAGES, Language, exposed_paths, language, missing_tools
from rlvr.verifiers.sandbox import Execution, Limits, Sandbox


class ToolchainMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class CheckerProgram:
    """A stdio problem's checker: a program in any judged language, run as testlib's are (``checker input.txt
    output.txt answer.txt``; exit 0 accepts, 1 or 2 rejects, anything else is the checker's own failure)."""

    language: str
    source: str


@dataclass
class Program:
    """One completion to judge. Assertion style: ``tests`` is the test program and ``prompt`` what the completion
    continues; stdio style: ``cases`` lists (stdin, expected stdout)."""

    language: str
    completion: str
    tests: str = ""
    prompt: str = ""
    cases: list[tuple[str, str]] | None = None
    stop: tuple[str, ...] | None = None
    checker: CheckerProgram | None = None  # stdio: this row's checker (else the judge's)


def require_toolchains(names) -> list[Language]:
    """The languages' entries; ToolchainMissing with one line per missing toolchain saying what to install."""
    langs = [language(n) for n in names]
    missing = [line for line in map(missing_tools, langs) if line]
    if missing:
        raise ToolchainMissing("; ".join(missing))
    return langs


class CompiledJudge:
    """``judge(programs)`` -> one Verdict each. The sandbox starts (and its isolation is checked) on first use."""

    def __init__(self, settings: Settings | None = None, slots: int = 2, memory_mb: int = 1024, cache_mb: int = 256,
                 allow_unsandboxed: bool = False, checker=None) -> None:
        self.settings = settings or Settings()
        self.checker = checker  # a CheckerProgram, or a function checker(stdin, output, expected) -> bool
        self.slots = slots or os.cpu_count() or 1  # 0: one slot per core
        self.memory_mb, self.allow_unsandboxed = memory_mb, allow_unsandboxed
        self.cache = CompileCache(cache_mb << 20)  # whole builds
        self.units = CompileCache(cache_mb << 18)  # C/C++ tests' units, shared by a row's completions
        self._sandbox: Sandbox | None = None
        self._checked: set[str] = set()

    def _pool(self) -> Sandbox:
        if self._sandbox is None:
            extra = max(lang.run_cpu_extra_s for lang in LANGUAGES.values())
            cpu = int(max(self.settings.compile_cpu_s, self.settings.cpu_s + extra)) + 2
            limits = Limits(timeout_s=60, cpu_s=cpu, memory_mb=self.memory_mb, processes=64, open_files=256,
                            file_mb=64, disk_mb=128, output_bytes=self.settings.output_bytes)
            present = [lang for lang in LANGUAGES.values() if missing_tools(lang) is None]
            self._sandbox = Sandbox(self.slots, limits, self.allow_unsandboxed, expose=tuple(exposed_paths(present)))
        return self._sandbox

    def judge(self, programs: list[Program]) -> list[Verdict]:
        langs = {p.language for p in programs} | {c.language for c in map(self._checker_of, programs) if c}
        require_toolchains(sorted(langs - self._checked))
        self._checked |= langs
        plans = [self._plan(p) for p in programs]
        verdicts: list[Verdict | None] = [None] * len(programs)
        first, later = [], []  # a build per distinct program and per distinct tests' unit: copies wait for it
        seen: set[str] = set()
        for i, plan in enumerate(plans):
            if isinstance(plan, Verdict):
                verdicts[i] = plan
                continue
            unit = plan["unit"]
            waits = plan["key"] in seen or (unit is not None and unit[0] in seen and unit[0] not in self.units)
            (later if waits else first).append(i)
            seen |= {plan["key"], *([unit[0]] if unit else [])}
        for batch in (first, later):
            jobs = []
            for i in batch:
                job = self._job(plans[i])
                if isinstance(job, Verdict):
                    verdicts[i] = job
                else:
                    jobs.append((i, job))
            runs = self._pool().execute_many([job for _, job in jobs]) if jobs else []
            for (i, _), run in zip(jobs, runs):
                self._remember(plans[i], run)
                plans[i]["run"] = run
        checked = self._check([(i, plans[i]) for i, v in enumerate(verdicts) if v is None], programs)
        for i, plan in enumerate(plans):
            if verdicts[i] is None:
                verdicts[i] = self._grade(plan, plan["run"], checked.get(i))
        return verdicts  # type: ignore[return-value]

    def _checker_of(self, program: Program) -> CheckerProgram | None:
        if program.cases is None:
            return None
        return program.checker or (self.checker if isinstance(self.checker, CheckerProgram) else None)

    def _check(self, ran: list[tuple[int, dict]], programs: list[Program]) -> dict[int, dict[int, bool | None]]:
        """Checker programs' answers: {program index: {case index: answer}} for the stdio runs that exited 0. A
        checker is built once (then cached) before its runs fan out over the pool."""
        wanted = []  # (program index, checker, case indexes, (stdin, output, expected) per case)
        for i, plan in ran:
            checker = self._checker_of(programs[i])
            if checker is None or plan["run"].build != "built":
                continue
            stdouts = plan["run"].stdouts
            cases = [k for k in range(len(plan["cases"])) if stdouts.get(k, ("", ""))[1] == "exit"]
            wanted.append((i, checker, cases, [(plan["cases"][k][0], stdouts[k][0], plan["cases"][k][1])
                                                for k in cases]))
        answers: dict[int, dict[int, bool | None]] = {}
        jobs, builds = [], {}
        for i, checker, cases, runs in wanted:
            lang = language(checker.language)
            job = checker_job(lang, checker.source, runs, self.settings)
            key = cache_key(lang, job["build"])
            if key not in builds:
                builds[key] = self._checker_build(key, job)
            if builds[key] is None:  # the checker does not build: no answer is the solution's
                answers[i] = dict.fromkeys(cases)
            elif cases:
                jobs.append((i, cases, {**job, "cached": builds[key], "timeout_s": job_timeout(job)}))
            else:
                answers[i] = {}
        executions = self._pool().execute_many([job for _, _, job in jobs]) if jobs else []
        for (i, cases, _), run in zip(jobs, executions):
            answers[i] = dict(zip(cases, checker_answers(run, len(cases))))
        return answers

    def _checker_build(self, key: str, job: dict) -> dict | None:
        """The checker's build from the cache, or built now (no runs); None when it does not build (its runs then
        report no build, and every answer is the checker's failure)."""
        if (cached := self.cache.get(key)) is None:
            run = self._pool().execute_many([{**job, "stdins": [], "files": [], "timeout_s": job_timeout(job)}])[0]
            if run.build and run.artifacts:
                self.cache.put(key, run.build, run.build_log, run.artifacts)
            cached = (run.build, run.build_log, run.artifacts)
        return cached[2] if cached[0] == "built" and cached[2] else None

    def _job(self, plan: dict) -> dict | Verdict:
        """The sandbox job: a cached build installed, a cached tests' unit linked in, or everything built."""
        cached = self.cache.get(plan["key"])
        plan["cached"] = cached[2] if cached else None
        if cached and cached[0] == "compile_error":
            return Verdict(0.0, "compile_error", cached[1][-500:])
        job = dict(plan["job"])
        if cached:
            job["cached"] = installable(job["build"], cached[2])
        elif plan["unit"] is not None and (unit := self.units.get(plan["unit"][0])) is not None:
            _key, obj, step = plan["unit"]
            job["build"] = use_prebuilt(job["build"], obj, step, unit[2][obj])
        return job

    def _remember(self, plan: dict, run: Execution) -> None:
        too_large = run.build == "built" and plan["job"]["build"]["artifacts"] and not run.artifacts  # > 32 MB
        if plan["cached"] is None and run.build and not too_large:
            self.cache.put(plan["key"], run.build, run.build_log, run.artifacts)
        if plan["unit"] is not None and plan["unit"][1] in run.artifacts:
            key, obj, _ = plan["unit"]
            self.units.put(key, "built", "", {obj: run.artifacts[obj]})

    def _plan(self, program: Program) -> dict | Verdict:
        lang = language(program.language)
        try:
            if program.cases is None:
                head, code, tests = solution_part(program.prompt, program.completion, program.tests, lang, program.stop)
                job, finished = assertion_job(lang, program.prompt, head, code, tests, self.settings)
                plan = {"style": "assertions", "finished": finished, "tests": tests, "trusted": head + tests}
            else:
                code = fenced_code(program.completion, lang)
                job = stdio_job(lang, program.completion if code is None else code,
                                [stdin for stdin, _ in program.cases], self.settings)
                plan = {"style": "stdio", "cases": list(program.cases)}
        except ValueError as err:  # tests the harness cannot wrap: the dataset's problem, not the model's
            return Verdict(None, "infra_error", str(err))
        job["timeout_s"] = job_timeout(job)
        return {**plan, "lang": lang, "job": job, "key": cache_key(lang, job["build"]),
                "unit": shared_unit(lang, job["build"])}

    def _grade(self, plan: dict, run: Execution, checked: dict[int, bool | None] | None) -> Verdict:
        if plan["style"] == "stdio":
            function = None if isinstance(self.checker, CheckerProgram) else self.checker
            return judge_stdio(run, plan["cases"], self.settings.float_tolerance, function, checked)
        return judge_assertions(run, plan["finished"], plan["lang"], plan["tests"], plan["trusted"], plan["cached"])

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
