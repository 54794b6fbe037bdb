"""The code sandbox against a hostile battery: every attack fails within timeout + 1 s, leaves no
process behind, reaches no network, no secret and no host file, and leaves the trainer untouched."""

import ctypes
import fcntl
import json
import os
import platform
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rlvr.verifiers import sandbox as sandbox_module
from rlvr.verifiers.sandbox import (
    Limits,
    Sandbox,
    SandboxUnavailable,
    grade,
    io_job,
    outputs_equal,
)
from rlvr.verifiers.slot_uids import CANDIDATE_UID, CHECKER_UID, UID_SPAN, SlotUids, lock_dir

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


def _sandbox_processes(marker: str = "", box: Sandbox | None = None) -> list[str]:
    """Processes that still run as a sandbox uid (``box``'s own, when given: other sandboxes on the machine, a
    parallel test worker's say, run as others), or whose command line holds ``marker``."""
    own = {f(k) for k in range(len(box.uids.offsets)) for f in (box.uids.checker, box.uids.candidate)} if box else None
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        sandbox_uid = uid in own if own is not None else any(base <= uid < base + UID_SPAN
                                                             for base in (CHECKER_UID, CANDIDATE_UID))
        if sandbox_uid or (marker and marker in cmdline and pid != str(os.getpid())):
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
    "forged_pass_output": (  # every descriptor it holds gets a forged result; only the checker's pipe counts
        "import os\nprint('PASSED: all tests passed')\n"
        "for fd in range(64):\n    try:\n"
        "        os.write(fd, b'{\"i\": 0, \"out\": \"2\"}\\n{\"i\": 0, \"passed\": true}\\n')\n"
        "    except OSError:\n        pass\n"
        "def solve(x):\n    return 0\n"
    ),
    "always_equal_object": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def solve(x):\n    return Anything()\n"
    ),
    "int_subclass_equal_to_all": (
        "class Two(int):\n    def __eq__(self, other):\n        return True\n"
        "def solve(x):\n    return Two(5)\n"
    ),
    "kill_the_checker": "import os, signal\nos.kill(1, signal.SIGKILL)\n" + CORRECT.replace("x + 1", "0"),
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\n" + CORRECT,
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_fails_fast_and_leaves_nothing(sandbox, name):
    run, score, elapsed = _hostile(sandbox, ATTACKS[name])
    assert score == 0.0, (name, run)
    assert elapsed < TIMEOUT + 1.0, (name, elapsed)
    assert not _sandbox_processes("RLVR-MARKER", sandbox), name  # gone when run() returns, not eventually
    assert len(run.stdout) <= sandbox.limits.output_bytes


def test_network_is_unreachable(sandbox, listener):
    port, accepted = listener
    code = (f"import socket\ndef solve(x):\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
            "    return x + 1\n")
    run, score, _elapsed = _hostile(sandbox, code)
    assert score == 0.0 and "Network is unreachable" in run.errors[0]
    time.sleep(0.3)
    assert accepted == []


def test_host_files_are_invisible_and_untouched(sandbox):
    folder = Path(tempfile.mkdtemp(prefix="rlvr-canary-"))
    try:
        folder.chmod(0o755)  # world-readable, so only the sandbox's own root can hide it
        canary = folder / "answers.jsonl"
        canary.write_text('{"expected": 2}')
        canary.chmod(0o644)
        read_back = f"def solve(x):\n    return open({str(canary)!r}).read()\n"
        run = sandbox.run(read_back, "solve", [[1]])
        assert run.outputs == {} and "FileNotFoundError" in run.errors[0]
        code = f"def solve(x):\n    open({str(canary)!r}, 'w').write('pwned')\n    return x + 1\n"
        run, score, _ = _hostile(sandbox, code)
        assert score == 0.0 and "FileNotFoundError" in run.errors[0]
        assert canary.read_text() == '{"expected": 2}'
    finally:
        shutil.rmtree(folder)


def test_the_filesystem_view_is_private(sandbox):
    project = str(Path(__file__).resolve().parents[2])
    code = (
        "import os\n"
        "def solve(x):\n"
        "    seen = {p: os.path.exists(p) for p in (x['project'], '/home', '/root', '/etc/passwd', x['host_tmp'])}\n"
        "    return {'root': sorted(os.listdir('/')), 'tmp': os.listdir('/tmp'), 'cwd': os.getcwd(), 'seen': seen}\n"
    )
    marker = Path(tempfile.mkdtemp(prefix="rlvr-host-tmp-"))
    try:
        run = sandbox.run(code, "solve", [[{"project": project, "host_tmp": str(marker)}]])
    finally:
        marker.rmdir()
    view = json.loads(run.outputs[0])
    runtime = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc"}  # usr-merge symlinks or binds
    assert {"dev", "proc", "sandbox", "tmp", "usr", "work"} <= set(view["root"]) <= runtime | {"dev", "proc",
                                                                                            "sandbox", "tmp", "work"}
    assert view["tmp"] == [] and view["cwd"] == "/work"
    assert view["seen"] == {project: False, "/home": False, "/root": False, "/etc/passwd": False, str(marker): False}


def test_writes_vanish_with_the_run(sandbox):
    name = f"rlvr-left-behind-{os.getpid()}"
    code = (
        "import os\n"
        f"def solve(x):\n    open('/tmp/{name}', 'w').write('x')\n    open('{name}', 'w').write('x')\n"
        f"    return sorted(os.listdir('/tmp')) + sorted(os.listdir('.'))\n"
    )
    run = sandbox.run(code, "solve", [[1]])
    assert json.loads(run.outputs[0]) == [name, name]  # written inside the sandbox ...
    assert not any(name in p for p in os.listdir(tempfile.gettempdir()))  # ... and gone from the host
    again = sandbox.run("import os\ndef solve(x):\n    return os.listdir('/tmp')\n", "solve", [[1]])
    assert again.outputs[0] == "[]"  # and from the next run


def test_disk_is_limited(sandbox):
    code = ("def solve(x):\n    with open('/tmp/big', 'wb') as f:\n"
            "        for _ in range(64):\n            f.write(b'x' * 2**20)\n    return x + 1\n")
    run, score, _ = _hostile(sandbox, code)
    assert score == 0.0 and run.errors  # stopped by the file-size limit or the tmpfs size


def test_environment_secrets_do_not_leak(sandbox, monkeypatch):
    monkeypatch.setenv("RLVR_SECRET", SECRET)
    code = "import os\ndef solve(x):\n    return os.environ.get('RLVR_SECRET', 'none')\n"
    run, score, _ = _hostile(sandbox, code, expected=SECRET)
    assert score == 0.0 and run.outputs[0] == '"none"'
    proc_peek = "import os\ndef solve(x):\n    return sorted(p for p in os.listdir('/proc') if p.isdigit())\n"
    run = sandbox.run(proc_peek, "solve", [[1]])
    assert run.outputs[0] == '["1", "2"]'  # a private PID namespace: only the checker and the candidate


SYSCALLS = {"x86_64": {"clone": 56, "keyctl": 250}, "aarch64": {"clone": 220, "keyctl": 219}}


def _nested_userns_attacks() -> dict[str, str]:
    """Ways to get a user namespace (every capability inside it), or a keyring: each returns x + 1 if it worked."""
    numbers = SYSCALLS.get(platform.machine(), SYSCALLS["x86_64"])
    head = "import ctypes, os, subprocess\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    fail = "    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
    return {
        "unshare_syscall": head + "def solve(x):\n    if libc.unshare(0x10000000) == 0:\n        return x + 1\n" + fail,
        "clone_syscall": head + "def solve(x):\n"
                         f"    pid = libc.syscall({numbers['clone']}, 0x10000000 | 17, 0, 0, 0, 0)\n"
                         "    if pid == 0:\n        os._exit(0)\n    if pid > 0:\n        os.waitpid(pid, 0)\n"
                         "        return x + 1\n" + fail,
        "unshare_binary": head + "def solve(x):\n    run = subprocess.run(['unshare', '-U', '-r', 'true'],"
                          " capture_output=True, text=True)\n    if run.returncode == 0:\n        return x + 1\n"
                          "    raise OSError(run.stderr)\n",
        "keyctl": head + f"def solve(x):\n    if libc.syscall({numbers['keyctl']}, 0, -2, 1) >= 0:\n"
                  "        return x + 1\n" + fail,  # KEYCTL_GET_KEYRING_ID of the process keyring
    }


@pytest.mark.skipif(platform.machine() not in SYSCALLS, reason="no seccomp filter on this architecture")
@pytest.mark.parametrize("name", sorted(_nested_userns_attacks()))
def test_no_nested_user_namespace_nor_kernel_extras(sandbox, name):
    run, score, _ = _hostile(sandbox, _nested_userns_attacks()[name])
    assert score == 0.0 and "Operation not permitted" in run.errors[0], run


def test_threads_and_subprocesses_still_work_under_the_filter(sandbox):
    # glibc starts threads with clone3 first; the filter answers ENOSYS and it must fall back to clone
    code = ("import subprocess, sys\nfrom concurrent.futures import ThreadPoolExecutor\ndef solve(x):\n"
            "    with ThreadPoolExecutor(4) as pool:\n        doubled = sum(pool.map(lambda v: 2 * v, range(10)))\n"
            "    out = subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True, text=True).stdout\n"
            "    return [doubled, out.strip()]\n")
    assert sandbox.run(code, "solve", [[1]]).outputs == {0: '[90, "7"]'}


def test_user_namespace_mode_also_limits_nested_namespaces_to_none(monkeypatch):
    host_limit = Path("/proc/sys/user/max_user_namespaces").read_text()
    monkeypatch.setattr(sandbox_module.os, "geteuid", lambda: 1000)  # as a non-root trainer would
    try:
        box = Sandbox(slots=1, limits=Limits(timeout_s=TIMEOUT))
    except SandboxUnavailable as err:
        pytest.skip(f"no user namespaces here: {err}")
    monkeypatch.undo()
    assert box.mode == "userns"
    code = "def solve(x):\n    return open('/proc/sys/user/max_user_namespaces').read().strip()\n"
    assert box.run(code, "solve", [[1]]).outputs[0] == '"0"'
    run, score, _ = _hostile(box, _nested_userns_attacks()["unshare_binary"])
    assert score == 0.0 and "unshare failed" in run.errors[0]
    box.close()
    assert Path("/proc/sys/user/max_user_namespaces").read_text() == host_limit  # the host's limit is untouched


def test_own_ipc_uts_and_cgroup_namespaces(sandbox):
    kinds = ("ipc", "uts", "cgroup", "net", "pid", "mnt")
    code = ("import os\ndef solve(x):\n    return {'ns': {k: os.readlink('/proc/self/ns/' + k) for k in x},"
            " 'cgroup': open('/proc/self/cgroup').read().splitlines()}\n")
    view = json.loads(sandbox.run(code, "solve", [[list(kinds)]]).outputs[0])
    host = {k: os.readlink(f"/proc/self/ns/{k}") for k in kinds}
    assert {k for k in kinds if view["ns"][k] == host[k]} == set()
    assert all(line.endswith(":/") for line in view["cgroup"]), view["cgroup"]  # no host cgroup path shows


def test_hostname_is_the_sandboxs_own(sandbox):
    before = socket.gethostname()
    code = ("import ctypes, os, socket\ndef solve(x):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
            "    ok = libc.sethostname(b'pwned', 5) == 0\n    return [socket.gethostname(), ok]\n")
    assert sandbox.run(code, "solve", [[1]]).outputs[0] == '["sandbox", false]'
    assert socket.gethostname() == before


def test_sysv_shared_memory_is_not_the_hosts(sandbox):
    libc = ctypes.CDLL(None, use_errno=True)
    host_key, inside_key = 0x52C00000 + os.getpid() % 65536, 0x52D00000 + os.getpid() % 65536
    host_id = libc.shmget(host_key, 4096, 0o1600)  # IPC_CREAT | 0600
    assert host_id >= 0
    code = ("import ctypes\ndef solve(host_key, inside_key):\n    libc = ctypes.CDLL(None, use_errno=True)\n"
            "    return [libc.shmget(host_key, 0, 0), libc.shmget(inside_key, 4096, 0o1666)]\n")
    try:
        seen, created = json.loads(sandbox.run(code, "solve", [[host_key, inside_key]]).outputs[0])
        left = libc.shmget(inside_key, 0, 0)  # still there after the run: the host's namespace was used
    finally:
        for shm_id in (host_id, locals().get("left", -1)):
            if shm_id >= 0:
                libc.shmctl(shm_id, 0, None)  # IPC_RMID
    assert seen == -1 and created >= 0 and left == -1


def test_memory_cgroup_caps_the_whole_execution():
    limits = Limits(timeout_s=10, cpu_s=10, disk_mb=64, slot_memory_mb=96)
    try:
        box = Sandbox(slots=1, limits=limits)
    except SandboxUnavailable as err:
        pytest.skip(str(err))
    if not box.memory_cgroup.startswith("cgroup"):
        box.close()
        pytest.skip(box.memory_cgroup)
    paths = list(box._cgroups.paths)
    # 60 MB of files in /tmp (tmpfs: memory) and 60 MB in the process: each within its own limit, together
    # over the slot's 96 MB
    code = ("def solve(x):\n    for i in range(4):\n        with open(f'/tmp/{i}', 'wb') as f:\n"
            "            f.write(b'x' * (15 << 20))\n    block = b'y' * (60 << 20)\n    return len(block) > 0\n")
    run = box.run(code, "solve", [[1]])
    assert run.outputs == {} and "stopped answering" in run.errors[0], run  # killed by the OOM killer
    assert grade(box.run(CORRECT, "solve", [[1]]), [2]) == 1.0  # the slot works afterwards
    box.close()
    assert not any(os.path.exists(p) for p in paths)  # the slots' cgroups are removed
    without = Sandbox(slots=1, limits=limits, memory_cgroup=False)
    assert without.run(code, "solve", [[1]]).outputs == {0: "true"}  # the same code, no memory cgroup
    without.close()


def test_without_a_memory_cgroup_the_address_space_limit_holds():
    box = Sandbox(slots=1, limits=Limits(timeout_s=TIMEOUT), memory_cgroup=False)
    assert "only the address-space limit holds" in box.memory_cgroup
    run, score, _ = _hostile(box, ATTACKS["allocate_10_gb"])
    assert score == 0.0 and "MemoryError" in run.load_error
    box.close()


def test_trainer_survives_everything(sandbox):
    for code in ATTACKS.values():
        sandbox.run(code, "solve", [[1]])
    assert os.getppid() > 1  # our own parent is alive, and so are we
    assert grade(sandbox.run(CORRECT, "solve", [[1]]), [2]) == 1.0


def test_correct_solutions_pass_concurrently(sandbox):
    jobs = [io_job(CORRECT, "solve", [[i], [i * 2]]) for i in range(6)]
    runs = sandbox.execute_many(jobs)
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
    box = Sandbox(slots=1, allow_unsandboxed=True)
    assert box.mode == "none" and grade(box.run(CORRECT, "solve", [[1]]), [2]) == 1.0


@pytest.mark.parametrize(
    "got, expected, equal",
    [("2", 2, True), ("2.0000001", 2, True), ("2.1", 2, False), ("true", True, True), ("1", True, False),
     ("[1, [2, 3]]", [1, [2, 3]], True), ('{"a": 1}', {"a": 1}, True), ('"2"', 2, False), ("not json", 2, False)],
)
def test_output_comparison(got, expected, equal):
    assert outputs_equal(got, expected) is equal


def test_two_sandboxes_in_two_processes_never_share_a_uid():
    """Each claims its slots' uids under a lock (slot_uids.py): a second process gets other offsets while the first
    holds its own, and a claim is freed when its holder closes it or dies."""
    import multiprocessing

    held = SlotUids(2)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        other = pool.apply(_claimed_offsets, (2,))
    assert len(set(held.offsets)) == 2 and not set(held.offsets) & set(other)
    assert {held.checker(k) - CHECKER_UID for k in range(2)} == set(held.offsets)
    assert {held.candidate(k) - CANDIDATE_UID for k in range(2)} == set(held.offsets)
    freed = held.offsets
    held.close()
    for offset in freed + other:  # free again: closed here, and released when the other process exited
        fd = os.open(lock_dir() / f"uid-{offset}.lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def _claimed_offsets(slots: int) -> list[int]:
    return SlotUids(slots).offsets
