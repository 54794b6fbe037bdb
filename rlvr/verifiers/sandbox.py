"""Run model-written Python in a local sandbox, against tests it never sees.

Each execution is ``prlimit ... -- unshare --net --pid --fork --mount --ipc --uts --cgroup --kill-child
python -I -S -B jail.py`` as root (or inside an unprivileged user namespace), started inside the slot's
memory cgroup where there is one (``memcg.py``). ``jail.py`` is PID 1 of the new PID namespace; it builds a
private root filesystem, forks the candidate process (``candidate.py``, which loads the model's code) as
one uid and runs the checker (``harness.py``) as another:

- filesystem: a tmpfs root with read-only binds of only the Python runtime (/usr, /lib*, the
  interpreter's prefix; site-packages and dist-packages covered by empty tmpfs), /etc/ld.so.cache, five
  /dev nodes, this namespace's /proc, and private size-limited /work and /tmp that vanish with the run.
  The project, the datasets, /home, /root and the host's /tmp are not there at all (see ``jail.py``).
- processes: its own session; killing the launcher kills the PID namespace and every descendant,
  grandchildren that called ``setsid`` included. Wall-clock timeout, then SIGKILL.
- rlimits: CPU seconds, address space, file size, open files, no core dumps, and a process-count cap
  (RLIMIT_NPROC, enforced because the code runs as a dedicated unprivileged uid per pool slot, which no other
  sandbox on the machine uses at the same time: slot_uids.py).
- memory: where a memory cgroup can be made (cgroup v2 with memory delegable to the trainer's cgroup's
  children, or a v1 memory hierarchy), one per slot caps the resident memory of the whole execution, tmpfs
  pages included (``Limits.slot_memory_mb``); ``Sandbox.memory_cgroup`` says which, or why there is none.
- capabilities: none (empty bounding set, no_new_privs); the filesystem is nosuid. A seccomp filter refuses
  new user namespaces (which would hand the code every capability inside one) and the keyring, bpf, perf,
  userfaultfd and io_uring system calls (x86_64 and aarch64; see ``jail.py``).
- network: a new namespace with no interface but a down loopback, so nothing outside is reachable.
- IPC, UTS and cgroup namespaces of its own: SysV / POSIX shared memory, semaphores and message queues die
  with the execution and never meet the host's; the hostname is ``sandbox``; /proc/self/cgroup shows no
  host path.
- an empty environment (no inherited secrets), stdin closed, stdout/stderr kept up to a byte cap (more
  output than that ends the run).
- grading: the candidate process never receives a test. For input/output and stdin/stdout tests it
  returns values (or program output) and the trainer compares them with expected values that never
  enter the sandbox. For assert-based tests (HumanEval ``check``, MBPP ``test_list``) the checker runs
  them as a different uid the candidate cannot signal, trace or read; every value the candidate returns
  crosses a pipe as plain data (``plain.py``), so an object whose ``__eq__`` always says yes cannot pass,
  and only the checker holds the pipe to the trainer, so printing or writing a forged result earns
  nothing. Exiting or dying before the checks finish fails the tests not yet reported. The tests' globals
  hold only the names they read and do not bind, never a builtin, a dunder or a module they import: a
  solution's ``def sorted(...)`` never reaches them (``harness.test_namespace``).
- a sandbox that cannot start (no launcher, no namespaces, no private root, a crash before the checker
  reports ready) is an infrastructure failure: the completion scores None (excluded from training,
  counted), never 0.

What is NOT protected:
- the kernel is shared with the trainer: a kernel exploit through a system call the filter allows escapes
  (the filter is a short deny list, not Docker's allow list); on other architectures than x86_64 and
  aarch64 there is no filter (in user-namespace mode the namespace limit still forbids nested ones).
- the files of the Python runtime's directories are readable (/usr and the interpreter prefix: standard
  library, system binaries and shared libraries, documentation).
- CPU time is limited per execution but not weighted against the trainer; no CPU or I/O cgroup.
- without a memory cgroup (cgroup v1 without a writable memory hierarchy, v2 where the trainer's cgroup
  holds processes and no delegated parent is given, read-only /sys/fs/cgroup) memory is bounded only per
  process (``memory_mb`` of address space × ``processes`` per slot) and the tmpfs pages of /work and /tmp
  (``disk_mb`` each) come out of host memory.
- grading trusts the dataset: its tests, setup code and a HumanEval prompt's helpers run in the checker.
  An MBPP test that calls a second function of the solution gets the solution's (that is the task), so a
  dataset whose asserts check one solution function with another can be satisfied by rewriting both.
- the model's code may write to stdout and stderr (kept up to a byte cap) and learn the slot's limits and
  uids; timing differences across executions are observable.
- as a non-root user (user-namespace mode) checker and candidate share a uid (the checker is protected from
  tracing by being non-dumpable and keeping capabilities the candidate lacks) and the process cap counts
  against that user.
- where neither root nor user namespaces are available the sandbox refuses to run unless
  ``allow_unsandboxed=True`` is passed explicitly (then nothing above holds except the rlimits).
"""

from __future__ import annotations

import glob
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rlvr.verifiers.memcg import SlotCgroups
from rlvr.verifiers.slot_uids import SlotUids

HERE = Path(__file__).resolve().parent
JAIL = HERE / "jail.py"
SANDBOX_FILES = {"candidate.py": str(HERE / "candidate.py"), "plain.py": str(HERE / "plain.py")}
RUNTIME_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PACKAGE_DIRS = ("/usr/lib/python3/dist-packages", "/usr/lib/python3*/site-packages",
                "/usr/local/lib/python3*/dist-packages", "/usr/local/lib/python3*/site-packages")


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock for the whole execution (all tests)
    cpu_s: int = 5  # per process
    memory_mb: int = 1024  # address space, per process
    file_mb: int = 16  # largest file the code may write
    disk_mb: int = 16  # size of the private /work and of the private /tmp
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 64 * 1024  # stdout and stderr each; a program's stdout per test
    test_timeout_s: float | None = None  # one test (a call, a check, a program run); None: timeout_s
    slot_memory_mb: int | None = None  # resident memory of a whole execution (memory cgroup); None: memory_mb


@dataclass
class Execution:
    status: str  # "ran" | "timeout" | "output_limit" | "infra_error"
    outputs: dict[int, str] = field(default_factory=dict)  # io: test index -> JSON of the return value
    passed: set[int] = field(default_factory=set)  # humaneval / mbpp: tests that ran to the end
    stdouts: dict[int, tuple[str, str]] = field(default_factory=dict)  # program: index -> (stdout, status)
    errors: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)  # compiled: index -> the run's stderr tail
    returncodes: dict[int, int] = field(default_factory=dict)  # compiled: index -> exit status (-N: signal N)
    build: str = ""  # compiled: "built" | "compile_error" | "compile_timeout" ("" when it never reported)
    build_log: str = ""  # the compiler's output tail
    artifacts: dict[str, str] = field(default_factory=dict)  # compiled: what the build left (base64), for a cache
    load_error: str = ""
    stdout: bytes = b""
    stderr: bytes = b""
    seconds: float = 0.0


def _world_executable(path: Path) -> bool:
    path = path.resolve()
    for part in [path, *path.parents]:
        mode = part.stat().st_mode
        if not mode & stat.S_IXOTH:
            return False
    return bool(path.stat().st_mode & stat.S_IROTH)


def find_python() -> str:
    """An interpreter the sandbox users may execute (the trainer's may live under a private home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and Path(candidate).exists() and _world_executable(Path(candidate)):
            return str(Path(candidate).resolve())
    raise SandboxUnavailable("no Python interpreter that an unprivileged user can execute was found")


def runtime_view(python: str) -> tuple[list[str], list[str]]:
    """(paths the sandbox sees read-only, package directories covered by empty tmpfs) for ``python``."""
    query = ("import json, sys, sysconfig; p = sysconfig.get_paths(); "
             "print(json.dumps([sys.base_prefix, p['purelib'], p['platlib']]))")
    try:
        out = subprocess.run([python, "-I", "-S", "-c", query], capture_output=True, text=True, env={}, check=True)
        prefix, purelib, platlib = json.loads(out.stdout)
    except (OSError, subprocess.CalledProcessError, ValueError) as err:
        raise SandboxUnavailable(f"cannot inspect the sandbox's interpreter {python}: {err}") from None
    expose = [p for p in RUNTIME_DIRS if os.path.lexists(p)]
    if not any(prefix == p or prefix.startswith(p + "/") for p in expose):
        expose.append(prefix)  # e.g. an interpreter under /opt
    hide = sorted({purelib, platlib, *(d for pattern in PACKAGE_DIRS for d in glob.glob(pattern))})
    return expose, [d for d in hide if os.path.isdir(d)]


def outputs_equal(got_json: str, expected: object) -> bool:
    """Exact equality of JSON values, except floats, which match within rel 1e-6 / abs 1e-9."""
    try:
        got = json.loads(got_json)
    except ValueError:
        return False
    return _equal(got, expected)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def io_job(code: str, entry_point: str, inputs: list[list]) -> dict:
    """The job for input/output tests: call ``entry_point(*args)`` for each input, report the results."""
    return {"format": "io", "sources": [code], "entry_point": entry_point, "inputs": inputs}


class Sandbox:
    """A pool of sandbox slots; ``execute`` may be called from several threads at once.

    ``memory_cgroup``: True makes a memory cgroup per slot under the trainer's own cgroup where it can
    (``memcg.py``), a path makes them under that cgroup directory, False makes none."""

    def __init__(self, slots: int = 2, limits: Limits = Limits(), allow_unsandboxed: bool = False,
                 memory_cgroup: bool | str = True, expose: tuple[str, ...] = ()) -> None:
        self.limits = limits
        self.python = find_python()
        self._expose, self._hide = runtime_view(self.python)
        self._expose += [p for p in expose if os.path.isdir(p) and p not in self._expose]  # e.g. a rustup toolchain
        self._slots = list(range(slots))
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="rlvr-sandbox")
        self.infra_failures = 0
        self._cgroups = SlotCgroups(slots if memory_cgroup else 0, limits.slot_memory_mb or limits.memory_mb,
                                    memory_cgroup if isinstance(memory_cgroup, str) else None)
        self._finalizer = weakref.finalize(self, self._cgroups.close)
        if self._cgroups.paths and not self._can_join_cgroup():
            self._cgroups.close()  # made, but this user may not move processes into it
            self._cgroups.reason = "no memory cgroup (cannot join it); only the address-space limit holds"
        self.uids = SlotUids(slots, claim=os.geteuid() == 0)  # as root: uids no other sandbox uses (slot_uids.py)
        self._release_uids = weakref.finalize(self, self.uids.close)
        self.mode = self._probe(allow_unsandboxed)
        if self.mode != "root":  # every slot runs as this user: nothing to hold
            self.uids.close()

    @property
    def memory_cgroup(self) -> str:
        """'cgroup v1' / 'cgroup v2' (a memory cgroup per slot), or why there is none."""
        return f"cgroup {self._cgroups.version}" if self._cgroups.paths else self._cgroups.reason

    # -- isolation -------------------------------------------------------------------------
    def _probe(self, allow_unsandboxed: bool) -> str:
        """'root' (namespaces, private root, per-slot uids), 'userns' (unprivileged user namespaces) or
        'none'. A mode counts only when a whole execution works in it."""
        self._unshare, self._prlimit = shutil.which("unshare"), shutil.which("prlimit")
        problems = []
        if self._unshare and self._prlimit:
            modes = ["root"] if os.geteuid() == 0 else []
            modes.append("userns")
            for mode in modes:
                run = self._run(mode, 0, io_job("def f():\n    return 1\n", "f", [[]]))
                if run.status == "ran" and run.outputs == {0: "1"}:
                    return mode
                problems.append(f"{mode}: {run.load_error or run.status}"[:300])
        else:
            problems.append("util-linux 'unshare' and 'prlimit' are not on PATH")
        if allow_unsandboxed:
            return "none"
        raise SandboxUnavailable(
            "cannot isolate model-written code (" + "; ".join(problems) + "). The sandbox needs util-linux "
            "'unshare' and 'prlimit' with either root or unprivileged user namespaces (sysctl "
            "kernel.unprivileged_userns_clone=1) and permission to mount tmpfs in them. Refusing to run it "
            "unsandboxed; pass allow_unsandboxed=True only for code you trust."
        )

    def _launcher(self, mode: str) -> list[str]:
        if mode == "none":
            return []
        common = ["--net", "--pid", "--fork", "--mount", "--ipc", "--uts", "--cgroup", "--kill-child"]
        if mode == "root":
            return [self._unshare, *common]
        return [self._unshare, "--user", "--map-root-user", *common]

    def _rlimits(self, mode: str) -> list[str]:
        if self._prlimit is None:  # only reachable with allow_unsandboxed=True
            return []
        lim = self.limits
        nproc = lim.processes
        if mode != "root":  # RLIMIT_NPROC counts every process of the (shared) real uid
            nproc += len([p for p in os.listdir("/proc") if p.isdigit()])
        return [self._prlimit, f"--cpu={lim.cpu_s}", f"--as={lim.memory_mb << 20}", f"--fsize={lim.file_mb << 20}",
                f"--nofile={lim.open_files}", "--core=0", f"--nproc={nproc}", "--"]

    def _join_cgroup(self, slot: int) -> list[str]:
        """A shell that moves itself into the slot's memory cgroup, then execs the rest (so all of it runs
        there, and the cgroup namespace's root is that cgroup); nothing without a memory cgroup."""
        if not self._cgroups.paths:
            return []
        script = 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"'
        return ["/bin/sh", "-c", script, "rlvr-sandbox", self._cgroups.paths[slot]]  # POSIX: /bin/sh exists

    def _can_join_cgroup(self) -> bool:
        return subprocess.run(self._join_cgroup(0), env={}, capture_output=True, check=False).returncode == 0

    # -- execution -------------------------------------------------------------------------
    def execute(self, job: dict) -> Execution:
        """Run one job (``io_job``, or see ``rlvr.verifiers.code_formats``) in a free slot."""
        with self._lock:
            while not self._slots:
                self._lock.wait()
            slot = self._slots.pop()
        try:
            return self._run(self.mode, slot, job)
        finally:
            with self._lock:
                self._slots.append(slot)
                self._lock.notify()

    def run(self, code: str, entry_point: str, inputs: list[list]) -> Execution:
        """Input/output tests: ``entry_point(*args)`` for each of ``inputs``; grade with ``grade``."""
        return self.execute(io_job(code, entry_point, inputs))

    def execute_many(self, jobs: list[dict]) -> list[Execution]:
        return list(self._pool.map(self.execute, jobs))

    def _run(self, mode: str, slot: int, job: dict) -> Execution:
        started = time.perf_counter()
        workdir = Path(tempfile.mkdtemp(prefix="rlvr-sandbox-"))
        read_fd = write_fd = -1
        try:
            os.chmod(workdir, 0o700)
            (workdir / "root").mkdir()
            lim = self.limits
            setup = {"mode": mode, "root": str(workdir / "root"), "expose": self._expose, "hide": self._hide,
                     "expose_files": ["/etc/ld.so.cache"], "python": self.python, "disk_mb": lim.disk_mb,
                     "checker_uid": self.uids.checker(slot), "candidate_uid": self.uids.candidate(slot),
                     "sandbox_files": SANDBOX_FILES}
            full_job = {**job, "setup": setup, "output_bytes": lim.output_bytes,
                        "test_timeout_s": lim.test_timeout_s or lim.timeout_s}
            (workdir / "job.json").write_text(json.dumps(full_job))
            read_fd, write_fd = os.pipe()
            cmd = self._join_cgroup(slot) + self._rlimits(mode) + self._launcher(mode)
            cmd += [self.python, "-I", "-S", "-B", str(JAIL), str(workdir / "job.json"), str(write_fd)]
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
            except OSError as err:
                self.infra_failures += 1
                return Execution("infra_error", load_error=f"could not start the sandbox: {err}")
            os.close(write_fd)
            write_fd = -1
            result = self._collect(proc, read_fd, started, job.get("timeout_s") or lim.timeout_s)
            if result.status == "infra_error":
                self.infra_failures += 1
            return result
        finally:
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen, results_fd: int, started: float, timeout_s: float) -> Execution:
        cap = self.limits.output_bytes
        buffers = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray()}
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(results_fd, selectors.EVENT_READ, "results")
        deadline = started + timeout_s
        status = "ran"
        result_cap = cap + 64 * 1024 * 1024  # return values may be large, but not unbounded
        while sel.get_map():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buffers[key.data] += chunk
                if len(buffers[key.data]) > (result_cap if key.data == "results" else cap):
                    status = "output_limit"
            if status != "ran":
                break
        sel.close()
        _terminate(proc)
        proc.stdout.close()
        proc.stderr.close()
        out = Execution(status, stdout=bytes(buffers["stdout"][:cap]), stderr=bytes(buffers["stderr"][:cap]),
                        seconds=time.perf_counter() - started)
        ready, seen = False, set()
        for line in bytes(buffers["results"]).splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("ready") is True:
                ready = True
            elif "load_error" in record:
                out.load_error = str(record["load_error"])
            elif isinstance(record.get("build"), str) and not out.build:
                out.build, out.build_log = record["build"], str(record.get("log", ""))
                if isinstance(record.get("artifacts"), dict):
                    out.artifacts = record["artifacts"]
            elif isinstance(record.get("i"), int) and record["i"] not in seen:
                i = record["i"]
                seen.add(i)
                if isinstance(record.get("out"), str):
                    out.outputs[i] = record["out"]
                elif record.get("passed") is True:
                    out.passed.add(i)
                elif isinstance(record.get("stdout"), str):
                    out.stdouts[i] = (record["stdout"], str(record.get("status")))
                    if isinstance(record.get("stderr"), str):
                        out.stderrs[i] = record["stderr"]
                    if type(record.get("returncode")) is int:
                        out.returncodes[i] = record["returncode"]
                else:
                    out.errors[i] = str(record.get("error", "no output"))
        if not ready and status == "ran":
            out.status = "infra_error"
            out.load_error = out.stderr.decode(errors="replace")[-500:] or "the sandbox exited before starting"
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._finalizer()  # the slots' cgroups
        self._release_uids()


def _terminate(proc: subprocess.Popen) -> None:
    """Kill everything the execution started and return only once it is gone.

    The launcher's child is the PID namespace's init: SIGKILL to it makes the kernel kill every process
    in the namespace and reap them before init itself is reaped by the launcher, so once the launcher
    has exited, nothing is left (setsid'd grandchildren included).
    """
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        for pid in children.read_text().split():
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in the launcher's process group
    except ProcessLookupError:
        pass
    proc.wait()


def grade(execution: Execution, expected: list) -> float | None:
    """Fraction of tests whose return value equals the expected one; None for an infrastructure failure.

    A run that timed out or flooded its output earns 0 whatever it reported before.
    """
    if execution.status == "infra_error":
        return None
    if execution.status != "ran" or not expected:
        return 0.0
    outputs = execution.outputs
    passed = sum(1 for i, want in enumerate(expected) if i in outputs and outputs_equal(outputs[i], want))
    return passed / len(expected)
