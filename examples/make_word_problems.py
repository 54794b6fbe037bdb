"""Write the small word-problem JSONL files used by examples/math_jsonl.yaml (deterministic)."""

import json
import random
from pathlib import Path

SYSTEM = "Think step by step inside <think></think>, then give only the final number inside <answer></answer>."
TEMPLATES = [
    ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?", lambda a, b: a + b),
    ("{n} reads {a} pages a day for {b} days. How many pages is that?", lambda a, b: a * b),
    ("A box holds {a} pens. {n} gives away {b} of them. How many pens are left?", lambda a, b: a - b),
    ("{n} shares {p} sweets equally among {b} friends. How many does each friend get?", None),
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]


def problems(count: int, rng: random.Random) -> list[dict]:
    rows, seen = [], set()
    while len(rows) < count:
        text, fn = rng.choice(TEMPLATES)
        n, a, b = rng.choice(NAMES), rng.randint(5, 30), rng.randint(2, 9)
        if fn is None:  # division with a whole answer
            answer, question = a, text.format(n=n, p=a * b, b=b)
        else:
            a = max(a, b)
            answer, question = fn(a, b), text.format(n=n, a=a, b=b)
        if question in seen:  # keep the held-out split disjoint from training
            continue
        seen.add(question)
        rows.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                     "answer": str(answer)})
    return rows


if __name__ == "__main__":
    rng = random.Random(0)
    rows = problems(300, rng)
    out = Path(__file__).parent / "data"
    for name, part in (("word_problems_train.jsonl", rows[:250]), ("word_problems_eval.jsonl", rows[250:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
