"""A math-verify worker: reads ``[gold, prediction]`` JSON lines on stdin, answers ``[status, value]``.

value is 1.0 / 0.0, or None when the gold answer cannot be parsed. Started and killed by
``rlvr.verifiers.math.MathVerifier``; imports nothing but the standard library and math-verify.
"""

import json
import sys


def check(gold: str, prediction: str) -> float | None:
    from math_verify import parse, verify

    gold_parsed = parse(gold)
    if not gold_parsed:
        return None
    return 1.0 if verify(gold_parsed, parse(prediction)) else 0.0


def main() -> None:
    from math_verify import parse  # noqa: F401  (import cost paid before the first request)

    sys.stdout.write(json.dumps(["ready", None]) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            gold, prediction = json.loads(line)
            reply = ["ok", check(gold, prediction)]
        except Exception as err:  # noqa: BLE001 (a parse failure is a wrong answer, not a crash)
            reply = ["error", f"{type(err).__name__}: {err}"]
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
