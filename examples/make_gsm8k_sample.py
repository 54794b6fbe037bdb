"""Write examples/data/gsm8k_sample/{train,test}.parquet: grade-school problems in GSM8K's format (deterministic).

Columns as in GSM8K: ``question`` and ``answer`` = worked steps with ``<<calc=result>>`` annotations, then
``#### N`` (thousands separated: "#### 1,250"). The problems are this project's own, from the templates below;
no GSM8K text is used. Held-out questions never appear in training.
"""

import random
import sys
from pathlib import Path

import datasets

OUT = Path(__file__).resolve().parent / "data" / "gsm8k_sample"
NAMES = ["Ava", "Bruno", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonah"]


def _calc(a: int, op: str, b: int) -> tuple[int, str]:
    """The result and GSM8K's annotated form, e.g. (48, '4 * 12 = <<4*12=48>>48')."""
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return value, f"{a} {op} {b} = <<{a}{op}{b}={value}>>{value}"


def bakery(rng, name):
    trays, per_tray, days = rng.randint(3, 12), rng.choice([6, 8, 12, 24]), rng.randint(2, 9)
    daily, step1 = _calc(trays, "*", per_tray)
    total, step2 = _calc(daily, "*", days)
    q = (f"{name}'s bakery bakes {trays} trays of {per_tray} muffins every morning. How many muffins does it bake in "
         f"{days} days?")
    return q, [f"Each morning it bakes {step1} muffins.", f"In {days} days it bakes {step2} muffins."], total


def stickers(rng, name):
    start, packs, given = rng.randint(10, 60), rng.randint(2, 6), rng.randint(3, 9)
    per_pack = rng.choice([5, 10, 12, 25])
    bought, step1 = _calc(packs, "*", per_pack)
    have, step2 = _calc(start, "+", bought)
    left, step3 = _calc(have, "-", given)
    q = (f"{name} has {start} stickers, buys {packs} packs of {per_pack} stickers and then gives {given} stickers "
         f"to a friend. How many stickers does {name} have now?")
    return q, [f"The packs hold {step1} stickers.", f"Then {name} has {step2} stickers.",
               f"After giving some away, {step3} stickers are left."], left


def pencils(rng, name):
    classes, each, per_box = rng.randint(3, 12), rng.randint(4, 30), rng.choice([10, 12, 20])
    boxes = classes * each
    total, step1 = _calc(boxes, "*", per_box)
    share, step2 = _calc(total, "/", classes)
    q = (f"A school orders {boxes} boxes of pencils with {per_box} pencils in each box. {name} shares them equally "
         f"among {classes} classes. How many pencils does each class get?")
    return q, [f"The school has {step1} pencils.", f"Each class gets {step2} pencils."], share


def eggs(rng, name):
    per_day, weeks = rng.randint(12, 95), rng.randint(2, 12)
    per_week, step1 = _calc(per_day, "*", 7)
    total, step2 = _calc(per_week, "*", weeks)
    q = f"{name}'s hens lay {per_day} eggs a day. How many eggs do they lay in {weeks} weeks?"
    return q, [f"In a week they lay {step1} eggs.", f"In {weeks} weeks they lay {step2} eggs."], total


def theater(rng, name):
    rows, seats, empty = rng.randint(12, 40), rng.randint(15, 45), rng.randint(5, 60)
    capacity, step1 = _calc(rows, "*", seats)
    people, step2 = _calc(capacity, "-", empty)
    q = (f"{name} counts {rows} rows of {seats} seats in a theater, and {empty} seats are empty. How many people are "
         "in the theater?")
    return q, [f"The theater has {step1} seats.", f"So {step2} people are there."], people


def savings(rng, name):
    monthly, months = rng.choice([50, 75, 120, 150, 200, 250]), rng.randint(6, 24)
    saved, step1 = _calc(monthly, "*", months)
    spent = rng.randint(90, min(600, saved - 10))
    left, step2 = _calc(saved, "-", spent)
    q = (f"{name} saves ${monthly} every month for {months} months, then spends ${spent} on a bike. How many dollars "
         f"does {name} have left?")
    return q, [f"{name} saves {step1} dollars.", f"After the bike, {step2} dollars are left."], left


def warehouse(rng, name):
    crates, bottles, sold = rng.randint(20, 90), rng.choice([24, 36, 48]), rng.randint(100, 900)
    stock, step1 = _calc(crates, "*", bottles)
    left, step2 = _calc(stock, "-", sold)
    q = (f"A warehouse has {crates} crates of {bottles} bottles each. {name} sells {sold} bottles. How many bottles "
         "remain?")
    return q, [f"The warehouse holds {step1} bottles.", f"After the sale, {step2} bottles remain."], left


TEMPLATES = [bakery, stickers, pencils, eggs, theater, savings, warehouse]


def rows(count: int, rng: random.Random) -> list[dict]:
    out, seen = [], set()
    while len(out) < count:
        question, steps, answer = rng.choice(TEMPLATES)(rng, rng.choice(NAMES))
        if question in seen:  # the held-out split shares no question with training
            continue
        seen.add(question)
        out.append({"question": question, "answer": "\n".join(steps) + f"\n#### {answer:,}"})
    return out


def main() -> None:
    data = rows(250, random.Random(8))
    OUT.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", data[:200]), ("test", data[200:])):
        datasets.Dataset.from_list(part).to_parquet(OUT / f"{split}.parquet")
    big = sum("," in r["answer"].rsplit("####", 1)[1] for r in data)
    print(f"wrote 200 train + 50 test rows to {OUT} ({big} answers with thousands separators)", file=sys.stderr)


if __name__ == "__main__":
    main()
