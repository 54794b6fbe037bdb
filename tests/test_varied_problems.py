"""The varied word-problem grammar: every answer re-derived here from the question's text by a reader built
from the lexicon (each clause must read one way), training rows free of held-out settings and phrasings."""

import functools
import re

import pytest

from rlvr.tasks import varied_problems as vp
from rlvr.tasks.word_problems import WORKED_EXAMPLES, word_problem_rows

# clause kind -> what it does to the amount v, given the numbers x, y (z: prices)
EFFECT = {
    "START": lambda v, x, y: x, "START_GROUPS": lambda v, x, y: x * y, "ADD": lambda v, x, y: v + x,
    "SUB": lambda v, x, y: v - x, "ADD_GROUPS": lambda v, x, y: v + x * y, "SUB_GROUPS": lambda v, x, y: v - x * y,
    "MUL": lambda v, x, y: v * x, "DOUBLE": lambda v, x, y: v * 2, "DIV": lambda v, x, y: v / x,
    "HALF": lambda v, x, y: v / 2, "DISTRACTOR": lambda v, x, y: v,
}
UNDO = {  # the amount before an event, from the amount after it (inverse problems work back from the end)
    "ADD": lambda v, x, y: v - x, "SUB": lambda v, x, y: v + x, "ADD_GROUPS": lambda v, x, y: v - x * y,
    "SUB_GROUPS": lambda v, x, y: v + x * y, "MUL": lambda v, x, y: v / x, "DOUBLE": lambda v, x, y: v / 2,
    "DIV": lambda v, x, y: v * x, "HALF": lambda v, x, y: v * 2,
}
MEASURE_KINDS = {"start": "START", "add": "ADD", "sub": "SUB", "add_groups": "ADD_GROUPS",
                 "sub_groups": "SUB_GROUPS"}
PEOPLE = "|".join(re.escape(n[0]) for n in vp.NAMES) + "|she|he"


def _regex(template: str, where: dict) -> re.Pattern:
    pieces = re.split(r"\[([^|\]]*)\|([^\]]*)\]", template)  # text, present, past, text, ...
    text = "".join(re.escape(p) if i % 3 == 0 else ("(?:" + re.escape(p) + "|" if i % 3 == 1 else re.escape(p) + ")")
                   for i, p in enumerate(pieces))
    for key, value in where.items():
        text = text.replace(re.escape("{" + key + "}"), re.escape(value))
    text = text.replace(r"\{w\}", f"(?:{PEOPLE})").replace(r"\{o\}", f"(?:{PEOPLE}|her|him)")
    text = text.replace(r"\{p\}", f"(?:(?:{PEOPLE})'s|her|his)")
    text = text.replace(r"\{f\}", "(?:" + "|".join(re.escape(o[0]) for o in vp.OTHERS) + ")")
    text = text.replace(r"\{f_p\}", "(?:his|her|their)")
    for number in "xyz":
        text = text.replace(re.escape("{" + number + "}"), f"(?P<{number}>\\d+)", 1)
        text = text.replace(re.escape("{" + number + "}"), f"(?P={number})")
    return re.compile(text + "$", re.IGNORECASE)


@functools.cache  # a story's patterns are the same for each of its problems
def _patterns(story: str) -> list[tuple[str, bool, re.Pattern]]:
    """(kind, held?, pattern) of every phrasing that could appear in a problem of ``story``."""
    out = []
    measure = next((m for m in vp.MEASURES if m.name == story), None)
    if measure:
        lexicons = {MEASURE_KINDS.get(k, k.upper()): getattr(measure, k) for k in (*MEASURE_KINDS, "question")}
        where = {}
    else:
        setting = next(s for s in vp.SETTINGS if s.name == story)
        where = {"items": setting.items, "groups": setting.groups, "box": setting.box, "place": setting.place}
        lexicons = {k: getattr(vp, k) for k in (*EFFECT, "QUESTION", "MORE_THAN", "PRICE", "SOME", "NOW", "AT_FIRST")}
        lexicons["QUESTION"] = vp.Lexicon(vp.QUESTION.train + vp.QUESTION_LEFT.train,
                                          vp.QUESTION.held + vp.QUESTION_LEFT.held)
    for kind, lexicon in lexicons.items():
        for held, templates in ((False, lexicon.train), (True, lexicon.held)):
            out += [(kind, held, _regex(t.rstrip(".?"), where)) for t in templates]
    return out


def read(story: str, question: str) -> tuple[float, int, set[bool]]:
    """(answer, operations, {held? of each phrasing used}) read back from ``question``'s text."""
    patterns = _patterns(story)
    used = set()

    def match(clause: str) -> tuple[str, dict]:
        found = [(kind, held, m) for kind, held, p in patterns if (m := p.match(clause))]
        assert len({kind for kind, _, _ in found}) == 1, (clause, [k for k, _, _ in found])  # reads one way
        kind, held, m = found[0]
        used.add(held)
        return kind, {k: int(v) for k, v in m.groupdict().items()}

    for held, connectors in ((False, vp.BEFORE.train + vp.THEN.train), (True, vp.BEFORE.held + vp.THEN.held)):
        if any(c in question for c in connectors):
            used.add(held)
    for connector in (vp.BEFORE.train + vp.BEFORE.held):  # marks the told-later event that came first
        question = question.replace(". " + connector, " ~")
    whole = match(question.rstrip(".?"))[1] if "dollars" in question else None
    if whole is not None:  # a price problem: x dollars, y items at z each
        return whole["x"] - whole["y"] * whole["z"], 2, used
    sentences = re.split(r"(?<=[.?])\s+", question)
    tail = sentences.pop()
    if not tail.startswith(("How", "What", "In all", "By how")) or "many more" in tail or "fewer" in tail \
            or "By how" in tail:
        tail = sentences.pop() + " " + tail  # "F has x items. How many more ..."
    events = []
    for sentence in sentences:
        sentence = sentence.rstrip(".")
        for part in re.split(r"|".join(re.escape(c) for c in (*vp.THEN.train, *vp.THEN.held)), sentence):
            first_then = part.split(" ~")
            if len(first_then) == 2:  # "later event ~ earlier event": put back in time order
                events += [match(first_then[1]), match(first_then[0])]
            else:
                events.append(match(part))
    kind, numbers = match(tail.rstrip("?"))
    if kind == "AT_FIRST":  # an inverse problem: some items, the events, the amount now; work back from it
        assert events[0][0] == "SOME" and events[-1][0] == "NOW", events
        value, steps = events[-1][1]["x"], 0
        for kind, numbers in reversed(events[1:-1]):
            value = UNDO[kind](value, numbers.get("x"), numbers.get("y"))
            steps += 2 if kind.endswith("GROUPS") else 1
        return value, steps, used
    value, steps = None, 0
    for kind, numbers in events:
        value = EFFECT[kind](value, numbers.get("x"), numbers.get("y"))
        steps += {"START": 0, "DISTRACTOR": 0, "START_GROUPS": 1, "ADD_GROUPS": 2, "SUB_GROUPS": 2}.get(kind, 1)
    kind, numbers = match(tail.rstrip("?"))  # (again: the loop reused the names)
    if kind == "MORE_THAN":
        value, steps = value - numbers["x"], steps + 1
    else:
        assert kind == "QUESTION", tail
    return value, steps, used


@pytest.fixture(scope="module")
def rows():
    return word_problem_rows(eval_size=300, train_size=1500, seed=11, system_prompt="S", train_steps=(1, 2, 3, 4),
                             eval_steps=(2, 3), max_number=12)


def test_answers_read_back_from_the_text(rows):
    for row in rows[0] + rows[1]:
        value, steps, _ = read(row["story"], row["prompt"][-1]["content"])
        assert value == int(row["answer"]) and float(value).is_integer() and value >= 0, row
        assert steps == row["steps"] == len(row["chain"]), row
        assert all(int(v) >= 0 for v in row["chain"])


def test_held_out_settings_and_phrasings_never_train(rows):
    train, held_out = rows
    held_names = set(vp.HELD_OUT_SETTINGS) | set(vp.HELD_OUT_MEASURES)
    assert {r["story"] for r in held_out} <= held_names and not {r["story"] for r in train} & held_names
    for row in train:
        assert read(row["story"], row["prompt"][-1]["content"])[2] == {False}  # training phrasings only
    for row in held_out:
        assert True in read(row["story"], row["prompt"][-1]["content"])[2]  # at least one held-out phrasing
    assert {r["steps"] for r in held_out} == {2, 3} and {r["steps"] for r in train} == {1, 2, 3, 4}


def test_the_variety_is_there(rows):
    """Each feature the grammar promises shows up in a fair share of training questions."""
    texts = [r["prompt"][-1]["content"] for r in rows[0]]
    share = {
        "groups": r"\d+ (sheets|bags|baskets|boxes|packs|trays|pages|bunches|sets) (of|with) \d+|each of \d+|"
                  r"on each of",
        "two events in a sentence": r" and then |, and then ",
        "out of order": r"Before that, ",
        "distractor": r"years old|o'clock|shelves\.| of (his|her|their) own",
        "difference": r"How many (more|fewer)",
        "start asked for": r"at first\?|start with\?|to begin with\?",
        "money": r"dollars",
        "units": r"metres|minutes",
    }
    for feature, pattern in share.items():
        count = sum(bool(re.search(pattern, t)) for t in texts)
        assert count >= 0.03 * len(texts), (feature, count)


def test_deterministic_and_distinct(rows):
    assert word_problem_rows(eval_size=300, train_size=1500, seed=11, system_prompt="S", train_steps=(1, 2, 3, 4),
                             eval_steps=(2, 3), max_number=12) == rows
    for split in rows:
        questions = [r["prompt"][-1]["content"] for r in split]
        assert len(set(questions)) == len(questions)


def test_worked_examples_are_right():
    for question, answer in WORKED_EXAMPLES:
        lines = answer.split("\n")
        for line in lines[1:-1]:  # one calculation a line, right
            left, right = re.search(r"(\d+ [-+*/] \d+) = (\d+)$", line).groups()
            assert eval(left) == int(right), line
        assert lines[-1] == f"The answer is {right}."


def test_bad_grammar_and_steps_are_errors():
    with pytest.raises(ValueError, match="grammar must be one of varied, simple, mixed"):
        word_problem_rows(10, 10, 0, "", grammar="fancy")
    with pytest.raises(ValueError, match="steps must be among 1, 2, 3, 4 in the varied grammar"):
        word_problem_rows(10, 10, 0, "", train_steps=(5,))


def test_held_only_words_are_the_held_phrasings_own():
    words = vp.held_only_words()
    assert {"fox", "remain", "earlier", "apiece", "donates"} <= words  # only held-out phrasings say these
    assert not words & {"gives", "buys", "more", "then", "before", "left", "each"}  # training phrasings say these


def test_mixed_grammar_trains_on_both_and_holds_out_like_varied():
    train, held_out = word_problem_rows(eval_size=200, train_size=1200, seed=5, system_prompt="S",
                                        train_steps=(2, 3), eval_steps=(2, 3), few_shot=2, max_number=12,
                                        grammar="mixed")
    simple = [r for r in train if r["grammar"] == "simple"]
    assert 0.4 < len(simple) / len(train) < 0.6 and {r["grammar"] for r in held_out} == {"varied"}
    held_names = set(vp.HELD_OUT_SETTINGS) | set(vp.HELD_OUT_MEASURES)
    assert not {r["story"] for r in train} & held_names and {r["story"] for r in held_out} <= held_names
    banned = vp.held_only_words()
    for row in simple:  # no held-out setting's word, no word only the held-out phrasings use
        words = {w.lower() for w in re.findall(r"[A-Za-z]+", row["prompt"][-1]["content"])}
        assert not words & banned and row["story"] not in ("books", "loaves", "seats", "fish"), row
    for row in train:
        if row["grammar"] == "varied":
            assert read(row["story"], row["prompt"][-1]["content"])[2] == {False}
    for row in held_out:
        value, steps, used = read(row["story"], row["prompt"][-1]["content"])
        assert value == int(row["answer"]) and steps == row["steps"] and True in used
    assert all(r["prompt"][1]["content"] == WORKED_EXAMPLES[0][0] for r in train + held_out)  # varied examples
    assert {r["steps"] for r in train} == {2, 3}
    with pytest.raises(ValueError, match="steps must be among 1, 2, 3 in the mixed grammar"):
        word_problem_rows(10, 10, 0, "", train_steps=(4,), grammar="mixed")
