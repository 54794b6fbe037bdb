"""Tasks: the arithmetic split is disjoint and deterministic; JSONL rows are validated and read through the column
map the hf task uses; task.eval_fraction; data order."""

import json

import pytest

from rlvr.config.schema import TaskConfig
from rlvr.tasks import arithmetic_rows, data_order, load_jsonl, load_task, reward_columns
from rlvr.tasks.columns import STEP_BY_STEP_SYSTEM_PROMPT


def _key(row):
    return row["prompt"][-1]["content"]


def test_arithmetic_split_is_disjoint_complete_and_correct():
    train, held = arithmetic_rows(1, ("+", "-", "*"), eval_size=50, train_size=0, seed=3, system_prompt="S")
    keys_train, keys_held = {_key(r) for r in train}, {_key(r) for r in held}
    assert not keys_train & keys_held
    # 10 x 10 questions per operator, subtraction folded to a >= b: 100 + 55 + 100 distinct
    assert len(keys_train | keys_held) == 255 and len(held) == 50
    for r in train + held:
        a, op, b, _ = r["prompt"][-1]["content"].split()
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(r["answer"]) >= 0
        assert r["prompt"][0] == {"role": "system", "content": "S"}


def test_arithmetic_is_seeded():
    a = arithmetic_rows(2, ("+",), 20, 100, seed=1, system_prompt="")
    b = arithmetic_rows(2, ("+",), 20, 100, seed=1, system_prompt="")
    c = arithmetic_rows(2, ("+",), 20, 100, seed=2, system_prompt="")
    assert a == b and a != c
    assert len(a[0]) == 100 and len(a[0][0]["prompt"]) == 1  # no system message when empty


def test_large_question_space_is_sampled_without_repeats():
    train, held = arithmetic_rows(4, ("*",), 30, 500, seed=0, system_prompt="")
    keys = [_key(r) for r in train + held]
    assert len(keys) == len(set(keys)) == 530


def test_arithmetic_rejects_bad_settings():
    with pytest.raises(ValueError, match="subset of"):
        arithmetic_rows(1, ("/",), 10, 0, 0, "")
    with pytest.raises(ValueError, match="leaves no training questions"):
        arithmetic_rows(1, ("+",), 100, 0, 0, "")


def test_jsonl_prompt_and_messages(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "What is 2+2?", "answer": "4", "level": 0},
            {"messages": [{"role": "user", "content": "3+3?"}], "answer": "6", "level": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_jsonl(path)
    assert loaded[0]["prompt"] == "What is 2+2?" and loaded[1]["prompt"][0]["content"] == "3+3?"
    assert loaded[1]["level"] == 1


@pytest.mark.parametrize(
    "line, message",
    [("{not json", "d.jsonl:1: not valid JSON"), ('["a"]', "d.jsonl:1: each line must be a JSON object"),
     ('{"answer": "4"}', ("d.jsonl has no column 'prompt' or 'messages' \\(task.prompt_column\\); columns present: "
                         "answer; set task.prompt_column to the column holding the prompt")),
     ('{"prompt": "  "}', "d.jsonl:1: the prompt must be a non-empty string or chat messages")],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


GSM8K = [
    {"question": "Ann packs 3 boxes of 412 pens. How many pens?", "answer": "3 * 412 = <<3*412=1236>>1236\n#### 1,236"},
    {"question": "Tom had 9 apples and ate 4. How many are left?", "answer": "9 - 4 = <<9-4=5>>5\n#### 5"},
    {"question": "Sue reads 12 pages a day for 3 days. Pages?", "answer": "12 * 3 = <<12*3=36>>36\n#### 36"},
]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_jsonl_through_the_column_map_equals_hf(tmp_path):
    """GSM8K-shaped JSONL (question, answer '... #### 7') with the hf task's keys: the same rows as task.name=hf gives
    for the same files (one mechanism)."""
    (tmp_path / "d").mkdir()
    train_path, eval_path = _write(tmp_path / "d" / "train.jsonl", GSM8K[:2]), _write(tmp_path / "d" / "test.jsonl",
                                                                                    GSM8K[2:])
    keys = {"prompt_column": "question", "answer_format": "gsm8k"}
    train, held, check = load_task(TaskConfig(name="jsonl", train_path=train_path, eval_path=eval_path, **keys))
    assert check == "math_correct" and [r["answer"] for r in train + held] == ["1236", "5", "36"]
    assert train[0] == {"question": GSM8K[0]["question"], "answer": "1236", "answer_raw": GSM8K[0]["answer"],
                        "prompt": [{"role": "system", "content": STEP_BY_STEP_SYSTEM_PROMPT},
                                   {"role": "user", "content": GSM8K[0]["question"]}]}
    assert load_task(TaskConfig(name="hf", source=str(tmp_path / "d"), **keys)) == (train, held, check)
    # a template and a system prompt of one's own; math_jsonl requires the gold answer on every row
    task = TaskConfig(name="math_jsonl", train_path=train_path, eval_path=eval_path, prompt_template="Q: {question}",
                      answer_format="gsm8k", system_prompt="")
    assert load_task(task)[0][1]["prompt"] == [{"role": "user", "content": "Q: " + GSM8K[1]["question"]}]
    with pytest.raises(ValueError, match="has no column 'answer' \\(task.answer_column\\); columns present: question"):
        load_task(TaskConfig(name="math_jsonl", train_path=_write(tmp_path / "q.jsonl", [{"question": "x"}]),
                             eval_path=eval_path, prompt_column="question"))


def test_prompt_column_follows_trl_and_question_columns_are_wrapped(tmp_path):
    rows = [{"prompt": "Continue: 1, 2, 3,", "question": "What is 2 + 2?", "answer": 4}]
    path = _write(tmp_path / "d.jsonl", rows)
    train, _, _ = load_task(TaskConfig(name="jsonl", train_path=path, eval_path=path))
    assert train == [{**rows[0], "prompt": "Continue: 1, 2, 3,"}]  # TRL's standard format: as it is; answer untouched
    train, _, _ = load_task(TaskConfig(name="jsonl", train_path=path, eval_path=path, prompt_column="question",
                                       system_prompt="S"))
    assert train[0]["prompt"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2 + 2?"}]
    assert train[0]["answer"] == 4  # an answer column nobody named is passed on as it is
    train, _, _ = load_task(TaskConfig(name="jsonl", train_path=path, eval_path=path, prompt_template="{question}",
                                       answer_column="answer", answer_format="raw", system_prompt=""))
    assert train[0]["prompt"] == [{"role": "user", "content": "What is 2 + 2?"}] and train[0]["answer"] == 4
    train, _, _ = load_task(TaskConfig(name="math_jsonl", train_path=path, eval_path=path))
    assert train[0]["answer"] == "4"  # read as the gold answer where the task needs one


def test_eval_fraction_splits_one_file_by_task_seed(tmp_path):
    path = _write(tmp_path / "all.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])

    def split(seed=1, fraction=0.25, eval_size=100):
        train, held, _ = load_task(TaskConfig(name="jsonl", train_path=path, eval_fraction=fraction, seed=seed,
                                              eval_size=eval_size))
        return [int(r["answer"]) for r in train], [int(r["answer"]) for r in held]

    train, held = split()
    assert len(held) == 5 and sorted(train + held) == list(range(20)) and train == sorted(train)
    assert split() == (train, held) and split(seed=2)[1] != held  # task.seed chooses them
    assert split(eval_size=3) == (train, held[:3])  # task.eval_size caps the rows evaluated; the rest stay unseen
    for fraction, message in ((0.02, ("holds out 0 and leaves 20 to train on; each side needs at least one row: "
                                     "raise task.eval_fraction")),
                              (0.98, ("holds out 20 and leaves 0 to train on; each side needs at least one row: "
                                     "lower task.eval_fraction"))):
        with pytest.raises(ValueError) as err:
            split(fraction=fraction)
        assert str(err.value) == f"task.eval_fraction={fraction} of the 20 rows of task.train_path {path} {message}, " \
                                 "or add rows"


def test_reward_columns_repeat_per_group_and_name_missing_rows():
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    assert reward_columns(rows, 2) == {"answer": ["1", "1", "2", "2"]}
    with pytest.raises(KeyError, match="dataset row 1 .* has no column 'answer'"):
        reward_columns([{"prompt": "a", "answer": "1"}, {"prompt": "b"}], 1)


def test_data_order_covers_each_row_once_per_epoch():
    seen = [i for step in range(5) for i in data_order(10, seed=0, start=4 * step, count=4)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert data_order(10, 0, 12, 4) == data_order(10, 0, 12, 4) == seen[12:16]
    assert data_order(10, 0, 0, 4) != data_order(10, 1, 0, 4)
