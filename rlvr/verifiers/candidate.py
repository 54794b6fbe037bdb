"""Runs inside the sandbox as the candidate's own unprivileged user: load model-written code and serve the
checker's requests over two pipes, one JSON object per line. It never sees a test or an expected value.

    -> {"op": "load", "sources": [code, ...], "entry_point": name | null}
    <- {"ok": true, "functions": [top-level function names]} | {"error": "..."}
    -> {"op": "call", "fn": name, "args": encoded list}     (rlvr.verifiers.plain encoding)
    <- {"ok": true, "value": encoded} | {"error": "..."}   (a non-plain return value is an error)
    -> {"op": "run", "source": code, "stdin": text, "timeout_s": s, "output_bytes": n}  (stdin programs)
    <- {"ok": true, "stdout": text, "status": "exit" | "error" | "timeout" | "output_limit", "returncode": rc}
    -> {"op": "build", "files": {name: text}, "prebuilt": {name: b64}, "steps": [argv, ...], "artifacts": [glob, ...],
        "scratch": [glob, ...], "cpu_s": s, "wall_s": s, "output_bytes": n}   (compiled languages: languages.py)
    <- {"ok": true, "status": "built" | "compile_error" | "compile_timeout", "log": text, "artifacts": {name: b64}}
    -> {"op": "install", "artifacts": {name: b64}}          (a cached build)
    <- {"ok": true, "status": "built"}
    -> {"op": "exec", "argv": [...], "stdin": text, "cpu_s": s, "wall_s": s, "output_bytes": n,
        "files": {name: text}}                              (files: written for this run only - a checker's)
    <- {"ok": true, "stdout": text, "status": ..., "returncode": rc, "stderr": tail}

A build writes each file (source or prebuilt) just before the first step that names it, so an earlier step never
sees a later one's input: the completion's unit is compiled while the tests' source is absent. Once it succeeds,
the sources (those not among the artifacts) and its scratch are deleted, so the program it made cannot read the
tests compiled into it.

Sources are tried in order until one runs and defines ``entry_point`` (HumanEval completions may be a
function body that only works after the prompt). Standard library only; started with
``python -I -S -B candidate.py REQUEST_FD RESPONSE_FD`` in the candidate's writable working directory.
"""

import base64
import glob
import json
import os
import resource
import subprocess
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's directory out
import plain

del sys.path[0]

PROGRAM = "program.py"


def main() -> None:
    requests = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8")
    write, fd = os.write, int(sys.argv[2])  # bound now: the model's code may replace os.write later

    def respond(record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[write(fd, data):]

    respond({"hello": True})
    namespace: dict = {}
    for line in requests:
        request = json.loads(line)
        op = request["op"]
        if op == "load":
            namespace, error = _load(request["sources"], request.get("entry_point"))
            if error is not None:
                respond({"error": error})
            else:
                names = [k for k, v in namespace.items()
                         if type(v) is types.FunctionType and v.__module__ == "solution"]
                respond({"ok": True, "functions": names})
        elif op == "call":
            respond(_call(namespace, request["fn"], request["args"]))
        elif op == "run":
            respond(_run_program(request["source"], request["stdin"], request["timeout_s"], request["output_bytes"]))
        elif op == "build":
            respond(_build(request))
        elif op == "install":
            respond(_install(request["artifacts"]))
        elif op == "exec":
            respond(_exec(request["argv"], request["stdin"], request["cpu_s"], request["wall_s"],
                          request["output_bytes"], request.get("files") or {}))


def _load(sources: list[str], entry_point: str | None) -> tuple[dict, str | None]:
    error = "no code"
    for source in sources:
        namespace = {"__name__": "solution"}
        try:
            exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 (inside the sandbox)
        except BaseException as err:  # noqa: BLE001 (SystemExit included: exiting early just fails)
            error = f"{type(err).__name__}: {err}"[:500]
            continue
        if entry_point is None or callable(namespace.get(entry_point)):
            return namespace, None
        error = f"the code does not define {entry_point!r}"
    return {}, error


def _call(namespace: dict, name: str, args) -> dict:
    fn = namespace.get(name)
    if not callable(fn):
        return {"error": f"{name!r} is not defined"}
    try:
        value = fn(*plain.decode(args))
    except BaseException as err:  # noqa: BLE001 (whatever the candidate raises fails this call)
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    try:
        return {"ok": True, "value": plain.encode(value)}
    except (TypeError, ValueError, RecursionError) as err:
        return {"error": f"returned {type(value).__name__}, not plain data ({err})"[:500]}


def _run_program(source: str, stdin: str, timeout_s: float, output_bytes: int) -> dict:
    """One run of the candidate as a Python program: ``stdin`` in, stdout (at most ``output_bytes``) out; the
    execution's own CPU limit applies, the wall clock decides a timeout."""
    with open(PROGRAM, "w", encoding="utf-8") as f:
        f.write(source)
    result = _spawn([sys.executable, "-I", "-S", "-B", PROGRAM], stdin.encode(), float("inf"), timeout_s,
                    output_bytes, env={})
    status = "timeout" if result["status"] == "cpu" else result["status"]
    return {"ok": True, "stdout": result["out"][:output_bytes].decode(errors="replace"), "status": status,
            "returncode": result["returncode"]}


BUILD_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
MAX_ARTIFACT_BYTES = 32 << 20


def _plain_name(name: str) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _build(request: dict) -> dict:
    """Write the sources, run the build commands; return what the run needs (for the trainer's cache)."""
    pending = {}  # name -> bytes, written just before the first step that names it
    for name, text in request["files"].items():
        pending[name] = text.encode()
    for name, data in request.get("prebuilt", {}).items():  # a unit built before (the trainer's cache)
        pending[name] = base64.b64decode(data)
    if not all(map(_plain_name, pending)):
        return {"error": f"bad file names {sorted(pending)!r}"}
    names = list(request["files"])
    steps = request["steps"]
    named = {arg for argv in steps for arg in argv}
    _write({name: data for name, data in pending.items() if name not in named}, pending)
    status, log = "built", b""
    for argv in steps:
        _write({name: data for name, data in pending.items() if name in argv}, pending)
        result = _spawn(argv, b"", request["cpu_s"], request["wall_s"], request["output_bytes"], merge=True)
        log = result["out"]
        if result["status"] in ("timeout", "cpu"):
            status = "compile_timeout"
            break
        if result["status"] != "exit":
            status = "compile_error"
            break
    artifacts = {}
    if status == "built":
        total = 0
        for pattern in request.get("artifacts", []):
            for path in sorted(glob.glob(pattern)):
                if os.path.isfile(path) and not os.path.islink(path) and _plain_name(path):
                    with open(path, "rb") as f:
                        data = f.read(MAX_ARTIFACT_BYTES + 1)
                    total += len(data)
                    artifacts[path] = base64.b64encode(data).decode()
        if total > MAX_ARTIFACT_BYTES:
            artifacts = {}  # too large to cache; the run still uses the files here
        for name in names:
            if name not in artifacts and os.path.exists(name):
                os.unlink(name)
        for pattern in request.get("scratch", []):
            for path in glob.glob(pattern):
                if os.path.isfile(path):
                    os.unlink(path)
    tail = log[-2000:].decode(errors="replace")
    return {"ok": True, "status": status, "log": tail, "artifacts": artifacts}


def _write(files: dict, pending: dict) -> None:
    for name, data in files.items():
        with open(name, "wb") as f:
            f.write(data)
        del pending[name]


def _install(artifacts: dict) -> dict:
    for name, data in artifacts.items():
        if not _plain_name(name):
            return {"error": f"bad file name {name!r}"}
        with open(name, "wb") as f:
            f.write(base64.b64decode(data))
        os.chmod(name, 0o755)
    return {"ok": True, "status": "built"}


def _exec(argv: list, stdin: str, cpu_s: float, wall_s: float, output_bytes: int, files: dict) -> dict:
    for name, text in files.items():
        if not _plain_name(name):
            return {"error": f"bad file name {name!r}"}
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
    try:
        result = _spawn(argv, stdin.encode(), cpu_s, wall_s, output_bytes)
    finally:
        for name in files:
            if os.path.isfile(name):
                os.unlink(name)
    return {"ok": True, "stdout": result["out"][:output_bytes].decode(errors="replace"), "status": result["status"],
            "returncode": result["returncode"], "stderr": result["err"][-1000:].decode(errors="replace")}


def _spawn(argv: list, stdin: bytes, cpu_s: float, wall_s: float, output_bytes: int, merge: bool = False,
           env: dict | None = None) -> dict:
    """Run ``argv`` with a CPU-time limit (what decides a timeout: a loaded machine slows the wall clock, not the
    CPU count) and a looser wall-clock limit; stdout (and stderr) kept up to ``output_bytes`` in files.

    status: exit | error (non-zero exit or a signal) | cpu (CPU limit) | timeout (wall limit) | output_limit."""
    with open("stdin.bin", "wb") as f:
        f.write(stdin)
    cpu = None if cpu_s == float("inf") else max(1, int(cpu_s + 0.999))  # None: the execution's own limit only

    def limit_cpu() -> None:
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]  # the execution's own cap (prlimit) bounds this one
        top = cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (min(cpu, top), top))

    status, returncode = "exit", None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open("stdin.bin", "rb") as fin, open("stdout.bin", "wb") as fout, open("stderr.bin", "wb") as ferr:
        try:
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=fout if merge else ferr,
                                    env=BUILD_ENV if env is None else env,
                                    start_new_session=True,
                                    preexec_fn=limit_cpu if cpu else None)  # noqa: PLW1509 (one thread here)
        except OSError as err:
            return {"status": "error", "returncode": None, "out": f"cannot run {argv[0]}: {err}".encode(),
                    "err": b""}
        try:
            returncode = proc.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
        try:
            os.killpg(proc.pid, 9)  # the program's children too
        except ProcessLookupError:
            pass
        proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    with open("stdout.bin", "rb") as f:
        out = f.read(output_bytes + 1)
    with open("stderr.bin", "rb") as f:
        err = f.read(4096)
    for name in ("stdin.bin", "stdout.bin", "stderr.bin"):
        os.unlink(name)
    if status == "exit" and (returncode == -24 or returncode == -9 and cpu and used >= cpu - 0.5):
        status = "cpu"  # SIGXCPU at the limit, or SIGKILL at the hard one (rusage is sampled: a loose bound)
    elif status == "exit" and returncode != 0:
        status = "error"
    if len(out) > output_bytes:
        status = "output_limit"
    return {"status": status, "returncode": returncode, "out": out, "err": err}


if __name__ == "__main__":
    main()
