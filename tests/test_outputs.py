"""Outputs that explain themselves: samples.jsonl carries prompts, answer columns and every reward function's
value; the saved adapter names its base model as the user gave it and has a model card; config.yaml marks the
task fields its task does not use and still reloads exactly; the plot's legend covers no data."""

import dataclasses
import datetime
import json
import re
from types import SimpleNamespace

import pytest
import torch
import yaml

from rlvr.config.loading import load_config, to_yaml
from rlvr.config.schema import TASKS, TaskConfig
from rlvr.launch import train
from rlvr.models.offline import original_name
from rlvr.rewards import Scores
from rlvr.run.collect import Collected, Round
from rlvr.run.files import (
    COLUMN_CHARS,
    TASK_COMMON_FIELDS,
    TASK_FIELDS,
    config_yaml,
    model_card,
    sample_records,
    unused_task_fields,
)
from rlvr.store.metrics import read_metrics
from rlvr.tasks import load_task
from tests.test_e2e import _overrides

G = 4
CHECKS = {"arithmetic": "arithmetic_correct", "code_jsonl": "code_tests"}  # rewards a task may be run with


def even_length_reward(prompts, completions, **columns):
    """1.0 for an even-length completion, None (unscored) for an odd one."""
    return [None if len(c[0]["content"]) % 2 else 1.0 for c in completions]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """A 2-step LoRA run on the tiny model (arithmetic task: chat prompts, an answer column), two reward functions."""
    out = tmp_path_factory.mktemp("outputs") / "run"
    rewards = ("rewards=[{name: 'tests.helpers:length_reward', weight: 0.5}, "
               "{name: 'tests.test_outputs:even_length_reward', weight: 2.0}]")
    cfg = load_config(None, [*_overrides(tiny_model_dir, out), rewards, "train.steps=2", "eval.every=0"])
    summary = train(cfg)
    return SimpleNamespace(cfg=cfg, out=out, summary=summary, model_dir=tiny_model_dir)


def test_samples_carry_prompt_columns_and_every_reward(run):
    train_rows = load_task(run.cfg.task)[0]
    lines = [json.loads(line) for line in (run.out / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * G  # steps × prompts × G
    for i, line in enumerate(lines):
        text = line["text"]
        length, even = float(len(text)), None if len(text) % 2 else 1.0
        assert line["rewards"] == {"tests.helpers:length_reward": length, "tests.test_outputs:even_length_reward": even}
        assert line["reward"] == pytest.approx(0.5 * length + (2.0 if even else 0.0))
        row = train_rows[line["row"]]
        if i % G == 0:  # the group's first completion carries its prompt and the row's other columns, once
            assert line["prompt"] == row["prompt"] and isinstance(line["prompt"], list)  # chat messages
            assert line["prompt"][-1]["role"] == "user"
            assert line["columns"] == {"answer": row["answer"]}
        else:
            assert "prompt" not in line and "columns" not in line
            assert line["row"] == lines[i - i % G]["row"]


def test_sample_records_string_prompts_and_bounded_columns():
    rows = [{"prompt": "Q: 2+2?", "answer": "4", "notes": "x" * 5000, "tests": list(range(150)),
             "score": float("nan"), "array": torch.tensor([1, 2])}]
    texts = ["4", "five", "", "44"]
    groups = SimpleNamespace(texts=texts, group_size=G)
    per_function = {"a": torch.tensor([1.0, float("nan"), 0.0, 1.0]), "b": torch.tensor([0.5, 0.5, float("nan"), 0.0])}
    scores = Scores(torch.tensor([1.5, 0.5, 0.0, 1.0]), per_function, {})
    c = Collected(rounds=[Round([0], groups, scores, uids=[7])], row_ids=[0], groups=groups,
                  scores=scores, adv=None, time_generate_s=0.0, time_reward_s=0.0)
    records = sample_records(c, rows, with_token_ids=False)
    assert [r["text"] for r in records] == texts and all(r["row"] == 0 and r["uid"] == 7 for r in records)
    assert [r["rewards"] for r in records] == [{"a": 1.0, "b": 0.5}, {"a": None, "b": 0.5}, {"a": 0.0, "b": None},
                                               {"a": 1.0, "b": 0.0}]
    first = records[0]
    assert first["prompt"] == "Q: 2+2?"  # a string prompt as it is
    columns = first["columns"]
    assert columns["answer"] == "4" and columns["score"] is None and columns["array"] == [1, 2]
    assert columns["notes"].startswith("x" * COLUMN_CHARS) and columns["notes"].endswith("[3000 more characters]")
    assert columns["tests"][:100] == list(range(100)) and columns["tests"][100] == "... 50 more items"
    json.dumps(records, allow_nan=False)  # strict JSON
    assert all("prompt" not in r for r in records[1:])


def test_adapter_names_the_local_base_and_carries_a_model_card(run):
    adapter = run.out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(run.model_dir)  # the directory as the user gave it
    card = (adapter / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert "base_model" not in front and front["library_name"] == "peft"  # a local path is no Hub id
    before, after = run.summary["eval_accuracy_before"], run.summary["eval_accuracy_after"]
    for part in (f"`{run.model_dir}`", "GRPO with rlvr, preset `grpo`", "LoRA r=4", "`arithmetic`: digits=1",
                 "`tests.helpers:length_reward` × 0.5", "`tests.test_outputs:even_length_reward` × 2",
                 "| steps | 2 × 2 prompts × 4 completions each |",
                 f"{100 * before:.1f} % before → {100 * after:.1f} % after (greedy, 6 held-out prompts)",
                 f"rlvr train {run.out / 'config.yaml'}", f'PeftModel.from_pretrained(base, "{adapter}")'):
        assert part in card, part
    date = re.search(r"\| date \| (\d{4}-\d\d-\d\d) \|", card).group(1)
    assert abs((datetime.date.fromisoformat(date) - datetime.datetime.now(datetime.timezone.utc).date()).days) <= 1
    assert "Model Card for Model ID" not in card  # peft's blank template is replaced


def test_an_alias_is_saved_under_its_hub_id(tiny_model_dir, tmp_path):
    from rlvr.models.policy import LoraSpec, load_policy, save_policy

    assert original_name("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert original_name("gemma3-270m") == "google/gemma-3-270m"
    assert original_name("some/local/dir") == "some/local/dir"
    model, tokenizer = load_policy(str(tiny_model_dir), LoraSpec(r=2, target_modules=("q_proj",)))
    cfg = load_config(None, ["model.name=smollm2-135m-instruct", f"output_dir={tmp_path / 'run'}"])
    card = model_card(cfg, {"eval_accuracy_before": 0.29, "eval_accuracy": 0.91}, tmp_path / "run", 100,
                      date=datetime.date(2025, 1, 2))
    save_policy(model, tokenizer, tmp_path / "adapter", base_model=original_name(cfg.model.name), card=card)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert model.peft_config["default"].base_model_name_or_path == str(tiny_model_dir)  # the model is left as it was
    saved = (tmp_path / "adapter" / "README.md").read_text()
    assert saved == card and yaml.safe_load(card.split("---")[1])["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "rlvr's offline alias `smollm2-135m-instruct`" in card and "29.0 % before → 91.0 % after" in card
    assert "| date | 2025-01-02 |" in card


def test_config_yaml_marks_the_fields_its_task_does_not_use(run):
    text = (run.out / "config.yaml").read_text()
    assert load_config(run.out / "config.yaml", ["import_dirs=[]"]) == run.cfg
    task = text[text.index("\ntask:\n"):text.index("\nrewards:")]
    assert "  # unused by task arithmetic (settings of other tasks):" in task
    used, unused = task.split("# unused by task arithmetic")
    assert "  digits: 1" in used and "train_path" in unused and "few_shot" in unused and "digits" not in unused


@pytest.mark.parametrize("name", TASKS)
def test_config_yaml_round_trips_for_every_task(name, tmp_path):
    tricky = 'Say "hi": then\nanswer #1 — in full, with a very long instruction that YAML would fold across lines.'
    cfg = load_config(None, [f"task.name={name}", "task.train_path=train.jsonl", "task.eval_path=eval.jsonl",
                             "task.source=data.parquet", f"task.system_prompt={json.dumps(tricky)}",
                             f"output_dir={tmp_path}", f"rewards=[{{name: {CHECKS.get(name, 'math_correct')}}}]"])
    assert cfg.task.system_prompt == tricky
    text = config_yaml(cfg)
    assert yaml.safe_load(text) == yaml.safe_load(to_yaml(cfg))
    (tmp_path / "config.yaml").write_text(text)
    assert load_config(tmp_path / "config.yaml") == cfg
    unused = unused_task_fields(cfg.task)
    if name.endswith("jsonl"):
        assert {"digits", "source", "few_shot"} <= set(unused) and "train_path" not in unused
    marker = f"  # unused by task {name} (settings of other tasks):\n"
    assert text.count(marker) == 1
    after = text.split(marker)[1].split("\nrewards:")[0]
    assert [line.split(":")[0].strip() for line in after.splitlines() if re.match(r"  \w", line)] == unused


def test_config_yaml_says_when_a_task_does_not_send_the_system_prompt(tmp_path):
    math = "rewards=[{name: math_correct}]"
    text = config_yaml(load_config(None, ["task.name=word_problems", math]))
    assert "  # task word_problems does not send this arithmetic default: it uses its own (or none)\n" in text
    own = load_config(None, ["task.name=word_problems", "task.system_prompt=x", math])
    assert "does not send" not in config_yaml(own) and "arithmetic default" not in config_yaml(load_config(None, []))


def test_every_task_field_is_classified():
    """A new TaskConfig field must be entered in TASK_COMMON_FIELDS or TASK_FIELDS (rlvr/run/files.py), so that
    config.yaml marks it correctly."""
    fields = {f.name for f in dataclasses.fields(TaskConfig)}
    listed = set(TASK_COMMON_FIELDS) | {f for names in TASK_FIELDS.values() for f in names}
    assert fields - listed == set(), f"not in rlvr/run/files.py TASK_FIELDS: {fields - listed}"
    assert listed - fields == set(), f"not TaskConfig fields: {listed - fields}"
    assert set(TASK_FIELDS) == set(TASKS)


def test_plot_legend_covers_no_data(tmp_path, run):
    """A short run whose last points sit at the bottom right, where the legend used to be."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from rlvr.store.metrics import plot_run

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "rollout/reward_mean": 0.4},
            {"step": 2, "rollout/reward_mean": 0.0, "eval/accuracy": 0.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot_run(metrics, tmp_path / "plot.png", title="tiny · grpo · arithmetic")
    renderer = FigureCanvasAgg(fig).get_renderer()
    (ax,) = fig.axes
    legends = fig.legends + [ax.get_legend()] * (ax.get_legend() is not None)
    assert len(legends) == 1
    assert not legends[0].get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    assert [t.get_text() for t in legends[0].get_texts()] == ["train reward (mean)", "held-out accuracy (greedy)"]
    assert (run.out / "plot.png").stat().st_size > 1000 and read_metrics(run.out / "metrics.jsonl")
