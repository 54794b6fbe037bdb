"""The built-in word-problem task: stories generated from a seed, held out by story (and, in the default
``varied`` grammar, by phrasing: ``rlvr.tasks.varied_problems``).

In the ``simple`` grammar (this module) a problem is a starting amount followed by 0-2 further events, each one
operation (+, -, x, /), told in the words of one story template (a baker's loaves, a library's books, ...).
Every template phrases every operation several ways, so wording varies within a template too. Numbers are drawn
so every intermediate amount is a whole, non-negative number (divisions are exact).

Held-out split: the templates named in ``HELD_OUT`` never produce a training row, so held-out accuracy
measures transfer to stories the model never trained on, not memorised wording. The held-out rows are
``eval_steps``-operation problems (two by default), the training rows mix ``train_steps``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlvr.tasks.varied_problems import HELD_OUT_SETTINGS, held_only_words, varied_problem, words

REASONING_SYSTEM_PROMPT = "Solve the problem. Write one calculation per sentence, then the answer."

# Worked examples, shown before each question as earlier chat turns (``few_shot``): each line restates one
# sentence and does its calculations, which a 135M model copies far more reliably than an instruction
# (measured: docs/experiments/word_problems.md). Their stories (pens, cakes) are in neither split. The varied
# grammar's show a group ("2 boxes of 4"), two events in one sentence, a distractor and a difference, still
# one calculation per line (two on a line, the trained model ran them together: docs/experiments/word_problems.md).
WORKED_EXAMPLES = (
    (("Tom has 3 pens. He buys 2 boxes of 4 pens and then gives 5 pens to his sister. How many pens does Tom have "
      "now?"),
     ("Tom has 3 pens.\nHe buys 2 boxes of 4 pens: 2 * 4 = 8\nNow he has 3 + 8 = 11\nHe gives 5 pens to his sister: "
      "11 - 5 = 6\nThe answer is 6.")),
    (("Sue is 9 years old. She bakes 12 cakes, and her friends eat 4 of them. Her brother bakes 5 cakes. How many "
      "more cakes does Sue have than her brother?"),
     ("Sue bakes 12 cakes.\nHer friends eat 4 of them: 12 - 4 = 8\nSue has 8 and her brother has 5: 8 - 5 = 3\n"
      "The answer is 3.")),
)
SIMPLE_WORKED_EXAMPLES = (  # the simple grammar's (runs A-K of docs/experiments/word_problems.md)
    ("Tom has 3 pens. He buys 4 more. He gives away 2. How many pens does Tom have?",
     "Tom has 3 pens.\nHe buys 4 more: 3 + 4 = 7\nHe gives away 2: 7 - 2 = 5\nThe answer is 5."),
    (("Sue bakes 12 cakes. She puts them equally on 3 plates; count one plate. She ends up with 5 times as many "
      "cakes. How many cakes is that?"),
     ("Sue bakes 12 cakes.\nShe puts them equally on 3 plates: 12 / 3 = 4\nShe ends up with 5 times as many: "
      "4 * 5 = 20\nThe answer is 20.")),
)


@dataclass(frozen=True)
class Story:
    """One template: how its start and each operation are told. ``{w}`` who, ``{x}`` the number."""

    name: str
    start: tuple[str, ...]  # "{w} has {x} apples."
    add: tuple[str, ...]
    sub: tuple[str, ...]
    mul: tuple[str, ...]  # the amount becomes x times as large
    div: tuple[str, ...]  # the amount is split into x equal parts; one part is kept
    question: tuple[str, ...]


STORIES = (
    Story("apples", ("{w} has {x} apples.", "There are {x} apples in {w}'s basket."),
          ("{w} picks {x} more.", "A neighbour gives {w} {x} more apples."),
          ("{w} eats {x} of them.", "{w} gives {x} apples to a friend."),
          ("{w} ends up with {x} times as many apples.", "The number of apples is multiplied by {x}."),
          ("{w} splits the apples into {x} equal bags and keeps one bag.",),
          ("How many apples does {w} have now?", "How many apples are there now?")),
    Story("points", ("{w} scores {x} points.", "{w} starts the game with {x} points."),
          ("{w} scores {x} more points.", "{w} wins {x} bonus points."),
          ("{w} loses {x} points.", "A penalty takes {x} points from {w}."),
          ("A power-up multiplies {w}'s points by {x}.",),
          ("{w} splits the points equally among {x} teammates; count one teammate's share.",),
          ("How many points is that?", "How many points does {w} have now?")),
    Story("coins", ("{w} saves {x} coins.", "{w}'s jar holds {x} coins."),
          ("{w} adds {x} coins.", "{w} earns {x} more coins."),
          ("{w} spends {x} coins.", "{w} loses {x} coins."),
          ("{w} trades them for {x} times as many coins.", "The number of coins is multiplied by {x}."),
          ("{w} shares the coins equally among {x} cousins; count one cousin's share.",),
          ("How many coins are there now?", "How many coins does that come to?")),
    Story("marbles", ("{w} owns {x} marbles.", "A bag has {x} marbles for {w}."),
          ("{w} wins {x} marbles.", "{w} gets {x} new marbles."),
          ("{w} loses {x} marbles.", "{w} trades away {x} marbles."),
          ("{w} ends up with {x} times as many marbles.",),
          ("{w} puts the marbles into {x} equal rows; count one row.",),
          ("How many marbles is that?", "How many marbles are there now?")),
    Story("stickers", ("{w} collects {x} stickers.", "There are {x} stickers on {w}'s sheet."),
          ("{w} gets {x} more stickers.", "A teacher hands {w} {x} extra stickers."),
          ("{w} uses {x} stickers.", "{w} gives {x} stickers away."),
          ("{w} ends up with {x} times as many stickers.",),
          ("{w} divides the stickers equally into {x} albums; count one album.",),
          ("How many stickers are there now?", "How many stickers does {w} have?")),
    Story("eggs", ("A farmer named {w} collects {x} eggs.", "{w}'s hens lay {x} eggs."),
          ("{w} collects {x} more eggs.", "The hens lay {x} more."),
          ("{w} sells {x} eggs.", "{x} eggs break."),
          ("By the end of the week {w} has {x} times as many eggs.",),
          ("{w} packs the eggs into {x} equal boxes; count one box.",),
          ("How many eggs are there now?", "How many eggs does that make?")),
    Story("books", ("A library has {x} books.", "{w} runs a library with {x} books."),
          ("The library buys {x} new books.", "{w} receives {x} donated books."),
          ("Readers borrow {x} books.", "{w} removes {x} old books."),
          ("The library's collection grows to {x} times its size.",),
          ("{w} spreads the books evenly over {x} shelves; count one shelf.",),
          ("How many books is that?", "How many books are there now?")),
    Story("loaves", ("A baker named {w} bakes {x} loaves.", "{w}'s bakery has {x} loaves."),
          ("{w} bakes {x} more loaves.", "{x} more loaves come out of the oven."),
          ("{w} sells {x} loaves.", "Customers buy {x} loaves."),
          ("By evening {w} has {x} times as many loaves.",),
          ("{w} packs the loaves equally into {x} crates; count one crate.",),
          ("How many loaves are there now?", "How many loaves does {w} have?")),
    Story("seats", ("A theatre has {x} empty seats.", "{w} counts {x} free seats."),
          ("{x} more seats are set up.", "{w} adds {x} chairs."),
          ("{x} people sit down.", "{w} removes {x} seats."),
          ("The hall is enlarged so there are {x} times as many free seats.",),
          ("The free seats are split evenly into {x} sections; count one section.",),
          ("How many free seats are there now?", "How many free seats is that?")),
    Story("steps", ("{w} walks {x} steps.", "{w}'s watch shows {x} steps."),
          ("{w} walks {x} more steps.", "Later {w} adds {x} steps."),
          ("The watch loses {x} steps.", "{w} subtracts {x} steps counted by mistake."),
          ("By the weekend the count is {x} times as large.",),
          ("The steps were spread evenly over {x} walks; count one walk.",),
          ("How many steps is that?", "How many steps are counted now?")),
    Story("fish", ("An aquarium has {x} fish.", "{w} keeps {x} fish."),
          ("{w} adds {x} fish.", "{x} baby fish are born."),
          ("{w} gives {x} fish to a school.", "{x} fish move to another tank."),
          ("The fish multiply until there are {x} times as many.",),
          ("{w} shares the fish equally among {x} tanks; count one tank.",),
          ("How many fish are there now?", "How many fish does that make?")),
    Story("cookies", ("{w} bakes {x} cookies.", "A tray holds {x} cookies for {w}."),
          ("{w} bakes {x} more cookies.", "{w} gets {x} more cookies."),
          ("{w} eats {x} cookies.", "{x} cookies are given away."),
          ("For the fair {w} ends up with {x} times as many cookies.",),
          ("{w} puts the cookies equally on {x} plates; count one plate.",),
          ("How many cookies are there now?", "How many cookies is that?")),
)
HELD_OUT = ("books", "loaves", "seats", "fish")  # never in training: held-out accuracy measures transfer
OPS = ("add", "sub", "mul", "div")


def _problem(
    story: Story, steps: int, rng: random.Random, names: tuple[str, ...], max_number: int
) -> tuple[str, list[int]]:
    """A ``steps``-operation problem of ``story``: (question, the amount after each step; the last is the
    answer). Amounts stay whole and >= 0; the starting amount is at most ``max_number``, an added one at most
    3/4 of it, a multiplier 2-5 applies only to amounts up to 1.5x it."""
    who = rng.choice(names)
    value = rng.randint(2, max_number)
    sentences = [rng.choice(story.start).format(w=who, x=value)]
    chain = []
    for _ in range(steps):
        ops = [op for op in OPS if not (op == "div" and _divisors(value) == [])]
        ops = [op for op in ops if not (op == "sub" and value < 2)]
        ops = [op for op in ops if not (op == "mul" and value > 3 * max_number // 2)]
        op = rng.choice(ops)
        if op == "add":
            x = rng.randint(2, max(2, 3 * max_number // 4))
            value += x
        elif op == "sub":
            x = rng.randint(1, value - 1)
            value -= x
        elif op == "mul":
            x = rng.randint(2, 5)
            value *= x
        else:
            x = rng.choice(_divisors(value))
            value //= x
        sentences.append(rng.choice(getattr(story, op)).format(w=who, x=x))
        chain.append(value)
    sentences.append(rng.choice(story.question).format(w=who))
    return " ".join(sentences), chain


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, 10) if n % d == 0 and n // d >= 1]


NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia")


def word_problem_rows(
    eval_size: int,
    train_size: int,
    seed: int,
    system_prompt: str,
    train_steps: tuple[int, ...] = (1, 2),
    eval_steps: tuple[int, ...] = (2,),
    few_shot: int = 0,
    max_number: int = 40,
    grammar: str = "varied",
) -> tuple[list[dict], list[dict]]:
    """Train rows from the training stories, held-out rows from the held-out ones: ``{"prompt", "answer",
    "chain"}`` (``chain``: the amount after each operation, for partial credit), plus ``story``, ``steps``
    (operations) and ``grammar`` (the row's: varied or simple). Each prompt is the system message, ``few_shot``
    worked examples as user/assistant turns, the question. ``grammar``: ``varied``
    (``rlvr.tasks.varied_problems``: 1-4 operations, held out by setting and phrasing), ``simple`` (one operation
    per sentence, 1-3, held out by story) or ``mixed`` (1-3 operations; each training row simple or varied with
    equal odds, its simple rows free of the varied grammar's held-out settings and of every word only its
    held-out phrasings use; held out and prompted like ``varied``).

    ``train_size`` 0 means 2,000 rows. Questions are distinct within each split; the splits cannot share
    one, since no story is in both.
    """
    if grammar not in GRAMMARS:
        raise ValueError(f"word_problems grammar must be one of {', '.join(GRAMMARS)}; got {grammar!r}")
    allowed = (1, 2, 3, 4) if grammar == "varied" else (1, 2, 3)
    bad = [s for s in (*train_steps, *eval_steps) if s not in allowed]
    if bad or not train_steps or not eval_steps:
        raise ValueError(f"word_problems steps must be among {', '.join(map(str, allowed))} in the {grammar} "
                         f"grammar; got train {train_steps}, eval {eval_steps}")
    if not 0 <= few_shot <= len(_examples(grammar)):
        raise ValueError(f"word_problems few_shot must be 0-{len(_examples(grammar))}; got {few_shot}")
    if max_number < 4:
        raise ValueError(f"word_problems max_number must be at least 4; got {max_number}")
    head = prompt_head(system_prompt, few_shot, grammar)
    rng = random.Random(seed)

    def varied(held_out: bool, steps: tuple[int, ...]):
        while True:
            question, chain, setting = varied_problem(rng, held_out, max_number)
            if len(chain) in steps:
                return question, chain, setting, "varied"

    def simple(held_out: bool, steps: tuple[int, ...], stories=STORIES):
        story = rng.choice([s for s in stories if (s.name in HELD_OUT) == held_out])
        return (*_problem(story, rng.choice(steps), rng, NAMES, max_number), story.name, "simple")

    if grammar == "mixed":  # simple rows that share no setting or held-only word with the varied held-out split
        clean = tuple(s for s in STORIES if s.name not in HELD_OUT_SETTINGS)
        banned = held_only_words()

        def simple_clean(steps: tuple[int, ...]):
            while True:
                made = simple(False, steps, clean)
                if not words(made[0]) & banned:
                    return made

        def draw(held_out: bool, steps: tuple[int, ...]):
            if held_out:
                return varied(True, steps)
            return simple_clean(steps) if rng.random() < 0.5 else varied(False, steps)
    else:
        draw = varied if grammar == "varied" else simple
    held_out = _rows(lambda: draw(True, eval_steps), eval_size, head)
    train = _rows(lambda: draw(False, train_steps), train_size or 2000, head)
    return train, held_out


GRAMMARS = ("varied", "simple", "mixed")


def prompt_head(system_prompt: str, few_shot: int, grammar: str = "varied") -> list[dict]:
    """The chat turns before each question: the system message (if any) and ``few_shot`` worked examples."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for question, answer in _examples(grammar)[:few_shot]:
        head += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return head


def _examples(grammar: str) -> tuple[tuple[str, str], ...]:
    return SIMPLE_WORKED_EXAMPLES if grammar == "simple" else WORKED_EXAMPLES


def _rows(draw, count: int, head: list[dict]) -> list[dict]:
    rows, seen = [], set()
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"cannot generate {count} distinct word problems; ask for fewer")
        question, chain, story, grammar = draw()
        if question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": [*head, {"role": "user", "content": question}], "answer": str(chain[-1]),
                     "chain": [str(v) for v in chain], "story": story, "steps": len(chain),
                     "grammar": grammar})
    return rows
