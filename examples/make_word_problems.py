"""Write the small word-problem JSONL files (deterministic).

- math_train.jsonl / math_eval.jsonl (examples/math_jsonl.yaml): each prompt is rlvr's reasoning system message,
  two worked examples as earlier chat turns, then the question - the form the 135M model follows.
- word_problems_train.jsonl / word_problems_eval.jsonl: the same questions under a think/answer system message
  (the memory benchmark's and tests' prompts; the 135M model never writes <think>, so it does not learn on these).
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlvr.tasks.word_problems import REASONING_SYSTEM_PROMPT, WORKED_EXAMPLES

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


def worked_example_form(row: dict) -> dict:
    head = [{"role": "system", "content": REASONING_SYSTEM_PROMPT}]
    for question, answer in WORKED_EXAMPLES:
        head += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": [*head, row["messages"][-1]], "answer": row["answer"]}


if __name__ == "__main__":
    rng = random.Random(0)
    rows = problems(300, rng)
    out = Path(__file__).parent / "data"
    for name, part in (("word_problems_train.jsonl", rows[:250]), ("word_problems_eval.jsonl", rows[250:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    for name, part in (("math_train.jsonl", rows[:250]), ("math_eval.jsonl", rows[250:])):
        (out / name).write_text("".join(json.dumps(worked_example_form(r)) + "\n" for r in part))
