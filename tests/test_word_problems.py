"""The word-problem task's simple grammar: deterministic per seed, every answer re-derived here from the question
text by an independent parser, held-out stories never in training."""

import re

import pytest

from rlvr.tasks.word_problems import HELD_OUT, STORIES, word_problem_rows

OPS = {"add": lambda v, x: v + x, "sub": lambda v, x: v - x, "mul": lambda v, x: v * x, "div": lambda v, x: v / x}


def _pattern(template: str) -> re.Pattern:
    text = re.escape(template).replace(r"\{w\}", r"[A-Z][a-z]+").replace(r"\{x\}", r"(\d+)")
    return re.compile(text + "$")


def solve(story_name: str, question: str) -> tuple[float, int]:
    """(answer, number of operations) read back from the sentences of ``question``."""
    story = next(s for s in STORIES if s.name == story_name)
    sentences = re.split(r"(?<=[.?])\s+", question)
    value, steps = None, 0
    for sentence in sentences[:-1]:
        matches = [(kind, m) for kind in ("start", *OPS) for t in getattr(story, kind)
                   if (m := _pattern(t).match(sentence))]
        assert len({kind for kind, _ in matches}) == 1, (sentence, matches)  # every sentence reads one way
        kind, m = matches[0]
        x = int(m.group(1))
        if kind == "start":
            value = x
        else:
            value, steps = OPS[kind](value, x), steps + 1
    assert any(_pattern(t).match(sentences[-1]) for t in story.question), sentences[-1]
    return value, steps


@pytest.fixture(scope="module")
def rows():
    return simple_rows(seed=7)


def simple_rows(seed: int):
    return word_problem_rows(eval_size=200, train_size=1500, seed=seed, system_prompt="S", train_steps=(1, 2, 3),
                             grammar="simple")


def test_answers_are_right_and_whole(rows):
    for row in rows[0] + rows[1]:
        value, steps = solve(row["story"], row["prompt"][-1]["content"])
        assert value == int(row["answer"]) and float(value).is_integer() and value >= 0
        assert steps == row["steps"]


def test_held_out_stories_never_train(rows):
    train, held_out = rows
    assert {r["story"] for r in held_out} == set(HELD_OUT)
    assert not {r["story"] for r in train} & set(HELD_OUT)
    held_sentences = {t.split("{")[0] for s in STORIES if s.name in HELD_OUT for t in s.start if "{" in t}
    assert not any(r["prompt"][-1]["content"].startswith(tuple(p for p in held_sentences if len(p) > 8))
                   for r in train)
    assert {r["steps"] for r in held_out} == {2} and {r["steps"] for r in train} == {1, 2, 3}


def test_deterministic_per_seed_and_distinct(rows):
    again = simple_rows(seed=7)
    assert again == rows
    other = simple_rows(seed=8)
    assert other[0][:20] != rows[0][:20]
    for split in rows:
        questions = [r["prompt"][-1]["content"] for r in split]
        assert len(set(questions)) == len(questions)
    assert rows[0][0]["prompt"][0] == {"role": "system", "content": "S"}


def test_bad_steps_are_an_error():
    with pytest.raises(ValueError, match="steps must be among 1, 2, 3"):
        word_problem_rows(10, 10, 0, "", train_steps=(4,), grammar="simple")
    with pytest.raises(ValueError, match="few_shot must be 0-2"):
        word_problem_rows(10, 10, 0, "", few_shot=3, grammar="simple")
    with pytest.raises(ValueError, match="max_number must be at least 4"):
        word_problem_rows(10, 10, 0, "", max_number=3, grammar="simple")


def test_worked_examples_come_before_the_question_and_are_right():
    train, held_out = word_problem_rows(5, 5, 0, "S", few_shot=2, grammar="simple")
    for row in train + held_out:
        roles = [m["role"] for m in row["prompt"]]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
        assert row["prompt"][:5] == train[0]["prompt"][:5]  # the same examples before every question
    for example, answer in zip(train[0]["prompt"][1:5:2], train[0]["prompt"][2:5:2]):
        lines = answer["content"].split("\n")
        values = [eval(line.split(": ")[-1].split("=")[0]) for line in lines[1:-1]]
        assert [int(line.split("= ")[-1]) for line in lines[1:-1]] == values  # each written result is right
        assert lines[-1] == f"The answer is {int(values[-1])}."
        assert not any(s.name in example["content"] for s in STORIES)  # a story of neither split
    assert [m["role"] for m in word_problem_rows(3, 3, 0, "", few_shot=0, grammar="simple")[0][0]["prompt"]] == ["user"]


def test_max_number_bounds_the_amounts():
    for max_number in (6, 12):
        train, held_out = word_problem_rows(100, 400, 3, "", train_steps=(1, 2, 3), max_number=max_number,
                                            grammar="simple")
        for row in train + held_out:
            question = row["prompt"][-1]["content"]
            first = int(re.search(r"\d+", question).group())
            assert 2 <= first <= max_number
            assert solve(row["story"], question)[0] == int(row["answer"])
    # two steps, max_number 6: adds are <= 4, a multiplier (<= 5) applies to amounts <= 9: at most 9 * 5 + 4
    assert max(int(r["answer"]) for r in word_problem_rows(100, 400, 3, "", max_number=6, grammar="simple")[0]) <= 49


@pytest.mark.long
def test_reasoning_example_runs_two_steps(tiny_model_dir, tmp_path):
    from rlvr.cli import main
    from rlvr.store.metrics import read_metrics

    out = tmp_path / "run"
    args = [f"model.name={tiny_model_dir}", "model.lora_r=4", f"output_dir={out}", "train.steps=2",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "train.prompts_per_step=2", "task.eval_size=4",
            "eval.batch_size=4", "log.progress=false", "task.system_prompt=Be brief.",
            "task.few_shot=0", "task.drop_long_prompts=true"]  # a 256-token context
    assert main(["train", "examples/reasoning.yaml", *args]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["rollout/reward/math_correct_missing"] == 0 and "eval/accuracy" in records[-1]


@pytest.mark.long
def test_curriculum_and_a_second_eval_set_in_a_run(tiny_model_dir, tmp_path, capsys):
    """task.curriculum: step 1 draws one-operation problems only, then (stage cap 1) the two- and three-operation
    mix; eval.extra_path: its accuracy is logged beside the held-out one and printed by rlvr eval."""
    import json

    from rlvr.cli import main
    from rlvr.store.metrics import EXTRA_ACCURACY, read_metrics

    extra = tmp_path / "extra.jsonl"
    extra.write_text('{"question": "Ann has 2 cats and gets 3 more. How many cats?", "answer": "5"}\n'
                     '{"question": "Bo has 9 cups and breaks 4. How many are left?", "answer": 5}\n')
    out = tmp_path / "run"
    args = [f"model.name={tiny_model_dir}", "model.lora_r=4", f"output_dir={out}", "train.steps=3",
            "rollout.group_size=2", "rollout.max_new_tokens=8", "train.prompts_per_step=3", "task.eval_size=4",
            "eval.batch_size=4", "log.progress=false", "task.system_prompt=Be brief.", "task.few_shot=0",
            "task.train_steps=[2, 3]", "task.curriculum=[1]", "task.curriculum_stage_steps=1",
            "task.drop_long_prompts=true",
            f"eval.extra_path={extra}"]
    assert main(["train", "examples/reasoning.yaml", *args]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert EXTRA_ACCURACY in records[0] and EXTRA_ACCURACY in records[-1]
    assert [r["data/curriculum_stage"] for r in records[1:]] == [1, 1, 1]  # the cap ends stage 0 after one step
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    steps_of = {step: {s["columns"]["steps"] for s in samples if s["step"] == step and "columns" in s}
                for step in (1, 2, 3)}  # (the columns come with the first completion of each group)
    assert steps_of[1] == {1} and steps_of[2] | steps_of[3] <= {2, 3}

    capsys.readouterr()
    assert main(["eval", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["extra_size"] == 2 and 0 <= printed["extra_accuracy"] <= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no question column", "answer": "1"}\n')
    assert main(["eval", str(out), f"eval.extra_path={bad}"]) == 2
    assert f"{bad}:1: eval.extra_path rows for word_problems need a 'question' string" in capsys.readouterr().err
