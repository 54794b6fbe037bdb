"""Tasks: the arithmetic split is disjoint and deterministic; JSONL rows are validated; data order."""

import json

import pytest

from rlvr.tasks import arithmetic_rows, data_order, load_jsonl, reward_columns


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
     ('{"answer": "4"}', "d.jsonl:1: needs a non-empty 'prompt'"),
     ('{"prompt": "  "}', "d.jsonl:1: needs a non-empty")],
)
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)


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
