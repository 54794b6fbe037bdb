"""PID 1 of a sandbox execution: build a private root filesystem, start the candidate process as its own
uid, drop to the checker's uid and run the checks. Standard library only (ctypes for mount(2)).

Started by the trainer as ``python -I -S -B jail.py JOB_JSON RESULTS_FD`` inside fresh PID, network, mount,
IPC, UTS and cgroup namespaces (``unshare``). The new root is a tmpfs holding only:

    /usr /bin /lib* /sbin    read-only binds (or the same symlinks), i.e. the Python runtime and its libraries;
                             site-packages / dist-packages covered by empty read-only tmpfs
    <python prefix>          read-only, when the interpreter lives outside /usr
    /etc/ld.so.cache         read-only (the dynamic loader's index)
    /dev                     null, zero, full, random, urandom only
    /proc                    this PID namespace's processes only
    /sandbox                 candidate.py and plain.py, read-only
    /work, /tmp              private tmpfs of ``disk_mb`` each, gone when the execution ends

Everything else of the host - the project, the datasets, /home, /root, the host's /tmp - is absent, not
merely unreadable. The job file (tests included) is read here, as root, before the root is switched; the
candidate, a fresh interpreter started with ``exec``, never has it in memory.

Both the checker and the candidate run under a seccomp filter (``seccomp_filter``): no new user namespace
(``clone``/``unshare`` with CLONE_NEWUSER; ``clone3``, whose flags a filter cannot read, answers ENOSYS so
the C library falls back to ``clone``), and none of keyrings, bpf, perf events, userfaultfd or io_uring.
"""

import ctypes
import errno
import fcntl
import json
import os
import platform
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 4, 22, 24, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")
HOSTNAME = b"sandbox"
# arch: (AUDIT_ARCH_*, clone, unshare, syscalls refused outright: add_key request_key keyctl perf_event_open
# bpf userfaultfd io_uring_setup io_uring_enter io_uring_register); clone3 is 435 on both
SECCOMP_ARCH = {"x86_64": (0xC000003E, 56, 272, (248, 249, 250, 298, 321, 323, 425, 426, 427)),
                "aarch64": (0xC00000B7, 220, 97, (217, 218, 219, 241, 280, 282, 425, 426, 427))}
CLONE3, CLONE_NEWUSER, X32_BIT = 435, 0x10000000, 0x40000000
# statvfs ST_* flag -> mount MS_* flag: what a read-only remount must keep (a user namespace may not clear them)
STATVFS_FLAGS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}

libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def bind_readonly(source: str, target: str) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    host_flags = os.statvfs(source).f_flag  # what the host mount has must be kept, or a user namespace refuses
    locked = sum(ms for st, ms in STATVFS_FLAGS.items() if host_flags & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)


def build_root(setup: dict) -> None:
    """Mount the new root described above at ``setup["root"]`` and switch to it."""
    root = setup["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    inside = lambda path: root + path
    for path in setup["expose"]:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
            os.symlink(os.readlink(path), inside(path))
        elif os.path.isdir(path):
            os.makedirs(inside(path), exist_ok=True)
            bind_readonly(path, inside(path))
    for path in setup["expose_files"]:
        if os.path.isfile(path):
            os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
            open(inside(path), "w").close()
            bind_readonly(path, inside(path))
    for path in setup["hide"]:
        if os.path.isdir(inside(path)):
            mount("tmpfs", inside(path), "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    os.makedirs(inside("/dev"))
    mount("tmpfs", inside("/dev"), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        open(inside("/dev/" + name), "w").close()
        mount("/dev/" + name, inside("/dev/" + name), None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", inside("/dev/" + name))
    os.symlink("/proc/self/fd", inside("/dev/fd"))
    os.makedirs(inside("/proc"))
    mount("proc", inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    size = f"size={setup['disk_mb']}m"
    os.makedirs(inside("/tmp"))
    mount("tmpfs", inside("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=1777")
    os.makedirs(inside("/work"))
    owner = f",uid={setup['candidate_uid']},gid={setup['candidate_uid']}" if setup["mode"] == "root" else ""
    mount("tmpfs", inside("/work"), "tmpfs", MS_NOSUID | MS_NODEV, f"{size},mode=0700{owner}")
    os.makedirs(inside("/sandbox"))
    for name, source in setup["sandbox_files"].items():
        with open(source, "rb") as src, open(inside("/sandbox/" + name), "wb") as dst:
            dst.write(src.read())
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    number = PIVOT_ROOT.get(platform.machine())
    if number is not None:
        _check(libc.syscall(number, b".", b"."), "pivot_root")  # the old root now sits under the new one
        _check(libc.umount2(b".", MNT_DETACH), "umount old root")  # ... and is gone
    else:
        os.chroot(".")  # other architectures: a chroot; unescapable once the capabilities are dropped
    os.chdir("/")


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_program(arch: str) -> list[tuple[int, int, int, int]]:
    """Classic BPF over ``struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}`` (little-endian)."""
    audit, clone, unshare, refused = SECCOMP_ARCH[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS  # SECCOMP_RET_*
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit), (ret, 0, 0, enosys),  # another ABI (i386): nothing works
            (ld, 0, 0, 0), (jge, 0, 1, X32_BIT), (ret, 0, 0, enosys),  # x32 numbers: the same
            (jeq, 0, 1, CLONE3), (ret, 0, 0, enosys)]
    for nr in refused:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 1, 0, clone), (jeq, 0, 3, unshare),
             (ld, 0, 0, 16), (jset, 0, 1, CLONE_NEWUSER), (ret, 0, 0, eperm),  # args[0]: the flags
             (ret, 0, 0, allow)]
    return prog


def seccomp_filter() -> None:
    """Install the filter described in the module docstring (needs no_new_privs); other arches: none."""
    if platform.machine() not in SECCOMP_ARCH:
        return
    prog = seccomp_program(platform.machine())
    filters = (SockFilter * len(prog))(*(SockFilter(*insn) for insn in prog))
    fprog = SockFprog(len(prog), filters)
    _check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0), "seccomp")  # SECCOMP_MODE_FILTER


def isolate_host_names(mode: str) -> None:
    """A hostname of the sandbox's own; in a user namespace also a limit of 0 further user namespaces."""
    _check(libc.sethostname(HOSTNAME, len(HOSTNAME)), "sethostname")
    if mode != "userns":
        return
    with open("/proc/self/uid_map") as f:
        if f.read().split() == ["0", "0", "4294967295"]:  # the host's own user namespace: never touch it
            return
    try:
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")  # best effort (old kernels lack it): the seccomp filter refuses them too
    except OSError:
        pass


def drop_privileges(uid: int | None) -> None:
    """Become ``uid`` (root mode) and give up every capability for good; nothing may regain them."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # an empty bounding set: exec grants nothing
        cap += 1
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    seccomp_filter()


def start_candidate(setup: dict, python: str, isolated: bool) -> tuple[int, int]:
    """Fork the candidate process; returns the checker's (request write fd, response read fd)."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    if os.fork() == 0:
        try:
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (req_r, resp_w)]  # clear of 3 and 4
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)
            os.closerange(5, 1 << 16)  # the results pipe and everything else of the checker
            if isolated:
                drop_privileges(setup["candidate_uid"] if setup["mode"] == "root" else None)
                os.chdir("/work")
            script = "/sandbox/candidate.py" if isolated else setup["sandbox_files"]["candidate.py"]
            os.execve(python, [python, "-I", "-S", "-B", script, "3", "4"], {})
        except BaseException as err:  # noqa: BLE001 (the checker sees no hello: an infrastructure failure)
            os.write(2, f"sandbox: cannot start the candidate: {err!r}\n".encode())
        finally:
            os._exit(127)
    os.close(req_r)
    os.close(resp_w)
    return req_w, resp_r


def main() -> None:
    job_path, results_fd = sys.argv[1], int(sys.argv[2])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    del sys.path[0]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    setup = job.pop("setup")
    write = os.write

    def report(record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[write(results_fd, data):]

    isolated = setup["mode"] != "none"
    if isolated:
        isolate_host_names(setup["mode"])
        build_root(setup)
    request_fd, response_fd = start_candidate(setup, setup["python"], isolated)
    if isolated:
        drop_privileges(setup["checker_uid"] if setup["mode"] == "root" else None)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace, no /proc/1/mem for anyone else in here
    candidate = harness.Candidate(request_fd, response_fd, job["test_timeout_s"])
    candidate.receive(timeout_s=10.0)  # the candidate's hello: the sandbox works
    report({"ready": True})
    try:
        harness.check(job, candidate, report)
    except harness.CandidateGone:
        pass


if __name__ == "__main__":
    main()
