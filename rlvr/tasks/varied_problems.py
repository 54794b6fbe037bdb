"""Word problems with the variety of real ones: the ``varied`` grammar of the ``word_problems`` task.

A problem follows one amount through events, and each event is told by a phrasing drawn from a lexicon:
quantities as groups ("3 packs of 4 cards", "5 stickers to each of 3 friends"), prices ("4 pens at 3 dollars
each"), units (metres, litres, minutes), two events in one sentence ("buys 4 more and then gives 2 to Ben"),
events told out of order ("Before that, ..."), a distractor number ("Ben is 9 years old."), and questions
about a difference ("How many more ... than Ben?"). ``chain`` holds the amount after each operation in the
order of events; a group event is two operations (the group's size, then the change).

Held out twice: the settings in ``HELD_OUT_SETTINGS`` (their objects and places) never produce a training row,
and every phrasing in a lexicon's ``held`` half is used only in held-out rows; a held-out row uses at least
one held-out phrasing. Held-out accuracy then measures transfer to wording the model never trained on.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    """A story world: ``items`` (plural) kept in ``groups`` of several (``box``: one group), at ``place``."""

    name: str
    items: str
    groups: str
    box: str
    place: str


SETTINGS = (
    Setting("stickers", "stickers", "sheets", "sheet", "album"),
    Setting("marbles", "marbles", "bags", "bag", "jar"),
    Setting("apples", "apples", "baskets", "basket", "kitchen"),
    Setting("pencils", "pencils", "boxes", "box", "desk"),
    Setting("cards", "cards", "packs", "pack", "binder"),
    Setting("cookies", "cookies", "trays", "tray", "kitchen"),
    Setting("stamps", "stamps", "pages", "page", "album"),
    Setting("balloons", "balloons", "bunches", "bunch", "party room"),
    Setting("shells", "shells", "buckets", "bucket", "room"),
    Setting("eggs", "eggs", "cartons", "carton", "fridge"),
    Setting("tulips", "tulips", "rows", "row", "garden"),
    Setting("cupcakes", "cupcakes", "boxes", "box", "bakery"),
    Setting("toy cars", "toy cars", "sets", "set", "toy chest"),
)
HELD_OUT_SETTINGS = ("shells", "eggs", "tulips", "cupcakes")


@dataclass(frozen=True)
class Lexicon:
    """Phrasings of one kind of sentence: ``train`` ones appear in training rows, ``held`` ones only held out.
    Fields: {w} the person (subject), {o} the person as an object, {p} their possessive, {f} someone else,
    {x} {y} numbers, {items} {groups} {box} {place} from the setting."""

    train: tuple[str, ...]
    held: tuple[str, ...]


# "[present|past]": a problem is told in one tense, drawn per problem (people write word problems in both).
START = Lexicon(
    ("{w} [has|had] {x} {items}.", "There [are|were] {x} {items} in {p} {place}.",
     "{w} [starts|started] with {x} {items}.",
     "{w} had {x} {items} this morning.", "{w} [collects|collected] {x} {items}."),
    ("{w} [owns|owned] {x} {items}.", "{p} {place} [holds|held] {x} {items}.", "At first, {w} [has|had] {x} {items}."),
)
START_GROUPS = Lexicon(  # x groups of y
    ("{w} [has|had] {x} {groups} of {y} {items}.", "There [are|were] {x} {groups} with {y} {items} in each."),
    ("{w} [keeps|kept] {x} {groups}, each with {y} {items}.",),
)
ADD = Lexicon(
    ("{w} [buys|bought] {x} more {items}.", "{f} [gives|gave] {o} {x} more {items}.", "{w} [finds|found] {x} more.",
     "{w} [gets|got] {x} {items} as a present.", "{w} [wins|won] {x} {items} at the fair.",
     "{w} [picks|picked] up {x} more {items}.", "{w} [is|was] given {x} more.",
     "{f} [brings|brought] {x} more {items}.",
     "{w} [makes|made] {x} more."),
    ("{w} [receives|received] another {x}.", "{f} [hands|handed] {o} {x} extra {items}.",
     "{w} [collects|collected] {x} more.",
     "{x} more {items} [are|were] added."),
)
SUB = Lexicon(
    ("{w} [gives|gave] {x} {items} to {f}.", "{w} [loses|lost] {x} of them.", "{w} [sells|sold] {x} {items}.",
     "{w} [uses|used] {x} {items}.", "{x} of the {items} [get|got] lost.", "{f} [takes|took] {x} of them.",
     "{w} [gives|gave] away {x}.", "A dog [runs|ran] off with {x}.", "{w} [trades|traded] away {x} {items}.",
     "{w} [eats|ate] {x} of them.", "{x} of them [break|broke]."),
    ("{w} [donates|donated] {x} {items} to the school.", "{f} [borrows|borrowed] {x} and [keeps|kept] them.",
     "{w} [throws|threw] away {x} {items}.", "A fox [takes|took] {x}.",
     "{x} {items} [are|were] left behind at the park."),
)
ADD_GROUPS = Lexicon(  # + x groups of y
    ("{w} [buys|bought] {x} {groups} of {y} {items}.", "{w} [gets|got] {x} more {groups} with {y} {items} in each.",
     "Each of {p} {x} friends [gives|gave] {o} {y} {items}."),
    ("{f} [brings|brought] {x} {groups}, each holding {y} {items}.", "{w} [adds|added] {x} {groups} of {y}."),
)
SUB_GROUPS = Lexicon(  # - x groups of y
    ("{w} [gives|gave] {y} {items} to each of {x} friends.", "{w} [sells|sold] {x} {groups} of {y} {items}.",
     "{w} [uses|used] {y} {items} on each of {x} days."),
    ("{w} [hands|handed] out {y} {items} apiece to {x} classmates.",
     "{w} [packs|packed] {x} {groups} of {y} and [sends|sent] them away."),
)
MUL = Lexicon(  # x times as many
    ("{w} [ends|ended] up with {x} times as many {items}.", "The number of {items} [grows|grew] to {x} times as many."),
    ("By the end of the week {w} [has|had] {x} times as many.",),
)
DOUBLE = Lexicon(("The number of {items} [doubles|doubled].", "{w} [doubles|doubled] {p} {items}."),
                 ("{p} {items} [double|doubled].",))
DIV = Lexicon(  # split into x equal groups, one kept
    ("{w} [splits|split] the {items} equally into {x} {groups} and [keeps|kept] one {box}.",
     "{w} [shares|shared] the {items} equally among {x} friends, {o} included; count {p} share."),
    ("{w} [divides|divided] the {items} evenly into {x} {groups}; count one {box}.",),
)
HALF = Lexicon(("{w} [gives|gave] away half of them.",
                "{w} [keeps|kept] half of the {items} and [gives|gave] the rest away."),
               ("Half of the {items} [are|were] sold.",))
DISTRACTOR = Lexicon(
    ("{w} is {x} years old.", "{f} [has|had] {x} {items} of {f_p} own.", "It [is|was] {x} o'clock.",
     "{p} {place} [has|had] {x} shelves."),
    ("{f} is {x} years old.", "The {place} is {x} metres from the door.", "{w} has {x} friends at school."),
)
BEFORE = Lexicon(("Before that, ",), ("Earlier, ",))
THEN = Lexicon((", and then ", " and then "), (", after which ",))  # two events in one sentence
QUESTION = Lexicon(
    ("How many {items} does {w} have now?", "How many {items} are there now?",
     "How many {items} does {w} have in the end?"),
    ("What is the number of {items} now?", "In all, how many {items} does {w} have now?"),
)
QUESTION_LEFT = Lexicon(  # after an event that took some away
    ("How many {items} are left?", "How many {items} does {w} have left?"),
    ("How many {items} remain?",),
)
SOME = Lexicon(("{w} had some {items}.",), ("There were some {items} in {p} {place}.",))  # an inverse problem's start
NOW = Lexicon(("Now {w} has {x} {items}.", "In the end {w} had {x} {items}."), ("{w} is left with {x} {items}.",))
AT_FIRST = Lexicon(  # the question of an inverse problem: the amount before the events
    ("How many {items} did {w} have at first?", "How many {items} did {w} start with?"),
    ("How many {items} were there to begin with?",),
)
MORE_THAN = Lexicon(  # a difference: w's amount minus f's x
    ("{f} has {x} {items}. How many more {items} does {w} have than {f}?",
     "{f} has {x} {items}. How many fewer {items} does {f} have than {w}?"),
    ("{f} owns {x} {items}. By how many {items} does {w} have more than {f}?",),
)


@dataclass(frozen=True)
class Measure:
    """A story about a measured amount (unit problems): their own phrasings, two halves like a Lexicon."""

    name: str
    start: Lexicon
    add: Lexicon
    sub: Lexicon
    add_groups: Lexicon
    sub_groups: Lexicon
    question: Lexicon


MEASURES = (
    Measure("ribbon", Lexicon(("{w} has a ribbon {x} metres long.",), ("{p} ribbon is {x} metres long.",)),
            Lexicon(("{w} ties on another {x} metres.",), ("{w} adds {x} metres of ribbon.",)),
            Lexicon(("{w} cuts off {x} metres.",), ("{x} metres are used for a bow.",)),
            Lexicon(("{w} ties on {x} pieces of {y} metres each.",), ("{w} adds {x} pieces, each {y} metres long.",)),
            Lexicon(("{w} cuts off {x} pieces of {y} metres each.",),
                    ("{w} snips {x} pieces that are {y} metres each.",)),
            Lexicon(("How many metres of ribbon are left?",), ("How long is the ribbon now, in metres?",))),
    Measure("piano", Lexicon(("{w} plans to practise the piano for {x} minutes.",),
                             ("{w} sets aside {x} minutes for piano practice.",)),
            Lexicon(("Then {w} decides to practise {x} more minutes.",), ("{w} adds {x} minutes to the plan.",)),
            Lexicon(("{w} cuts the practice short by {x} minutes.",), ("A phone call takes {x} minutes off it.",)),
            Lexicon(("{w} adds {x} songs of {y} minutes each to the plan.",),
                    ("{w} adds {x} pieces that last {y} minutes each.",)),
            Lexicon(("{w} skips {x} songs of {y} minutes each from the plan.",),
                    ("{x} breaks of {y} minutes each are taken out of it.",)),
            Lexicon(("How many minutes does {w} practise?",), ("How many minutes of practice is that?",))),
    Measure("tank", Lexicon(("A tank holds {x} litres of water.",), ("There are {x} litres of water in a tank.",)),
            Lexicon(("{w} pours in {x} more litres.",), ("Rain adds {x} litres.",)),
            Lexicon(("{x} litres leak out.",), ("{w} drains {x} litres.",)),
            Lexicon(("{w} pours in {x} buckets of {y} litres each.",),
                    ("{x} jugs holding {y} litres each are emptied in.",)),
            Lexicon(("{w} fills {x} bottles of {y} litres each from it.",),
                    ("{x} pots of {y} litres each are taken out.",)),
            Lexicon(("How many litres are in the tank now?",), ("How much water, in litres, is in the tank now?",))),
)
HELD_OUT_MEASURES = ("tank",)
PRICE = Lexicon(  # money: x dollars, buys y items at z dollars each
    ("{w} has {x} dollars. {w} buys {y} {items} at {z} dollars each. How many dollars does {w} have left?",
     ("Each of the {items} costs {z} dollars. {w} buys {y} of them and pays with {x} dollars. How much change does "
      "{w} get, in dollars?")),
    (("{w} takes {x} dollars to the shop, where {items} cost {z} dollars apiece. After buying {y}, how many dollars "
      "are left?"),),
)

NAMES = (("Ana", "she", "her", "her"), ("Ben", "he", "him", "his"), ("Chen", "he", "him", "his"),
         ("Dara", "she", "her", "her"), ("Eli", "he", "him", "his"), ("Fay", "she", "her", "her"),
         ("Gus", "he", "him", "his"), ("Hana", "she", "her", "her"), ("Ivo", "he", "him", "his"),
         ("Jun", "he", "him", "his"), ("Kai", "he", "him", "his"), ("Lea", "she", "her", "her"),
         ("Mo", "he", "him", "his"), ("Nia", "she", "her", "her"), ("Omar", "he", "him", "his"),
         ("Priya", "she", "her", "her"), ("Rosa", "she", "her", "her"), ("Sam", "he", "him", "his"))
OTHERS = (("Ben", "his"), ("Tess", "her"), ("a friend", "their"), ("Grandma", "her"), ("the teacher", "her"),
          ("Leo", "his"), ("Mia", "her"), ("a neighbour", "their"))
PROPER = {n[0] for n in NAMES} | {"Tess", "Grandma", "Leo", "Mia"}


class _Phrases:
    """Draws phrasings for one problem: training rows from the ``train`` halves only; held-out rows from both
    halves, each lexicon's held half chosen with probability 1/2 (``held_used`` says whether one was)."""

    def __init__(self, rng: random.Random, held_out: bool):
        self.rng, self.held_out, self.held_used, self.past = rng, held_out, False, False

    def __call__(self, lexicon: Lexicon) -> str:
        if self.held_out and self.rng.random() < 0.5:
            self.held_used = True
            template = self.rng.choice(lexicon.held)
        else:
            template = self.rng.choice(lexicon.train)
        return _TENSES.sub(lambda m: m.group(2 if self.past else 1), template)


_TENSES = re.compile(r"\[([^|\]]*)\|([^\]]*)\]")  # "[present|past]"


def held_only_words() -> set[str]:
    """The words (lower case) of held-out phrasings that no training phrasing uses ("fox", "remain", ...): a row
    of another grammar trained beside this one must not contain them."""
    lexicons = [v for v in globals().values() if isinstance(v, Lexicon)]
    lexicons += [getattr(m, f) for m in MEASURES for f in ("start", "add", "sub", "add_groups", "sub_groups",
                                                           "question")]

    def words_of(templates) -> set[str]:
        return {w for t in templates for w in words(re.sub(r"\{\w+\}", "", t))}

    return words_of(t for lex in lexicons for t in lex.held) - words_of(t for lex in lexicons for t in lex.train)


def words(text: str) -> set[str]:
    """The words of ``text``, lower case."""
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text)}


def varied_problem(rng: random.Random, held_out: bool, max_number: int) -> tuple[str, list[int], str]:
    """(question, chain, setting name) of one problem; the chain has 1-6 operations (callers keep the counts they
    want)."""
    phrase = _Phrases(rng, held_out)
    kind = rng.choices(("story", "measure", "price"), weights=(10, 1, 1))[0]
    for _ in range(100):  # a draw whose amounts leave the allowed range is drawn again
        phrase.held_used, phrase.past = False, rng.random() < 0.5
        made = {"story": _story, "measure": _measure, "price": _price}[kind](rng, phrase, held_out, max_number)
        if made is not None and (phrase.held_used or not held_out):
            return made
    raise RuntimeError("no valid varied word problem in 100 draws")  # cannot happen with max_number >= 4


def _person(rng: random.Random) -> tuple[dict, dict]:
    """The fields naming the person (and someone else), and the same with pronouns (for later sentences)."""
    name, subj, obj, poss = rng.choice(NAMES)
    other, other_poss = rng.choice([o for o in OTHERS if o[0] != name])
    who = {"w": name, "o": name, "p": f"{name}'s", "f": other, "f_p": other_poss}
    return who, {**who, "w": subj, "o": obj, "p": poss}


def _say(template: str, **fields) -> str:
    text = template.format(**fields)
    return text[0].upper() + text[1:]


def _story(rng, phrase, held_out, max_number):
    setting = rng.choice([s for s in SETTINGS if (s.name in HELD_OUT_SETTINGS) == held_out])
    who, pronouns = _person(rng)
    where = {"items": setting.items, "groups": setting.groups, "box": setting.box, "place": setting.place}
    inverse = rng.random() < 0.12  # the end amount is told, the start asked for ("How many did she have at first?")
    phrase.past = phrase.past or inverse
    if inverse:  # (its start is not told: no phrasing is drawn for it)
        value, start, chain = rng.randint(2, max_number), "", []
    elif rng.random() < 0.2:
        x, y = rng.randint(2, 5), rng.randint(2, max(2, min(6, max_number // 2)))
        start, value, chain = _say(phrase(START_GROUPS), **who, **where, x=x, y=y), x * y, [x * y]
    else:
        value = rng.randint(2, max_number)
        start, chain = _say(phrase(START), **who, **where, x=value), []
    events, undo = [], []  # undo: the amounts met when working back from the end
    for _ in range(rng.choice((1, 2, 2))):
        made = _event(rng, phrase, value, max_number)
        if made is None:
            return None
        template, fields, values, op = made
        undo = [*values[:-1], value, *undo]  # a group's size, then the amount before the event
        value = values[-1]
        chain += values
        events.append((template, fields))
    rendered = [_say(t, **(pronouns if rng.random() < 0.5 else who), **where, **f) for t, f in events]
    if len(events) >= 2 and ";" not in rendered[-2] and rng.random() < 0.3:  # two events in one sentence
        (t2, f2) = events[-1]
        second = t2.format(**pronouns, **where, **f2)
        rendered[-2:] = [rendered[-2][:-1] + phrase(THEN) + _lower_first(second)]
    elif len(rendered) >= 2 and not inverse and rng.random() < 0.2:  # out of order: the earlier event told later
        rendered[-2:] = [rendered[-1], phrase(BEFORE) + _lower_first(rendered[-2])]
    if inverse:
        sentences = [_say(phrase(SOME), **who, **where), *rendered, _say(phrase(NOW), **pronouns, **where, x=value),
                     _say(phrase(AT_FIRST), **who, **where)]
        return " ".join(sentences), undo, setting.name
    sentences = [start, *rendered]
    compare = value >= 3 and rng.random() < 0.2  # the question asks for a difference to someone else's amount
    if not compare and rng.random() < 0.25:  # a number the problem does not use
        distractor = _say(phrase(DISTRACTOR), **who, **where, x=rng.randint(2, 12))
        sentences.insert(rng.choice((1, len(sentences))), distractor)  # never between "Before that" and its event
    if compare:
        other = rng.randint(1, value - 1)
        sentences.append(_say(phrase(MORE_THAN), **who, **where, x=other))
        chain.append(value - other)
    else:
        taken = op in ("sub", "sub_groups", "half", "div")  # the last event took some away: "How many are left?"
        sentences.append(_say(phrase(QUESTION_LEFT if taken and rng.random() < 0.5 else QUESTION), **who, **where))
    return " ".join(sentences), chain, setting.name


def _lower_first(sentence: str) -> str:
    """``sentence`` to follow other words: its first letter in lower case unless it starts with a name."""
    return sentence if sentence.split(" ")[0].removesuffix("'s") in PROPER else sentence[0].lower() + sentence[1:]


def _event(rng, phrase, value, max_number):
    """(template, numbers, amounts after, operation) of one event on ``value``, or None when none fits."""
    add_max = max(2, 3 * max_number // 4)
    options = ["add", "add_groups"]
    if value >= 3:
        options += ["sub", "sub"]
    if value >= 5:
        options.append("sub_groups")
    if value <= max_number:
        options += ["mul", "double"]
    if value >= 2 and value % 2 == 0:
        options.append("half")
    if any(value % d == 0 for d in range(2, 6) if value // d >= 1):
        options.append("div")
    op = rng.choice(options)
    if op == "add":
        x = rng.randint(1, add_max)
        return phrase(ADD), {"x": x}, [value + x], op
    if op == "sub":
        x = rng.randint(2, value - 1)
        return phrase(SUB), {"x": x}, [value - x], op
    if op == "add_groups":
        x, y = rng.randint(2, 5), rng.randint(2, 6)
        return phrase(ADD_GROUPS), {"x": x, "y": y}, [x * y, value + x * y], op
    if op == "sub_groups":
        pairs = [(x, y) for x in range(2, 6) for y in range(2, 7) if x * y < value]
        if not pairs:
            return None
        x, y = rng.choice(pairs)
        return phrase(SUB_GROUPS), {"x": x, "y": y}, [x * y, value - x * y], op
    if op == "mul":
        x = rng.randint(2, 4)
        return phrase(MUL), {"x": x}, [value * x], op
    if op == "double":
        return phrase(DOUBLE), {}, [value * 2], op
    if op == "half":
        return phrase(HALF), {}, [value // 2], op
    x = rng.choice([d for d in range(2, 6) if value % d == 0])
    return phrase(DIV), {"x": x}, [value // x], op


def _measure(rng, phrase, held_out, max_number):
    measure = rng.choice([m for m in MEASURES if (m.name in HELD_OUT_MEASURES) == held_out])
    who, pronouns = _person(rng)
    value = rng.randint(6, max(6, 2 * max_number))
    sentences, chain = [_say(phrase(measure.start), **who, x=value)], []
    for _ in range(rng.choice((1, 2, 2))):
        op = rng.choice(("add", "sub", "add_groups", "sub_groups"))
        if op == "sub" and value < 3:
            return None
        if op in ("add", "sub"):
            x = rng.randint(2, min(max_number, value - 1) if op == "sub" else max_number)
            value = value + x if op == "add" else value - x
            sentences.append(_say(phrase(getattr(measure, op)), **rng.choice((who, pronouns)), x=x))
            chain.append(value)
        else:
            x, y = rng.randint(2, 4), rng.randint(2, 6)
            if op == "sub_groups" and x * y >= value:
                return None
            value = value + x * y if op == "add_groups" else value - x * y
            sentences.append(_say(phrase(getattr(measure, op)), **rng.choice((who, pronouns)), x=x, y=y))
            chain += [x * y, value]
    sentences.append(_say(phrase(measure.question), **who))
    return " ".join(sentences), chain, measure.name


def _price(rng, phrase, held_out, max_number):
    setting = rng.choice([s for s in SETTINGS if (s.name in HELD_OUT_SETTINGS) == held_out])
    who, _ = _person(rng)
    y, z = rng.randint(2, 6), rng.randint(2, 5)
    x = rng.randint(y * z + 1, y * z + max_number)
    text = _say(phrase(PRICE), **who, items=setting.items, x=x, y=y, z=z)
    return text, [y * z, x - y * z], setting.name
