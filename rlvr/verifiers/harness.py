"""Runs inside the sandbox: execute model-written code, call its entry point on each test input, and
report each return value (as JSON) on the results pipe. It never sees the expected outputs: the parent
grades. Standard library only; started with ``python -I -S -B harness.py RESULTS_FD``.
"""

import json
import os
import sys


def main() -> None:
    fd = int(sys.argv[1])
    write = os.write  # bound now: the model's code may replace os.write later

    def report(record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        while data:
            data = data[write(fd, data):]

    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    report({"ready": True})
    namespace = {"__name__": "solution"}
    try:
        exec(compile(job["code"], "solution.py", "exec"), namespace)  # noqa: S102 (inside the sandbox)
        entry = namespace[job["entry_point"]]
    except BaseException as err:  # noqa: BLE001 (SystemExit included: exiting early just fails every test)
        report({"load_error": f"{type(err).__name__}: {err}"[:500]})
        return
    for i, args in enumerate(job["inputs"]):
        try:
            out = json.dumps(entry(*args))
        except BaseException as err:  # noqa: BLE001 (whatever the candidate raises fails this test)
            report({"i": i, "error": f"{type(err).__name__}: {err}"[:500]})
        else:
            report({"i": i, "out": out})


if __name__ == "__main__":
    main()
