"""task.name=hf: GSM8K- and MATH-format rows from parquet, jsonl and save_to_disk sources, with hand-derived values."""

import json

import datasets
import pytest

from rlvr.cli import main
from rlvr.config.loading import ConfigError, load_config
from rlvr.config.schema import TaskConfig
from rlvr.store.metrics import read_metrics
from rlvr.tasks import load_task, reward_columns
from rlvr.tasks.hf import HF_SYSTEM_PROMPT, gold_answer

GSM8K_TRAIN = [
    {"question": "Ann packs 3 boxes of 412 pens. How many pens?", "answer": "3 * 412 = <<3*412=1236>>1236\n#### 1,236"},
    {"question": "Tom had 9 apples and ate 4. How many are left?", "answer": "9 - 4 = <<9-4=5>>5\n#### 5"},
    {"question": "A city of 1,250,000 loses 250,000. How many remain?", "answer": "1250000 - 250000\n#### 1,000,000"},
]
GSM8K_TEST = [
    {"question": "Sue reads 12 pages a day for 3 days. Pages?", "answer": "12 * 3 = <<12*3=36>>36\n#### 36"},
    {"question": "A bag holds 2,500 g of rice; 500 g are used. Grams left?", "answer": "2500 - 500\n#### 2,000"},
]
MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "Halve both: $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Prealgebra"},
    {"problem": "Compute $2+3$.", "solution": "Not $\\boxed{4}$; it is $\\fbox{5}$.", "level": "Level 2",
     "type": "Algebra"},
    {"problem": "Solve $x^2=9$ for $x>0$.", "solution": "$x=\\boxed{3}$", "level": "Level 3", "type": "Algebra"},
]


def _task(source, **kw) -> TaskConfig:
    return TaskConfig(name="hf", source=str(source), **kw)


def _write(directory, splits: dict, fmt: str):
    """Write {split: rows} as parquet or jsonl files named by split, or as one save_to_disk directory."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "saved":
        datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in splits.items()}).save_to_disk(directory)
    for split, rows in splits.items():
        if fmt == "parquet":
            datasets.Dataset.from_list(rows).to_parquet(directory / f"{split}.parquet")
        elif fmt == "jsonl":
            (directory / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _user(row):
    return row["prompt"][-1]["content"]


def test_answer_presets():
    assert gold_answer("reasoning\n#### 1,234", "gsm8k") == "1234"
    assert gold_answer("#### 1,234,567", "gsm8k") == "1234567"
    assert gold_answer("a #### b #### -3.5 ", "gsm8k") == "-3.5"  # the last marker
    assert gold_answer("no marker 12", "gsm8k") is None
    assert gold_answer("so $\\boxed{\\frac{1}{2}}$", "math") == "\\frac{1}{2}"
    assert gold_answer("\\boxed{4} then \\fbox{\\sqrt{2}}", "math") == "\\sqrt{2}"
    assert gold_answer("no box", "math") is None
    assert gold_answer(42, "raw") == "42" and gold_answer("  ", "raw") is None


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "saved"])
def test_gsm8k_rows_from_every_source_kind(tmp_path, fmt):
    source = _write(tmp_path / "gsm8k", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, fmt)
    train, held_out, check = load_task(_task(source, prompt_column="question", answer_format="gsm8k"))
    assert check == "math_correct"
    assert [r["answer"] for r in train] == ["1236", "5", "1000000"]
    assert [r["answer"] for r in held_out] == ["36", "2000"]
    assert train[0] == {
        "question": GSM8K_TRAIN[0]["question"],
        "answer": "1236",
        "answer_raw": "3 * 412 = <<3*412=1236>>1236\n#### 1,236",  # the source column keeps its text
        "prompt": [{"role": "system", "content": HF_SYSTEM_PROMPT},
                   {"role": "user", "content": "Ann packs 3 boxes of 412 pens. How many pens?"}],
    }


def test_math_rows_with_template_and_extra_columns(tmp_path):
    datasets.Dataset.from_list(MATH_ROWS).to_parquet(tmp_path / "math.parquet")
    task = _task(tmp_path / "math.parquet", prompt_template="{type} ({level}): {problem}", answer_column="solution",
                 answer_format="math", eval_split="", eval_size=1, system_prompt="Box it.")
    train, held_out, _ = load_task(task)
    rows = sorted(train + held_out, key=lambda r: r["level"])
    assert [r["answer"] for r in rows] == ["\\frac{1}{2}", "5", "3"]
    assert rows[1]["prompt"] == [{"role": "system", "content": "Box it."},
                                 {"role": "user", "content": "Algebra (Level 2): Compute $2+3$."}]
    assert rows[1]["solution"] == MATH_ROWS[1]["solution"] and "answer_raw" not in rows[1]
    # every column reaches reward functions, as in TRL
    assert set(reward_columns(rows, 2)) == {"problem", "solution", "level", "type", "answer"}
    assert reward_columns(rows, 2)["type"] == ["Prealgebra"] * 2 + ["Algebra"] * 4


def test_extracted_answers_score_through_math_correct(tmp_path):
    from rlvr.rewards import build_reward

    source = _write(tmp_path / "gsm8k", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, "parquet")
    train, _, check = load_task(_task(source, prompt_column="question", answer_format="gsm8k"))
    rows = [train[0], train[0], train[2]]
    completions = ["3 boxes of 412 is 1,236 pens. The answer is 1236.", "The answer is 1237.", "\\boxed{1,000,000}"]
    reward = build_reward(check)
    try:
        assert reward(prompts=[r["prompt"] for r in rows], completions=completions, **reward_columns(rows, 1)) == [
            1.0, 0.0, 1.0]
    finally:
        reward.verifier.close()


def test_held_out_rows_carved_by_seed(tmp_path):
    rows = [{"q": f"question {i}", "a": str(i)} for i in range(20)]
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def split(seed, train_size=0):
        train, held, _ = load_task(_task(tmp_path / "all.jsonl", prompt_column="q", answer_column="a", eval_split="",
                                         eval_size=5, seed=seed, train_size=train_size))
        return [int(r["a"]) for r in train], [int(r["a"]) for r in held]

    train, held = split(seed=1)
    assert len(held) == 5 and sorted(train + held) == list(range(20))  # disjoint, nothing lost
    assert split(seed=1) == (train, held) and split(seed=2)[1] != held
    first8, same_held = split(seed=1, train_size=8)  # the held-out rows do not depend on train_size
    assert same_held == held and first8 == train[:8] == sorted(first8)


def test_streaming_reads_only_the_rows_needed(tmp_path):
    source = tmp_path / "shards"
    source.mkdir()
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(6)]
    (source / "train-00000-of-00002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (source / "train-00001-of-00002.jsonl").write_text("{this shard is never read\n")
    (source / "test-00000-of-00001.jsonl").write_text(json.dumps(rows[0]) + "\n")
    task = {"prompt_column": "question", "answer_format": "gsm8k", "train_size": 4, "eval_size": 1}
    train, held_out, _ = load_task(_task(source, streaming=True, **task))
    assert [r["answer"] for r in train] == ["1", "2", "3", "4"] and _user(train[3]) == "What is 3 + 1?"
    assert [r["answer"] for r in held_out] == ["1"]
    with pytest.raises(ValueError, match="could not be read"):  # without streaming the whole source is converted
        load_task(_task(source, **task))


def test_streaming_equals_loading(tmp_path):
    source = _write(tmp_path / "gsm8k", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, "parquet")
    task = {"prompt_column": "question", "answer_format": "gsm8k", "train_size": 2, "eval_size": 1, "eval_split": "",
            "seed": 7}
    streamed = load_task(_task(source, streaming=True, **task))
    assert streamed == load_task(_task(source, **task))
    assert sorted(r["answer"] for r in streamed[0] + streamed[1]) == ["1000000", "1236", "5"]


def test_chat_messages_column_is_used_as_is(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages, "answer": 4}) + "\n")
    train, held, _ = load_task(_task(tmp_path / "chat.jsonl", prompt_column="messages", eval_split="", eval_size=0))
    assert train == [{"messages": messages, "prompt": messages, "answer": "4"}] and held == []


def test_eval_fraction_holds_out_a_share_of_the_train_split(tmp_path):
    rows = [{"q": f"question {i}", "a": str(i)} for i in range(20)]
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "all.parquet")

    def split(seed, **kw):
        train, held, _ = load_task(_task(tmp_path / "all.parquet", prompt_column="q", answer_column="a", seed=seed,
                                         eval_fraction=0.2, **kw))
        return [int(r["a"]) for r in train], [int(r["a"]) for r in held]

    train, held = split(seed=1)  # eval_split ('test', the default) is not read
    assert len(held) == 4 and sorted(train + held) == list(range(20))
    assert split(seed=1) == (train, held) and split(seed=2)[1] != held
    assert split(seed=1, train_size=5) == (train[:5], held)
    # the same rows as eval_split='' with eval_size 4 and the same seed: one way of choosing them
    carved, carved_held, _ = load_task(_task(tmp_path / "all.parquet", prompt_column="q", answer_column="a", seed=1,
                                             eval_split="", eval_size=4))
    assert (train, held) == ([int(r["a"]) for r in carved], [int(r["a"]) for r in carved_held])
    with pytest.raises(ValueError, match="task.eval_fraction=0.01 of the 20 rows of .* holds out 0 and leaves 20"):
        load_task(_task(tmp_path / "all.parquet", prompt_column="q", answer_column="a", eval_fraction=0.01))


def test_a_prompt_column_string_is_sent_as_it_is(tmp_path):
    """The column named prompt is read as TRL reads it (a string is the prompt text); other columns are questions."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "2 + 2 =", "answer": "4"}) + "\n")
    train, _, _ = load_task(_task(tmp_path / "p.jsonl", eval_split="", eval_size=0))
    assert train == [{"prompt": "2 + 2 =", "answer": "4"}]
    train, _, _ = load_task(_task(tmp_path / "p.jsonl", prompt_template="{prompt}", eval_split="", eval_size=0))
    assert train[0]["prompt"] == [{"role": "system", "content": HF_SYSTEM_PROMPT},
                                  {"role": "user", "content": "2 + 2 ="}]


def test_named_columns_that_do_not_exist(tmp_path):
    source = _write(tmp_path / "gsm8k", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, "parquet")
    cases = [
        ({"prompt_column": "query"}, "has no column 'query' (task.prompt_column); columns present: question, answer"),
        ({"prompt_template": "{question} Hint: {hint}"}, "has no column 'hint' (task.prompt_template)"),
        ({"prompt_column": "question", "answer_column": "final"}, "has no column 'final' (task.answer_column)"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError) as err:
            load_task(_task(source, **options))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_split_errors_name_the_splits(tmp_path):
    source = _write(tmp_path / "gsm8k", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, "parquet")
    with pytest.raises(ValueError) as err:
        load_task(_task(source, prompt_column="question", eval_split="validation"))
    assert str(err.value).startswith(f"task.eval_split='validation': {source} has no such split; splits present: ")
    assert "train" in str(err.value) and "test" in str(err.value) and "task.eval_split=''" in str(err.value)
    datasets.Dataset.from_list(GSM8K_TRAIN).to_parquet(tmp_path / "one.parquet")  # a single file is split 'train'
    with pytest.raises(ValueError, match="splits present: train. Set task.eval_split=''"):
        load_task(_task(tmp_path / "one.parquet", prompt_column="question"))
    with pytest.raises(ValueError, match="leaves none to train on"):
        load_task(_task(tmp_path / "one.parquet", prompt_column="question", eval_split="", eval_size=3))


def test_bad_rows_are_named(tmp_path):
    rows = [GSM8K_TRAIN[0], {"question": "No marker here?", "answer": "just 7"}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"prompt_column": "question", "eval_split": "", "eval_size": 0}
    with pytest.raises(ValueError) as err:
        load_task(_task(tmp_path / "bad.jsonl", answer_format="gsm8k", **task))
    assert str(err.value).startswith(f"{tmp_path / 'bad.jsonl'} split 'train' row 1: task.answer_format=gsm8k needs "
                                     "'#### <answer>' in column 'answer', which ends 'just 7'")
    with pytest.raises(ValueError, match=r"row 0: task.answer_format=math needs a \\boxed"):
        load_task(_task(tmp_path / "bad.jsonl", answer_format="math", **task))
    (tmp_path / "empty.jsonl").write_text(json.dumps({"question": " ", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="row 0: the prompt must be a non-empty string or chat messages"):
        load_task(_task(tmp_path / "empty.jsonl", **task))


def test_missing_paths_and_unreachable_hub(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_task(_task(tmp_path / "missing.parquet"))
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(ValueError, match="unknown file type '.txt'"):
        load_task(_task(tmp_path / "notes.txt"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(ConnectionError) as err:
        load_task(_task("openai/gsm8k", subset="main"))
    message = str(err.value)
    assert message.startswith("task.source 'openai/gsm8k' is not a local file or directory, so it was taken for a Hub "
                              "dataset id, but the Hugging Face Hub (http://127.0.0.1:9) is not reachable")
    assert "set task.source to that local path" in message


def test_config_validation():
    cases = [
        ([], "task.name=hf needs task.source"),
        (["task.source=d", "task.eval_split=train"], "task.eval_split and task.train_split are both 'train'"),
        (["task.source=d", "task.prompt_column=q", "task.prompt_template='{q}'"], "not both"),
        (["task.source=d", "task.answer_format=latex"], "task.answer_format must be one of raw, gsm8k, math"),
        (["task.source=d", "task.answer_column=", "task.answer_format=gsm8k"], "reads task.answer_column"),
        (["task.source=d", "task.streaming=true", "train.steps=10", "train.prompts_per_step=4"],
         "set task.train_size (this run draws train.steps x train.prompts_per_step = 40 prompts)"),
        (["task.source=d", "task.eval_fraction=0.1", "task.eval_split=validation"],
         ("task.eval_fraction=0.1 holds out rows of task.train_split, and task.eval_split='validation' names a "
          "held-out split too: set one of them")),
        (["task.source=d", "task.eval_fraction=0.1", "task.streaming=true", "task.train_size=10"],
         "task.eval_fraction needs the length of the split, which task.streaming=true does not know"),
        (["task.source=d", "task.eval_fraction=1"], "task.eval_fraction must be in [0, 1)"),
        (["task.source=d"], ("task.name=hf lists no rewards, and the default, arithmetic_correct, fits only "
                            "task.name=arithmetic: list the reward that scores your answers, e.g. rewards: "
                            "[{name: math_correct}]")),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError) as err:
            load_config(None, ["task.name=hf", *overrides])
        assert message in str(err.value)


def test_eval_fraction_config_reads_back(tmp_path):
    """With task.eval_fraction the default eval_split ('test') is not read: it becomes '', so the run's config.yaml
    (which writes every key) loads again."""
    from rlvr.config.loading import save_config

    cfg = load_config(None, ["task.name=hf", "task.source=d", "task.eval_fraction=0.1",
                             "rewards=[{name: math_correct}]"])
    assert cfg.task.eval_split == "" and cfg.task.eval_fraction == 0.1
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_long_prompts_follow_drop_long_prompts(tiny_model_dir, tmp_path):
    from rlvr.run.build import load_data

    rows = [GSM8K_TRAIN[0], {"question": "How many? " * 300, "answer": "#### 1"}, GSM8K_TRAIN[1]]
    _write(tmp_path / "long", {"train": rows, "test": GSM8K_TEST}, "parquet")
    base = [f"model.name={tiny_model_dir}", "task.name=hf", f"task.source={tmp_path / 'long'}",
            "task.prompt_column=question", "task.answer_format=gsm8k", "rewards=[{name: math_correct}]"]
    with pytest.raises(ValueError, match="^train row 1 has a .* set task.drop_long_prompts=true"):
        load_data(load_config(None, base))
    data = load_data(load_config(None, [*base, "task.drop_long_prompts=true"]))
    assert data.dropped_prompts == 1 and [r["answer"] for r in data.train_rows] == ["1236", "5"]


def test_cli_trains_one_step_on_gsm8k_jsonl(tiny_model_dir, tmp_path, capsys):
    """GSM8K-shaped JSONL, one file split by task.eval_fraction, through the column map: it trains, and its question
    strings go as chat messages (no warning about plain strings)."""
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_TRAIN + GSM8K_TEST))
    out = tmp_path / "run"
    overrides = [
        "task.name=jsonl", f"task.train_path={path}", "task.prompt_column=question", "task.answer_format=gsm8k",
        "task.eval_fraction=0.4", f"model.name={tiny_model_dir}", "model.lora_r=4", "model.lora_targets=[q_proj]",
        f"output_dir={out}", "rewards=[{name: 'tests.helpers:length_reward'}]", "rollout.group_size=2",
        "rollout.max_new_tokens=4", "train.prompts_per_step=2", "train.micro_batch_size=4", "train.steps=1",
        "eval.batch_size=2", "log.progress=false",
    ]
    (tmp_path / "empty.yaml").write_text("")  # everything comes from the overrides
    assert main(["train", str(tmp_path / "empty.yaml"), *overrides]) == 0, capsys.readouterr().err
    assert "rlvr: warning" not in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["eval_size"] == 2  # round(0.4 x 5) rows held out


def test_cli_trains_one_step_on_hf_data(tiny_model_dir, tmp_path):
    source = _write(tmp_path / "gsm8k", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, "parquet")
    out, cfg_path = tmp_path / "run", tmp_path / "gsm8k.yaml"
    cfg_path.write_text(f"task:\n  name: hf\n  source: {source}\n  prompt_column: question\n"
                        "  answer_format: gsm8k\n  eval_size: 2\n")
    overrides = [
        f"model.name={tiny_model_dir}", "model.lora_r=4", "model.lora_targets=[q_proj, v_proj]", f"output_dir={out}",
        "rewards=[{name: 'tests.helpers:length_reward'}]", "rollout.group_size=2", "rollout.max_new_tokens=4",
        "train.prompts_per_step=2", "train.micro_batch_size=4", "train.steps=1", "eval.batch_size=2",
        "log.progress=false",
    ]
    assert main(["train", str(cfg_path), *overrides]) == 0  # held-out accuracy through math_correct
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records][-1] == 1 and records[-1]["rollout/completion_len_max"] <= 4
    assert load_config(out / "config.yaml").task.source == str(source)
