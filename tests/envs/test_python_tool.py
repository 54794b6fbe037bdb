"""The built-in python tool against ordinary and hostile code: every snippet returns an observation saying what
happened, within the tool's deadline, never a crash or a hang; nothing outside the sandbox is reached."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from rlvr.envs.environment import load_environment
from rlvr.envs.python_tool import STARTUP_S, PythonTool
from rlvr.envs.tools import ToolCall, ToolError, run_tool_call, tool_schema
from rlvr.verifiers.sandbox import Execution, Limits, Sandbox, SandboxUnavailable

TIMEOUT = 1.0
SECRET = "hunter2-python-tool"


@pytest.fixture(scope="module")
def tool():
    try:
        python = PythonTool(timeout_s=TIMEOUT, max_output_chars=300)
    except SandboxUnavailable as err:
        pytest.skip(f"the sandbox reports it cannot isolate code on this machine: {err}")
    with python:
        yield python


def run(tool: PythonTool, code: str) -> str:
    start = time.perf_counter()
    text = tool.python(code)
    assert time.perf_counter() - start < tool.deadline_s  # never hangs past the deadline
    return text


def sandbox_processes(tool: PythonTool) -> list[str]:
    """Processes still running as a slot's candidate uid (root mode; in user-namespace mode uids are shared)."""
    uids = {str(tool.sandbox.uids.candidate(slot)) for slot in range(2)}
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if uid_line.split()[1] in uids:
            left.append(pid)
    return left


def test_schema_is_the_python_tool():
    assert tool_schema(PythonTool.python) == {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program (standard library only, no network) and return what it printed: "
                           "stdout, then stderr.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "A complete Python program, e.g. "
                                                                        "print(123 * 456)."}},
                "required": ["code"],
            },
            "return": {"type": "string"},
        },
    }


def test_prints_and_exceptions(tool):
    assert run(tool, "print(123456 * 789)") == "97406784"
    assert run(tool, "") == "(no output)"
    text = run(tool, "print('before')\nx = {}\nx['missing']")
    assert text.startswith("before\nstderr:\nTraceback (most recent call last):\n  File \"/work/main.py\", line 3")
    assert text.endswith("KeyError: 'missing'")
    assert run(tool, "import sys\nprint('bye')\nsys.exit(3)") == "bye\n[exit status 3]"


def test_fork_bomb_is_contained(tool):
    text = run(tool, "import os\nwhile True:\n    os.fork()")
    # the process cap refuses forks: the processes die of BlockingIOError, their tracebacks interleaved in the
    # (bounded) tail of stderr, so the name itself may be cut from what is kept
    assert text.startswith("stderr:") and ("BlockingIOError" in text or "Traceback (most recent call last)" in text)
    text = run(tool, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert text == f"[timed out after {TIMEOUT:g} s: the code was stopped]"
    if tool.sandbox.mode == "root":
        assert sandbox_processes(tool) == []  # the PID namespace died with the execution


def test_no_network_not_even_the_hosts_loopback(tool):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    text = run(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)\nprint('in')")
    assert text.startswith("stderr:\n") and "in\n" not in text
    assert text.splitlines()[-1].startswith(("ConnectionRefusedError", "OSError: [Errno 101]", "TimeoutError"))
    text = run(tool, "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=0.5)")
    assert text.splitlines()[-1] == "OSError: [Errno 101] Network is unreachable"
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # a completed connection would wait in the backlog
        server.accept()
    server.close()


def test_files_outside_are_not_there(tool, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    secret.chmod(0o644)
    for path in (secret, "/etc/shadow", Path.cwd() / "pyproject.toml"):
        text = run(tool, f"print(open({str(path)!r}).read())")
        assert SECRET not in text
        assert text.splitlines()[-1] == f"FileNotFoundError: [Errno 2] No such file or directory: '{path}'"


def test_infinite_loop_times_out_keeping_what_was_printed(tool):
    assert run(tool, "print('started')\nwhile True:\n    pass") == (
        f"started\n[timed out after {TIMEOUT:g} s: the code was stopped]")


def test_huge_output_is_bounded(tool):
    limit = tool.sandbox.limits.output_bytes
    text = run(tool, "print('x' * 10_000_000)")
    head, note, stopped = text.split("\n")
    assert head == "x" * 300
    assert note.startswith("[... ") and note.endswith(" more bytes of output not shown]")
    assert int(note.split()[1]) > limit - 300
    assert stopped == f"[stopped: the code printed more than {limit} bytes]"
    text = run(tool, "import sys\nfor i in range(200):\n    print(i)\nprint('E' * 1000, file=sys.stderr)\n")
    assert text.startswith("0\n1\n2\n")
    # stdout: 690 bytes, its first 300 shown; stderr: 1001 bytes, its last 300 shown (299 E's and the newline).
    assert text.endswith("\n[... 390 more bytes of output not shown]\nstderr:\n[... 701 earlier bytes not shown]\n"
                         + "E" * 299)
    assert len(text) < 3 * 300


def test_memory_bomb_is_an_error(tool):
    text = run(tool, "x = bytearray(8 * 1024**3)")
    assert text.splitlines()[-1] in ("MemoryError", "[killed by signal SIGKILL]")


def test_through_run_tool_call_and_an_environment(tool):
    obs = run_tool_call(ToolCall("python", {"code": "print(2 ** 100)"}), {"python": tool.python}, tool.deadline_s)
    assert (obs.kind, obs.text) == ("ok", "1267650600228229401496703205376")
    obs = run_tool_call(ToolCall("python", {"code": 5}), {"python": tool}, tool.deadline_s)
    assert (obs.kind, obs.text) == ("error", "error: code must be a string, got int")

    class Scratch:
        def reset(self, **kwargs) -> str:
            return " Use the python tool."

    env = load_environment(Scratch, tools=[tool.python]).episode()
    env.reset({})
    [obs] = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(sum(range(10)))"}}</tool_call>',
                     timeout_s=tool.deadline_s)
    assert (obs.tool, obs.kind, obs.text) == ("python", "ok", "45")
    assert env.stats.calls == {"python": 1}


def test_a_shared_sandbox_keeps_its_limits_and_stays_open():
    try:
        box = Sandbox(slots=1, limits=Limits(timeout_s=TIMEOUT + STARTUP_S))
    except SandboxUnavailable as err:
        pytest.skip(f"the sandbox reports it cannot isolate code on this machine: {err}")
    try:
        with pytest.raises(ValueError, match=r"PythonTool timeout_s=2 does not fit the sandbox's limits .* pass "
                                             r"timeout_s <= 1, or a sandbox with a longer timeout_s"):
            PythonTool(box, timeout_s=2.0)
        with PythonTool(box, timeout_s=TIMEOUT) as python:
            assert python("print('shared')") == "shared"
        assert box.run("def f():\n    return 7\n", "f", [[]]).outputs == {0: "7"}  # still open
    finally:
        box.close()


def test_a_sandbox_failure_is_a_tool_error():
    tool = PythonTool.__new__(PythonTool)  # describe() only; no sandbox started
    tool.timeout_s, tool.max_output_chars = 1.0, 100
    with pytest.raises(ToolError, match=r"the sandbox could not run the code \(no namespaces\); try again"):
        tool.describe(Execution("infra_error", load_error="no namespaces"))
    assert tool.describe(Execution("ran", errors={0: "the candidate stopped answering"})) == (
        "[the run was stopped: the candidate stopped answering; the code may have killed the process that ran it]")
