"""A tool-use task: multiplications of two 2-digit numbers, bare or inside short stories, that a 135M model
cannot do in its head but does exactly with the ``calculator`` tool (issue 23's measured target).

Kinds (``kind``):

- ``products``: "What is 47 * 86?" - one call.
- ``word``: one multiplication told as a story ("A crate holds 47 apples. How many apples are in 86 crates?").
- ``two_step``: a story whose answer is a product plus or minus a third number ("Ana has 15 stickers and
  buys 86 packs of 47 stickers. ..."): one call with ``47 * 86 + 15``, or two calls.

Why the tool is needed: operands are 12-99, never a multiple of 10, so the products are 3-4 digit numbers the
model gets right in its head almost never (SmolLM2-135M-Instruct, greedy: docs/experiments/tools.md), while the
calculator returns them exactly.

Prompt: a short system message (use the calculator; give the final answer as a number after the result - the
trainer adds the tool description itself, ``rlvr.envs.render.with_tools``), ``shots`` worked examples as earlier
turns (user question, assistant ``<tool_call>``, ``tool`` result, assistant answer), then the question.
SmolLM2's chat template renders the ``tool`` role as ``<|im_start|>tool`` - the same turn the episode sampler
appends for a real result (``rlvr.rollout.episodes.observation_ids``). ``example_kind`` picks the examples'
kind (default: the questions' kind), e.g. bare products as examples before stories.

Split: the unordered operand pairs are shuffled with ``seed``; the first ones are held out, so no held-out
product - in either order, in any story - is ever trained on. The examples' pairs are in neither split.

Why these designs: a design is worth training when the base model starts low but not at zero with the tool -
sampled calls and right answers for GRPO to reinforce. The default (``two_step``, one example) leaves that room;
``word`` with one example starts higher, and two examples or bare products start so high that little is left to
gain; bare-product examples before stories give no call at all. One example is copied by shape (stories shaped
like it are called, others answered in the head), and ``two_step`` calls often copy the example's third number.
Each design's base rates (sampled and greedy, with and without tools): docs/experiments/tools.md, "Base rates of
the designs tried".
"""

from __future__ import annotations

import random

SYSTEM_PROMPT = ("Use the calculator tool for arithmetic. After the tool result, give the final answer as a number: "
                 "The answer is <number>.")
KINDS = ("products", "word", "two_step")
LOW, HIGH = 12, 99  # operand range; multiples of 10 are left out (too easy in the head)
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia")

# One-step stories: {a} per unit, {b} units, {w} a name; the answer is a * b.
WORD = (
    "A crate holds {a} apples. How many apples are in {b} crates?",
    "Each ticket costs {a} dollars. How many dollars do {b} tickets cost?",
    "A bus has {a} seats. How many seats are there on {b} buses?",
    "{w} reads {a} pages every day. How many pages does {w} read in {b} days?",
    "A shelf holds {a} books. How many books fit on {b} shelves?",
    "{w} walks {a} steps each minute. How many steps does {w} walk in {b} minutes?",
    "A box contains {a} pencils. How many pencils are in {b} boxes?",
    "A farm has {b} rows of trees with {a} trees in each row. How many trees are there?",
)
# Two-step stories: the answer is a * b + c ("+") or a * b - c ("-").
TWO_STEP = (
    ("+", "{w} has {c} stickers and buys {b} packs of {a} stickers. How many stickers does {w} have now?"),
    ("-", "A school has {b} classes of {a} students. {c} students are absent. How many students are present?"),
    ("-", "A baker makes {b} trays of {a} cookies and sells {c} of them. How many cookies are left?"),
    ("+", "{w} saves {a} coins a week for {b} weeks, then finds {c} more coins. How many coins does {w} have?"),
    ("-", "A hotel has {b} floors with {a} rooms each. {c} rooms are taken. How many rooms are free?"),
    ("+", "A library has {c} books and gets {b} boxes of {a} books. How many books does it have now?"),
)

# Worked examples (question, expression, result); their operand pairs are in neither split.
EXAMPLES = {
    "products": (("What is 23 * 41?", "23 * 41", 943), ("What is 37 * 58?", "37 * 58", 2146)),
    "word": (("A bag holds 23 marbles. How many marbles are in 41 bags?", "23 * 41", 943),
             ("A train has 58 cars with 37 people in each car. How many people are on the train?", "37 * 58", 2146)),
    "two_step": (("Tom has 15 cards and buys 41 packs of 23 cards. How many cards does Tom have now?",
                  "23 * 41 + 15", 958),
                 ("A farm has 58 pens of 37 sheep. 64 sheep are sold. How many sheep are left?", "37 * 58 - 64",
                  2082)),
}
EXAMPLE_PAIRS = frozenset({(23, 41), (37, 58)})


def tool_call_text(expression: str) -> str:
    """The assistant turn of a worked example: one well-formed calculator call (``rlvr.envs.tools.CALL_FORMAT``)."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def example_turns(kind: str, shots: int) -> list[dict]:
    """``shots`` worked examples of ``kind`` as chat turns: user, assistant call, tool result, assistant answer."""
    turns = []
    for question, expression, result in EXAMPLES[kind][:shots]:
        turns += [{"role": "user", "content": question},
                  {"role": "assistant", "content": tool_call_text(expression)},
                  {"role": "tool", "content": str(result)},
                  {"role": "assistant", "content": f"The answer is {result}."}]
    return turns


def _pairs(seed: int) -> list[tuple[int, int]]:
    values = [v for v in range(LOW, HIGH + 1) if v % 10]
    pairs = [(a, b) for i, a in enumerate(values) for b in values[i:] if (a, b) not in EXAMPLE_PAIRS]
    random.Random(seed).shuffle(pairs)
    return pairs


def _question(kind: str, pair: tuple[int, int], rng: random.Random) -> tuple[str, str, int]:
    """(question, a canonical expression, answer) for an unordered operand pair."""
    a, b = pair if rng.random() < 0.5 else pair[::-1]
    w = rng.choice(NAMES)
    if kind == "products":
        return f"What is {a} * {b}?", f"{a} * {b}", a * b
    if kind == "word":
        return rng.choice(WORD).format(a=a, b=b, w=w), f"{a} * {b}", a * b
    sign, template = rng.choice(TWO_STEP)
    c = rng.choice([v for v in range(LOW, HIGH + 1) if v % 10])
    return template.format(a=a, b=b, c=c, w=w), f"{a} * {b} {sign} {c}", a * b + c if sign == "+" else a * b - c


def _rows(kind: str, pairs: list[tuple[int, int]], count: int, rng: random.Random, head: list[dict]) -> list[dict]:
    rows, seen, attempts = [], set(), 0
    while len(rows) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"cannot generate {count} distinct {kind} problems from {len(pairs)} pairs; ask for fewer")
        pair = pairs[(attempts - 1) % len(pairs)]  # every pair once before any is used again
        question, expression, answer = _question(kind, pair, rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": [*head, {"role": "user", "content": question}], "answer": str(answer),
                     "expression": expression, "kind": kind})
    return rows


def tool_problem_rows(
    eval_size: int,
    train_size: int,
    seed: int,
    kind: str = "two_step",
    shots: int = 1,
    example_kind: str | None = None,
    system_prompt: str = SYSTEM_PROMPT,
    eval_pairs: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows), each row ``{"prompt": messages, "answer": "4042", "expression": "47 * 86",
    "kind": kind}``; ``expression`` is one calculator expression giving the answer. Deterministic from ``seed``.

    ``eval_pairs`` operand pairs (default ``eval_size``) are held out: no training row uses one of them, so
    train and held-out questions never share a product. ``train_size`` 0 means 2,000 rows. ``shots`` (0-2)
    worked examples of ``example_kind`` (default ``kind``) come before each question.
    """
    example_kind = example_kind or kind
    if kind not in KINDS or example_kind not in KINDS:
        raise ValueError(f"tool_problems kind and example_kind must be among {', '.join(KINDS)}; "
                         f"got {kind!r}, {example_kind!r}")
    if not 0 <= shots <= len(EXAMPLES[example_kind]):
        raise ValueError(f"tool_problems shots must be 0-{len(EXAMPLES[example_kind])}; got {shots}")
    pairs = _pairs(seed)
    held = eval_size if eval_pairs is None else eval_pairs
    if not 0 < held < len(pairs):
        raise ValueError(f"tool_problems holds out {held} of {len(pairs)} operand pairs; use 1-{len(pairs) - 1}")
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    head += example_turns(example_kind, shots)
    rng = random.Random(seed + 1)
    eval_rows = _rows(kind, pairs[:held], eval_size, rng, head)
    train_rows = _rows(kind, pairs[held:], train_size or 2000, rng, head)
    return train_rows, eval_rows
