"""A TRL user's code runs with only the import changed: reward functions get TRL 1.16's keyword arguments
(trainer_state, log_metric, log_extra, completion_ids), harmless TrainingArguments fields are accepted (with a note
where they change nothing), and the trainer has model, processing_class, state.log_history and evaluate(), and prints
the accuracy before and after as `rlvr train` does."""

import json

from rlvr import GRPOConfig, GRPOTrainer
from rlvr.rewards.base import CONTEXT, WeightedReward, score_completions
from tests.test_api import CHAT_ROWS, exact_answer

SEEN: list[tuple[int, int, float]] = []


def trl_reward(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    """As TRL 1.16 calls it: reads the trainer state, logs a metric and an extra column."""
    SEEN.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.epoch))
    log_metric("completions", len(completions))
    log_extra("ids", [len(ids) for ids in completion_ids])
    return [0.0] * len(completions)


def test_trl_arguments_go_to_functions_that_take_them():
    got = {}

    def by_name(prompts, completions, answer, completion_ids, trainer_state):
        got["state"] = trainer_state
        return [1.0] * len(completions)

    def plain(prompts, completions, answer, completion_ids):  # takes none of them: given none
        return [0.5] * len(completions)

    CONTEXT.state.global_step = 7
    scores = score_completions([WeightedReward("a", by_name), WeightedReward("b", plain)], ["p", "q"], ["x", "y"],
                               {"answer": ["1", "2"], "completion_ids": [[1], [2]]})
    assert got["state"] is CONTEXT.state and got["state"].global_step == 7
    assert scores.total.tolist() == [1.5, 1.5]


def test_a_trl_run_from_the_python_api(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "trl"
    args = GRPOConfig(output_dir=str(out), learning_rate=1e-3, num_generations=2, max_completion_length=4,
                      per_device_train_batch_size=4, max_steps=2, disable_tqdm=True, log_level="info",
                      logging_first_step=True, overwrite_output_dir=True, dataloader_num_workers=2,
                      save_only_model=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    SEEN.clear()
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[exact_answer, trl_reward], args=args,
                          train_dataset=CHAT_ROWS[:4], eval_dataset=CHAT_ROWS[4:])
    notes = [line for line in capsys.readouterr().out.splitlines() if "has no effect here" in line]
    assert notes == [f"rlvr: GRPOConfig.{field} has no effect here: {why}" for field, why in (
        ("log_level='info'", "rlvr prints its own progress and leaves the library loggers' levels alone"),
        ("overwrite_output_dir=True", "rlvr never overwrites a run: an earlier one is moved aside (.prev-N)"),
        ("dataloader_num_workers=2", "rlvr draws prompts from rows in memory, without a DataLoader"),
        ("save_only_model=True", "checkpoints still hold the optimizer and scheduler state, which resume needs"))]
    assert trainer.state.max_steps == 2 and trainer.state.global_step == 0
    assert trainer.processing_class.chat_template == trainer.processing_class.chat_template  # loads
    assert trainer.processing_class.padding_side == "left"

    result = trainer.train()
    # each step's rewards saw the optimizer steps taken before it, of 2; 2 prompts a step of 4 rows: epochs 0, 0.5;
    # the evaluations before the first step and after the last score the held-out replies with them too (as TRL's
    # evaluation does): 0 steps and 2, epochs 0 and 1
    assert [s for s in SEEN if s[1] == 2] == [(0, 2, 0.0), (0, 2, 0.0), (1, 2, 0.5), (2, 2, 1.0)]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("reward_log/completions") for r in records] == [None, 4.0, 4.0]  # 2 prompts x G=2, each step
    assert trainer.state.global_step == 2 and trainer.state.epoch == 1.0
    assert [r["step"] for r in trainer.state.log_history] == [0, 1, 2]
    before, after = result.metrics["eval_accuracy_before"], result.metrics["eval_accuracy_after"]
    printed = capsys.readouterr().out
    assert f"held-out accuracy: {before:.1%} -> {after:.1%} (" in printed and f"run directory: {out}" in printed

    assert trainer.model.name_or_path == str(out / "model")  # full fine-tuning: the trained weights
    assert trainer.evaluate() == {"eval_accuracy": after, "eval_size": 2}


def test_under_lora_the_trained_model_is_the_adapter_over_the_base(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    args = GRPOConfig(output_dir=str(tmp_path / "lora"), learning_rate=1e-2, num_generations=2,
                      max_completion_length=4, per_device_train_batch_size=4, max_steps=1, disable_tqdm=True)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=exact_answer, args=args,
                          train_dataset=CHAT_ROWS[:4], eval_dataset=CHAT_ROWS[4:],
                          peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    assert type(trainer.model).__name__ == "LlamaForCausalLM"  # before training: the starting weights
    result = trainer.train()
    assert type(trainer.model).__name__ == "PeftModelForCausalLM"  # after: the saved adapter over them
    assert trainer.evaluate() == {"eval_accuracy": result.metrics["eval_accuracy_after"], "eval_size": 2}
