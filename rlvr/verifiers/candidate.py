"""Runs inside the sandbox as the candidate's own unprivileged user: load model-written code and serve the
checker's requests over two pipes, one JSON object per line. It never sees a test or an expected value.

    -> {"op": "load", "sources": [code, ...], "entry_point": name | null}
    <- {"ok": true, "functions": [top-level function names]} | {"error": "..."}
    -> {"op": "call", "fn": name, "args": encoded list}     (rlvr.verifiers.plain encoding)
    <- {"ok": true, "value": encoded} | {"error": "..."}   (a non-plain return value is an error)
    -> {"op": "run", "source": code, "stdin": text, "timeout_s": s, "output_bytes": n}  (stdin programs)
    <- {"ok": true, "stdout": text, "status": "exit" | "error" | "timeout" | "output_limit", "returncode": rc}

Sources are tried in order until one runs and defines ``entry_point`` (HumanEval completions may be a
function body that only works after the prompt). Standard library only; started with
``python -I -S -B candidate.py REQUEST_FD RESPONSE_FD`` in the candidate's writable working directory.
"""

import json
import os
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
    """One run of the candidate as a program: ``stdin`` in, stdout (at most ``output_bytes``) out."""
    with open(PROGRAM, "w", encoding="utf-8") as f:
        f.write(source)
    with open("stdin.txt", "w", encoding="utf-8") as f:
        f.write(stdin)
    status, returncode = "exit", None
    with open("stdin.txt", "rb") as fin, open("stdout.txt", "wb") as fout:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", PROGRAM], stdin=fin, stdout=fout,
                                stderr=subprocess.DEVNULL, env={}, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
        try:
            os.killpg(proc.pid, 9)  # the program's children too
        except ProcessLookupError:
            pass
        proc.wait()
    with open("stdout.txt", "rb") as f:
        out = f.read(output_bytes + 1)
    if status == "exit" and returncode != 0:
        status = "error"  # a crash after printing the right answer is still a crash
    if len(out) > output_bytes:
        status = "output_limit"
    return {"ok": True, "stdout": out[:output_bytes].decode(errors="replace"), "status": status,
            "returncode": returncode}


if __name__ == "__main__":
    main()
