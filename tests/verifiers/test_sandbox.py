"""The code sandbox against a hostile battery: every attack fails within timeout + 1 s, leaves no
process behind, reaches no network and no secret, and leaves the trainer untouched."""

import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rlvr.verifiers import sandbox as sandbox_module
from rlvr.verifiers.sandbox import UID_BASE, Limits, Sandbox, SandboxUnavailable, grade, outputs_equal

TIMEOUT = 2.0
SECRET = "hunter2-do-not-leak"


@pytest.fixture(scope="module")
def sandbox():
    try:
        box = Sandbox(slots=2, limits=Limits(timeout_s=TIMEOUT, cpu_s=2))
    except SandboxUnavailable as err:  # the refusal itself is tested below
        pytest.skip(f"no isolation on this machine: {err}")
    yield box
    box.close()


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []

    def accept():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    stop = threading.Event()
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


def _sandbox_processes(marker: str = "") -> list[str]:
    """Processes that still run as a sandbox uid, or whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if UID_BASE <= uid < UID_BASE + 100 or (marker and marker in cmdline and pid != str(os.getpid())):
            found.append(f"{pid}: {cmdline}")
    return found


def _hostile(sandbox, code, expected=2):
    started = time.perf_counter()
    run = sandbox.run(code, "solve", [[1]])
    elapsed = time.perf_counter() - started
    return run, grade(run, [expected]), elapsed


CORRECT = "def solve(x):\n    return x + 1\n"

ATTACKS = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n" + CORRECT,
    "allocate_10_gb": "block = bytearray(10 * 2**30)\n" + CORRECT,
    "infinite_loop": "while True:\n    pass\n" + CORRECT,
    "setsid_grandchild": (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', 'RLVR-MARKER-GRANDCHILD'],"
        " start_new_session=True)\n"
        "time.sleep(1000)\n" + CORRECT
    ),
    "gigabyte_of_stdout": "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)\n" + CORRECT,
    "exit_before_tests": "import sys\nsys.exit(0)\n" + CORRECT,
    "hard_exit_before_tests": "import os\nos._exit(0)\n" + CORRECT,
    "forged_pass_output": (
        "import os, sys\nprint('PASSED: all tests passed')\n"
        "os.write(int(sys.argv[1]), b'{\"i\": 0, \"out\": \"999\"}\\n{\"ready\": true}\\n')\n"
        "def solve(x):\n    return 0\n"
    ),
    "always_equal_object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def solve(x):\n    return Anything()\n"
    ),
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\n" + CORRECT,
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_fails_fast_and_leaves_nothing(sandbox, name):
    run, score, elapsed = _hostile(sandbox, ATTACKS[name])
    assert score == 0.0, (name, run)
    assert elapsed < TIMEOUT + 1.0, (name, elapsed)
    assert not _sandbox_processes("RLVR-MARKER"), name  # gone when run() returns, not eventually
    assert len(run.stdout) <= sandbox.limits.output_bytes


def test_network_is_unreachable(sandbox, listener):
    port, accepted = listener
    code = (f"import socket\ndef solve(x):\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
            "    return x + 1\n")
    run, score, _elapsed = _hostile(sandbox, code)
    assert score == 0.0 and "Network is unreachable" in run.errors[0]
    time.sleep(0.3)
    assert accepted == []


def test_files_outside_the_workdir_stay_intact(sandbox):
    folder = Path(tempfile.mkdtemp(prefix="rlvr-canary-"))
    try:
        folder.chmod(0o755)  # reachable by anyone: only the file's own permissions protect it
        canary = folder / "canary.txt"
        canary.write_text("intact")
        canary.chmod(0o644)
        read_back = f"def solve(x):\n    return open({str(canary)!r}).read()\n"
        assert sandbox.run(read_back, "solve", [[1]]).outputs[0] == '"intact"'  # reading is NOT prevented
        code = f"def solve(x):\n    open({str(canary)!r}, 'w').write('pwned')\n    return x + 1\n"
        run, score, _ = _hostile(sandbox, code)
        assert score == 0.0 and "PermissionError" in run.errors[0]
        assert canary.read_text() == "intact"
    finally:
        shutil.rmtree(folder)


def test_environment_secrets_do_not_leak(sandbox, monkeypatch):
    monkeypatch.setenv("RLVR_SECRET", SECRET)
    code = "import os\ndef solve(x):\n    return os.environ.get('RLVR_SECRET', 'none')\n"
    run, score, _ = _hostile(sandbox, code, expected=SECRET)
    assert score == 0.0 and run.outputs[0] == '"none"'
    proc_peek = "import os\ndef solve(x):\n    return sorted(p for p in os.listdir('/proc') if p.isdigit())\n"
    run = sandbox.run(proc_peek, "solve", [[1]])
    assert run.outputs[0] == '["1"]'  # a private PID namespace: only the harness itself is visible


def test_trainer_survives_everything(sandbox):
    for code in ATTACKS.values():
        sandbox.run(code, "solve", [[1]])
    assert os.getppid() > 1  # our own parent is alive, and so are we
    assert grade(sandbox.run(CORRECT, "solve", [[1]]), [2]) == 1.0


def test_correct_solutions_pass_concurrently(sandbox):
    jobs = [(CORRECT, "solve", [[i], [i * 2]]) for i in range(6)]
    runs = sandbox.run_many(jobs)
    assert [grade(r, [i + 1, i * 2 + 1]) for i, r in enumerate(runs)] == [1.0] * 6


def test_partial_results_are_graded_per_test(sandbox):
    code = "def solve(x):\n    if x > 2:\n        raise ValueError('big')\n    return x + 1\n"
    run = sandbox.run(code, "solve", [[1], [2], [3], [4]])
    assert grade(run, [2, 3, 4, 5]) == 0.5 and "ValueError: big" in run.errors[2]


def test_infrastructure_failure_is_none_and_counted(monkeypatch):
    box = Sandbox(slots=1, limits=Limits(timeout_s=TIMEOUT))
    monkeypatch.setattr(box, "python", "/nonexistent/python3")
    run = box.run(CORRECT, "solve", [[1]])
    assert run.status == "infra_error" and grade(run, [2]) is None and box.infra_failures == 1
    box.close()


def test_refuses_without_isolation(monkeypatch):
    real_which = sandbox_module.shutil.which
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None if name == "unshare" else real_which(name))
    with pytest.raises(SandboxUnavailable, match="Refusing to run it unsandboxed; pass allow_unsandboxed=True"):
        Sandbox(slots=1)
    assert Sandbox(slots=1, allow_unsandboxed=True).mode == "none"


@pytest.mark.parametrize(
    "got, expected, equal",
    [("2", 2, True), ("2.0000001", 2, True), ("2.1", 2, False), ("true", True, True), ("1", True, False),
     ("[1, [2, 3]]", [1, [2, 3]], True), ('{"a": 1}', {"a": 1}, True), ('"2"', 2, False), ("not json", 2, False)],
)
def test_output_comparison(got, expected, equal):
    assert outputs_equal(got, expected) is equal
