"""Run model-written Python against input/output tests in a local sandbox.

Each execution is ``prlimit ... -- unshare --net --pid --fork --mount-proc --kill-child [--setuid U]
python -I -S -B harness.py`` in a fresh temporary directory:

- its own session and process group; the code runs in a new PID namespace whose init dies with the
  launcher (``--kill-child``), so killing the group kills every descendant, grandchildren that called
  ``setsid`` included. Wall-clock timeout, then SIGKILL.
- rlimits: CPU seconds, address space, file size, open files, no core dumps, and a process-count cap
  (RLIMIT_NPROC, enforced because the code runs as a dedicated unprivileged uid per pool slot).
- a new network namespace: no interface but a down loopback, so nothing outside is reachable.
- an empty environment (no inherited secrets), stdin closed, stdout/stderr kept up to a byte cap (more
  output than that ends the run).
- grading by the parent: the harness reports each return value on a private pipe, and the parent
  compares it with expected outputs the child never sees. Exit codes and printed text are ignored, so
  ``sys.exit(0)`` before the tests or printing ``PASSED`` earns nothing.
- a sandbox that cannot start (no launcher, no namespaces, a crash before the harness reports
  ready) is an infrastructure failure: the completion scores None (excluded from training, counted),
  never 0.

What is NOT protected: the code can read world-readable files (the project, /etc, Python's stdlib) and
write where any unprivileged user may (e.g. /tmp, within RLIMIT_FSIZE); it shares the kernel with the
trainer (a kernel exploit escapes); CPU time is limited per execution but not weighted against the
trainer. As a non-root user (user-namespace mode) the code keeps the trainer user's file permissions
and its process cap counts against that user. Where neither root nor user namespaces are available the
sandbox refuses to run unless ``allow_unsandboxed=True`` is passed explicitly (then nothing above holds
except the rlimits).
"""

from __future__ import annotations

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("harness.py")
UID_BASE = 61000  # pool slot k runs as uid/gid UID_BASE + k


class SandboxUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0  # wall clock for the whole execution (all tests)
    cpu_s: int = 5
    memory_mb: int = 1024  # address space
    file_mb: int = 16  # largest file the code may write
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 64 * 1024  # stdout and stderr each


@dataclass
class Execution:
    status: str  # "ran" | "timeout" | "output_limit" | "infra_error"
    outputs: dict[int, str] = field(default_factory=dict)  # test index -> JSON of the return value
    errors: dict[int, str] = field(default_factory=dict)
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
    """An interpreter the sandbox user may execute (the trainer's may live under a private home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and Path(candidate).exists() and _world_executable(Path(candidate)):
            return str(Path(candidate).resolve())
    raise SandboxUnavailable("no Python interpreter that an unprivileged user can execute was found")


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


class Sandbox:
    """A pool of sandbox slots; ``run`` may be called from several threads at once."""

    def __init__(self, slots: int = 2, limits: Limits = Limits(), allow_unsandboxed: bool = False) -> None:
        self.limits = limits
        self.python = find_python()
        self.mode = self._probe(allow_unsandboxed)
        self._slots = list(range(slots))
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="rlvr-sandbox")
        self.infra_failures = 0

    # -- isolation -------------------------------------------------------------------------
    def _probe(self, allow_unsandboxed: bool) -> str:
        """'root' (namespaces + per-slot uid), 'userns' (unprivileged user namespaces) or 'none'."""
        self._unshare, self._prlimit = shutil.which("unshare"), shutil.which("prlimit")
        if self._unshare and self._prlimit:
            modes = ["root"] if os.geteuid() == 0 else []
            modes.append("userns")
            for mode in modes:
                try:
                    probe = subprocess.run(self._launcher(mode, 0) + [shutil.which("true") or "/bin/true"],
                                           capture_output=True, timeout=10, env={}, check=False)
                except (OSError, subprocess.TimeoutExpired):
                    continue
                if probe.returncode == 0:
                    return mode
        if allow_unsandboxed:
            return "none"
        raise SandboxUnavailable(
            "cannot isolate model-written code: need util-linux 'unshare' and 'prlimit' with either root or "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1). Refusing to run it "
            "unsandboxed; pass allow_unsandboxed=True only for code you trust."
        )

    def _launcher(self, mode: str, slot: int) -> list[str]:
        if mode == "none":
            return []
        common = ["--net", "--pid", "--fork", "--mount-proc", "--kill-child"]
        if mode == "root":
            uid = str(UID_BASE + slot)
            return [self._unshare, *common, "--setgid", uid, "--setuid", uid]
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

    # -- execution -------------------------------------------------------------------------
    def run(self, code: str, entry_point: str, inputs: list[list]) -> Execution:
        with self._lock:
            while not self._slots:
                self._lock.wait()
            slot = self._slots.pop()
        try:
            return self._run(slot, code, entry_point, inputs)
        finally:
            with self._lock:
                self._slots.append(slot)
                self._lock.notify()

    def run_many(self, jobs: list[tuple[str, str, list[list]]]) -> list[Execution]:
        return list(self._pool.map(lambda job: self.run(*job), jobs))

    def _run(self, slot: int, code: str, entry_point: str, inputs: list[list]) -> Execution:
        started = time.perf_counter()
        workdir = Path(tempfile.mkdtemp(prefix="rlvr-sandbox-"))
        read_fd = write_fd = -1
        try:
            (workdir / "job.json").write_text(json.dumps({"code": code, "entry_point": entry_point, "inputs": inputs}))
            shutil.copy(HARNESS, workdir / "harness.py")
            if self.mode == "root":
                uid = UID_BASE + slot
                for path in (workdir, workdir / "job.json", workdir / "harness.py"):
                    os.chown(path, uid, uid)
            os.chmod(workdir, 0o700)
            read_fd, write_fd = os.pipe()
            cmd = self._rlimits(self.mode) + self._launcher(self.mode, slot)
            cmd += [self.python, "-I", "-S", "-B", "harness.py", str(write_fd)]
            try:
                proc = subprocess.Popen(cmd, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, pass_fds=(write_fd,), start_new_session=True)
            except OSError as err:
                self.infra_failures += 1
                return Execution("infra_error", load_error=f"could not start the sandbox: {err}")
            os.close(write_fd)
            write_fd = -1
            result = self._collect(proc, read_fd, started)
            if result.status != "infra_error":
                return result
            self.infra_failures += 1
            return result
        finally:
            for fd in (read_fd, write_fd):
                if fd >= 0:
                    os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen, results_fd: int, started: float) -> Execution:
        cap = self.limits.output_bytes
        buffers = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray()}
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(results_fd, selectors.EVENT_READ, "results")
        deadline = started + self.limits.timeout_s
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
        ready = False
        for line in bytes(buffers["results"]).splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("ready") is True:
                ready = True
            elif "load_error" in record:
                out.load_error = str(record["load_error"])
            elif isinstance(record.get("i"), int) and record["i"] not in out.outputs and record["i"] not in out.errors:
                if isinstance(record.get("out"), str):
                    out.outputs[record["i"]] = record["out"]
                else:
                    out.errors[record["i"]] = str(record.get("error", "no output"))
        if not ready and status == "ran":
            out.status = "infra_error"
            out.load_error = out.stderr.decode(errors="replace")[-500:] or "the sandbox exited before starting"
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)


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
