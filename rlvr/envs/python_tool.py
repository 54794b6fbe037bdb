"""The built-in ``python`` tool: run the model's code in the code graders' sandbox, return what it printed.

Each call is one execution of ``rlvr.verifiers.sandbox.Sandbox`` - the sandbox code rewards use, with the
same isolation (fresh PID, network, mount, IPC, UTS and cgroup namespaces; a private root holding only the
Python runtime; an unprivileged uid per slot with a process cap; no capabilities; the seccomp filter; the
slot's memory cgroup where there is one) and the same kind of limits (``Limits``: CPU seconds and address
space per process, file size, open files, processes, private /work and /tmp of ``disk_mb``). No second
sandbox: the job is an ordinary input/output job whose function (``RUNNER``, fixed code, standard library
only) runs in the candidate process and starts the model's code as a program there - ``python -I -B -u
main.py`` in the candidate's private /work, its own process group, stdin empty, environment empty - the way
``candidate.py`` runs stdin/stdout programs for graders. The model's code is an argument (a string), never
part of the loaded source.

What the model reads: what the code printed on stdout, then ``stderr:`` and what it printed there (an
uncaught exception is its traceback there), then one bracketed line when the run did not end normally: a
timeout, output past the sandbox's ``output_bytes`` (the program is stopped, as graders stop it), a signal
(e.g. SIGXCPU past the CPU limit, SIGKILL from the memory cgroup) or a non-zero exit status not explained by
a traceback. ``(no output)`` when there is nothing to show. Output is bounded: at most ``max_output_chars``
of stdout (its beginning) and of stderr (its end, where the exception is), each cut with a note saying how
much was left out. A failure of the sandbox itself raises ``ToolError`` (an ``error`` observation, counted).

Deadlines: the code gets ``timeout_s`` of wall time; the whole call (sandbox start included) is bounded by
the sandbox's ``timeout_s``, which must be at least ``timeout_s + STARTUP_S``. Give ``run_tool_call`` a
timeout of at least ``PythonTool.deadline_s``, so the sandbox, not the thread deadline, stops the code - more
when more episodes call it at once than the sandbox has slots (a call waits for a free slot first).

NOT protected, beyond what the sandbox's docstring lists: the runner and the model's code run as the same
uid, so the code can kill, trace or impersonate the runner - it then only spoils its own observation
(graders never read this tool's output). Processes the code detaches with ``setsid`` live until the
execution ends (the PID namespace dies with it), not past it. ``-S`` is not passed: the ``site`` module runs
(``exit()`` works) over the empty, hidden package directories, so nothing outside the standard library can
be imported.
"""

from __future__ import annotations

import json
import math
from typing import Self

from rlvr.envs.tools import ToolError
from rlvr.verifiers.sandbox import Execution, Limits, Sandbox, io_job

STARTUP_S = 2.0  # sandbox start + interpreter start + result transfer, with room for a loaded machine
SIGNALS = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM", 24: "SIGXCPU", 25: "SIGXFSZ"}

# Runs inside the sandbox, in the candidate process; returns plain data. Keeps the head of stdout and the
# tail of stderr (``keep`` bytes each), stops the program when both together pass ``stop`` bytes.
RUNNER = r'''
import os, selectors, signal, subprocess, sys, time

def run(code, timeout_s, keep, stop):
    with open("main.py", "w", encoding="utf-8", errors="replace") as f:
        f.write(code)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-I", "-B", "-u", "main.py"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, start_new_session=True)
    out, err, sizes = bytearray(), bytearray(), [0, 0]
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, 0)
    sel.register(proc.stderr, selectors.EVENT_READ, 1)
    status, exited = "exit", False
    while sel.get_map():
        remaining = started + timeout_s - time.monotonic()
        if remaining <= 0:
            status = "timeout"
            break
        events = sel.select(0 if exited else min(remaining, 0.2))
        if not events and exited:
            break  # exited and drained; a detached child may still hold the pipes
        for key, _ in events:
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            sizes[key.data] += len(chunk)
            if key.data == 0:
                out += chunk[:max(0, keep - len(out))]
            else:
                err = (err + chunk)[-keep:]
        if sizes[0] + sizes[1] > stop:
            status = "output_limit"
            break
        exited = exited or proc.poll() is not None
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    returncode = proc.wait()
    return [status, returncode, out.decode(errors="replace"), sizes[0], err.decode(errors="replace"), sizes[1],
            time.monotonic() - started]
'''


class PythonTool:
    """The ``python`` tool (see the module docstring). The tool is the bound method ``.python`` (its name,
    docstring and type hints give the schema); calling the object does the same.

    ``sandbox``: a started ``Sandbox`` to share (e.g. the code graders'); its limits apply and are not
    changed, and closing this tool leaves it open. None: this tool starts its own, with ``slots`` slots and
    the graders' default limits except the deadlines (``timeout_s + STARTUP_S`` for the execution, CPU
    seconds ``ceil(timeout_s) + 1``), and closes it in ``close`` (or at the end of a ``with`` block).
    Raises ``SandboxUnavailable`` when this machine cannot isolate code, ``ValueError`` when ``timeout_s``
    does not fit a given sandbox's limits."""

    def __init__(self, sandbox: Sandbox | None = None, timeout_s: float = 3.0, max_output_chars: int = 1500,
                 slots: int = 2) -> None:
        if not timeout_s > 0:
            raise ValueError(f"PythonTool timeout_s={timeout_s}: must be positive")
        if max_output_chars < 1:
            raise ValueError(f"PythonTool max_output_chars={max_output_chars}: must be at least 1")
        self.timeout_s = float(timeout_s)
        self.max_output_chars = max_output_chars
        self.deadline_s = self.timeout_s + STARTUP_S  # the longest one call runs, once it has a slot
        self._owned = sandbox is None
        if sandbox is None:
            limits = Limits(timeout_s=self.deadline_s, cpu_s=math.ceil(self.timeout_s) + 1)
            sandbox = Sandbox(slots=slots, limits=limits)
        else:
            lim = sandbox.limits
            room = min(lim.timeout_s, lim.test_timeout_s or lim.timeout_s)
            if self.deadline_s > room:
                raise ValueError(
                    f"PythonTool timeout_s={timeout_s:g} does not fit the sandbox's limits (a call may take "
                    f"{room:g} s in all, and starting the sandbox needs {STARTUP_S:g} s of it): pass "
                    f"timeout_s <= {max(room - STARTUP_S, 0):g}, or a sandbox with a longer timeout_s")
        self.sandbox = sandbox

    def python(self, code: str) -> str:
        """Run a Python program (standard library only, no network) and return what it printed: stdout, then stderr.

        Args:
            code: A complete Python program, e.g. print(123 * 456).
        """
        if not isinstance(code, str):
            raise ToolError(f"code must be a string, got {type(code).__name__}")
        keep = 4 * self.max_output_chars  # bytes: up to 4 per character in UTF-8
        job = io_job(RUNNER, "run", [[code, self.timeout_s, keep, self.sandbox.limits.output_bytes]])
        return self.describe(self.sandbox.execute(job))

    __call__ = python

    def describe(self, execution: Execution) -> str:
        """The observation text for one execution of ``RUNNER`` (see the module docstring)."""
        if execution.status == "infra_error":
            raise ToolError(f"the sandbox could not run the code ({_short(execution.load_error)}); try again")
        if execution.status == "timeout":
            return f"[timed out after {self.timeout_s:g} s: the code was stopped]"
        if execution.status != "ran" or 0 not in execution.outputs:
            why = execution.errors.get(0) or execution.load_error or execution.status
            return f"[the run was stopped: {_short(why)}; the code may have killed the process that ran it]"
        status, returncode, out, out_bytes, err, err_bytes, _ = json.loads(execution.outputs[0])
        limit = self.max_output_chars
        parts = []
        if out:
            head = out[:limit]
            cut = out_bytes - len(head.encode())
            parts.append(head.rstrip("\n") + (f"\n[... {cut} more bytes of output not shown]" if cut > 0 else ""))
        if err:
            tail = err[-limit:]
            cut = err_bytes - len(tail.encode())
            note = f"[... {cut} earlier bytes not shown]\n" if cut > 0 else ""
            parts.append("stderr:\n" + note + tail.rstrip("\n"))
        if status == "timeout":
            parts.append(f"[timed out after {self.timeout_s:g} s: the code was stopped]")
        elif status == "output_limit":
            parts.append(f"[stopped: the code printed more than {self.sandbox.limits.output_bytes} bytes]")
        elif returncode < 0:
            parts.append(f"[killed by signal {SIGNALS.get(-returncode, -returncode)}]")
        elif returncode != 0 and not (returncode == 1 and "Traceback" in err):
            parts.append(f"[exit status {returncode}]")
        return "\n".join(parts) if parts else "(no output)"

    def close(self) -> None:
        """Close the sandbox if this tool started it."""
        if self._owned:
            self.sandbox.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short(text: str, limit: int = 200) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit] + "..."
