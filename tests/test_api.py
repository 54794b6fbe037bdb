"""The TRL-shaped Python API (rlvr/api.py): a TRL quickstart-style script runs with only its import changed and
writes a config.yaml the CLI reruns; TRL fields map onto rlvr's config keys; what rlvr cannot honour is an error
naming it."""

import functools
import json
import runpy
import warnings
from pathlib import Path

import pytest

from rlvr import GRPOConfig, GRPOTrainer
from rlvr.cli import main
from rlvr.config.loading import load_config

# A TRL quickstart in our own words: only the import line names rlvr (with `from trl import ...` it is a TRL script).
QUICKSTART = '''
from datasets import Dataset

from rlvr import GRPOConfig, GRPOTrainer

dataset = Dataset.from_dict({"prompt": [
    "What is 3 + 4?", "Name a colour.", "Say hello.", "What is 12 * 9?",
    "Count to three.", "Reply with only the number 7.", "What is 2 + 2?", "Write one word.",
]})


def reward_len(completions, **kwargs):
    """Completions of about 20 characters score best."""
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir=OUTPUT_DIR,
    learning_rate=1e-5,
    num_generations=4,
    max_completion_length=8,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=2,
    logging_steps=1,
    seed=0,
    report_to="none",
)
trainer = GRPOTrainer(model=MODEL_DIR, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train()
'''


def test_trl_quickstart_runs_with_only_the_import_changed(tiny_model_dir, tmp_path):
    out = tmp_path / "quickstart"
    assert [line for line in QUICKSTART.splitlines() if "rlvr" in line] == ["from rlvr import GRPOConfig, GRPOTrainer"]
    script = tmp_path / "train_grpo.py"
    script.write_text(QUICKSTART.replace("OUTPUT_DIR", repr(str(out))).replace("MODEL_DIR", repr(str(tiny_model_dir))))
    # reward_len lives in the script (__main__): it trains, and a warning says the CLI cannot import it
    with pytest.warns(UserWarning, match=r"__main__:reward_len \(it is defined in the script"):
        runpy.run_path(str(script), run_name="__main__")

    for name in ("config.yaml", "metrics.jsonl", "summary.json", "model/config.json"):
        assert (out / name).is_file(), name
    assert not (out / "adapter").exists()  # peft_config=None: full fine-tuning, as in TRL
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]

    cfg = load_config(out / "config.yaml")
    assert cfg.model.name == str(tiny_model_dir) and cfg.model.lora is False and cfg.model.autocast == "none"
    assert cfg.train.lr == 1e-5 and cfg.train.steps == 2 and cfg.train.seed == 0
    assert cfg.rollout.group_size == 4 and cfg.rollout.max_new_tokens == 8
    assert cfg.train.prompts_per_step == 2 and cfg.train.micro_batch_size == 4  # 4 x 2 completions / G=4
    assert cfg.algo.aggregation == "token_mean" and cfg.algo.scale == "group"  # TRL's defaults: dapo, group
    assert cfg.algo.beta == 0.0 and cfg.algo.eps_low == cfg.algo.eps_high == 0.2 and not cfg.algo.dynamic_sampling
    assert cfg.log.trackers == () and cfg.log.samples is False
    assert [r.name for r in cfg.rewards] == ["__main__:reward_len"] and cfg.task.eval_reward == "__main__:reward_len"
    assert cfg.task.name == "jsonl" and cfg.task.eval_path == cfg.task.train_path and cfg.task.eval_size == 8
    data = _jsonl(cfg.task.train_path)
    assert len(data) == 8 and data[0] == {"prompt": "What is 3 + 4?"}
    assert cfg.task.train_path.startswith(f"{out}.data/train-")  # beside the run directory, named by content


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# --------------------------------------------------------------------------- rewards the tests import by name

CALLS: list[dict] = []


def exact_answer(prompts, completions, answer, **kwargs):
    """1.0 when the completion contains the answer column's text (chat completions: TRL's message lists)."""
    CALLS.append({"prompts": prompts, "answer": answer})
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def length_bonus(completions, scale=1.0, **kwargs):
    return [scale * len(c[0]["content"]) / 100 for c in completions]


CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "Reply with only the number."},
                {"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}
    for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (0, 7)]
]


def test_chat_rows_lora_and_a_test_module_reward_rerun_from_the_cli(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    from rlvr.cli import main

    out = tmp_path / "chat"
    args = GRPOConfig(output_dir=str(out), learning_rate=1e-3, num_generations=2, max_completion_length=6,
                      per_device_train_batch_size=4, max_steps=1, log_completions=True, disable_tqdm=True,
                      reward_weights=[1.0, 0.5])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    CALLS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both rewards import by name: no warning
        trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[exact_answer, length_bonus], args=args,
                              train_dataset=CHAT_ROWS[:4], eval_dataset=CHAT_ROWS[4:], peft_config=lora)
    result = trainer.train()

    assert result.global_step == 1 and result.metrics["steps"] == 1 and result.metrics["eval_size"] == 2
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "samples.jsonl").is_file()
    assert ["9", "7"] in [call["answer"] for call in CALLS]  # the held-out check: one greedy completion per row
    trained = [call["answer"] for call in CALLS if len(call["answer"]) == 4]  # 2 prompts x G=2, the column repeated
    assert trained and all(a[0] == a[1] and a[2] == a[3] and set(a) <= {"3", "7", "6", "4"} for a in trained)
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for call in CALLS for p in call["prompts"])
    cfg = load_config(out / "config.yaml")
    assert [(r.name, r.weight) for r in cfg.rewards] == [("tests.test_api:exact_answer", 1.0),
                                                         ("tests.test_api:length_bonus", 0.5)]
    assert cfg.task.eval_reward == "tests.test_api:exact_answer" and cfg.task.eval_size == 2
    assert cfg.model.lora and cfg.model.lora_r == 4 and cfg.model.lora_alpha == 8.0
    assert cfg.model.lora_targets == ("q_proj", "v_proj") and cfg.log.samples and not cfg.log.progress

    saved = trainer.save_model(str(tmp_path / "saved"))
    assert (saved / "adapter_config.json").is_file()

    # the written config.yaml is the run: the CLI trains it again, importing the rewards by name
    again = tmp_path / "again"
    assert main(["train", str(out / "config.yaml"), f"output_dir={again}"]) == 0
    metrics = [json.loads(line) for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert "rollout/reward/tests.test_api:exact_answer_mean" in metrics[1]


def test_reward_names_recorded(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "r"), num_generations=2, per_device_train_batch_size=2, max_steps=1)
    with pytest.warns(UserWarning, match=r"<lambda> \(it is a lambda"):
        trainer = GRPOTrainer(str(tiny_model_dir), [lambda completions, **kw: [0.0] * len(completions),
                                                    functools.partial(length_bonus, scale=2.0), "format"],
                              args=args, train_dataset=CHAT_ROWS)
    cfg = trainer.rlvr_config
    assert cfg.rewards[0].name == "tests.test_api:test_reward_names_recorded.<locals>.<lambda>"
    assert (cfg.rewards[1].name, cfg.rewards[1].kwargs) == ("tests.test_api:length_bonus", {"scale": 2.0})
    assert cfg.rewards[2].name == "format"
    assert cfg.task.eval_reward == "format"  # the first reward rlvr can build again by name, without kwargs

    in_main = lambda completions, **kw: [0.0] * len(completions)  # a lambda of a running script
    in_main.__module__ = "__main__"
    with pytest.raises(ValueError, match="none of .* can be"):
        GRPOTrainer(str(tiny_model_dir), in_main, args=args, train_dataset=CHAT_ROWS)
    with pytest.raises(ValueError, match="'tests.test_api:exact_answer' twice"):
        GRPOTrainer(str(tiny_model_dir), [exact_answer, exact_answer], args=args, train_dataset=CHAT_ROWS)
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2"):
        GRPOTrainer(str(tiny_model_dir), [exact_answer, length_bonus], train_dataset=CHAT_ROWS,
                    args=GRPOConfig(output_dir=str(tmp_path / "w"), reward_weights=[1.0]))
    import torch

    with pytest.raises(ValueError, match="reward_funcs\\[0\\] is a model"):
        GRPOTrainer(str(tiny_model_dir), torch.nn.Linear(2, 2), args=args, train_dataset=CHAT_ROWS)


# --------------------------------------------------------------------------- field mapping, no training


def _cfg(model_dir, tmp_path, rows=CHAT_ROWS, eval_rows=None, peft_config=None, **fields):
    args = GRPOConfig(output_dir=str(tmp_path / "m"), **fields)
    trainer = GRPOTrainer(str(model_dir), exact_answer, args=args, train_dataset=rows, eval_dataset=eval_rows,
                          peft_config=peft_config)
    return trainer.rlvr_config


def test_field_mapping(tiny_model_dir, tmp_path):
    c = _cfg(tiny_model_dir, tmp_path)  # TRL's defaults: 8 completions a step, G=8, 3 epochs, lr 1e-6, seed 42
    assert (c.rollout.group_size, c.train.prompts_per_step, c.train.micro_batch_size) == (8, 1, 8)
    assert (c.train.steps, c.train.lr, c.train.seed, c.rollout.max_new_tokens) == (18, 1e-6, 42, 512)
    assert (c.train.checkpoint_every, c.train.keep_last, c.eval.every) == (500, 1, 0)
    assert (c.algo.aggregation, c.algo.beta, c.algo.num_iterations) == ("token_mean", 0.0, 1)

    c = _cfg(tiny_model_dir, tmp_path, num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
             num_train_epochs=2, loss_type="grpo", scale_rewards=False, epsilon=0.1, epsilon_high=0.3, delta=2.0,
             beta=0.04, temperature=0.7, top_p=0.9, top_k=None, mask_truncated_completions=True, bf16=True,
             gradient_checkpointing=True, warmup_ratio=0.5, weight_decay=0.1, max_grad_norm=0.5, save_steps=2,
             report_to=["tensorboard"], run_name="mine", per_device_eval_batch_size=3)
    assert c.train.prompts_per_step == 2 and c.train.steps == 6  # ceil(2 epochs x 6 rows / 2 prompts)
    assert (c.algo.aggregation, c.algo.scale, c.algo.eps_low, c.algo.eps_high) == ("sequence_mean", "none", 0.1, 0.3)
    assert (c.algo.dual_clip, c.algo.beta, c.algo.mask_truncated) == (2.0, 0.04, True)
    assert (c.rollout.temperature, c.rollout.top_p, c.rollout.top_k) == (0.7, 0.9, 0)
    assert c.model.autocast == "bf16" and c.model.gradient_checkpointing and c.model.lora is False
    assert (c.train.warmup_steps, c.train.weight_decay, c.train.max_grad_norm) == (3, 0.1, 0.5)
    assert (c.train.checkpoint_every, c.train.keep_last) == (2, 4)  # save_total_limit=None keeps them all
    assert c.log.trackers == ("tensorboard",) and c.log.run_name == "mine" and c.eval.batch_size == 3

    # num_iterations: TRL counts optimizer steps, mu per batch; rlvr counts batches
    c = _cfg(tiny_model_dir, tmp_path, rows=CHAT_ROWS[:4], eval_rows=CHAT_ROWS[4:], num_generations=2,
             per_device_train_batch_size=2, num_iterations=2, max_steps=6, save_steps=3, save_total_limit=2,
             eval_strategy="steps", eval_steps=4, loss_type="dr_grpo", scale_rewards="batch", warmup_steps=2)
    assert (c.train.steps, c.algo.num_iterations, c.train.checkpoint_every, c.train.keep_last) == (3, 2, 2, 2)
    assert (c.eval.every, c.task.eval_size, c.train.warmup_steps) == (2, 2, 2)
    assert (c.algo.aggregation, c.algo.scale) == ("token_sum_constant", "batch")
    assert c.task.eval_path != c.task.train_path and "/m.data/eval-" in c.task.eval_path

    c = _cfg(tiny_model_dir, tmp_path, save_strategy="no", eval_strategy="epoch", eval_rows=CHAT_ROWS[:2],
             remove_unused_columns=True, num_generations=2, per_device_train_batch_size=4)
    assert (c.train.checkpoint_every, c.eval.every) == (0, 3)  # an epoch: 6 rows / 2 prompts a step
    assert _jsonl(c.task.train_path)[0] == {"prompt": CHAT_ROWS[0]["prompt"]}


def test_lora_config_mapping(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    m = _cfg(tiny_model_dir, tmp_path, peft_config=LoraConfig(r=4, lora_alpha=16, lora_dropout=0.05,
                                                              target_modules=["v_proj", "q_proj"])).model
    assert (m.lora, m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_targets) == (True, 4, 16.0, 0.05,
                                                                               ("q_proj", "v_proj"))
    m = _cfg(tiny_model_dir, tmp_path, peft_config=LoraConfig(target_modules="all-linear")).model
    assert (m.lora_r, m.lora_alpha, m.lora_targets) == (8, 8.0, ("all-linear",))  # peft's defaults r=8, alpha=8
    m = _cfg(tiny_model_dir, tmp_path, peft_config=LoraConfig()).model
    assert m.lora_targets == ("q_proj", "v_proj")  # None: peft's default modules for llama
    assert _cfg(tiny_model_dir, tmp_path).model.lora is False  # None: full fine-tuning, as in TRL
    with pytest.raises(ValueError, match="use_dora=True"):
        _cfg(tiny_model_dir, tmp_path, peft_config=LoraConfig(use_dora=True))
    with pytest.raises(ValueError, match="regular expression"):
        _cfg(tiny_model_dir, tmp_path, peft_config=LoraConfig(target_modules=r".*proj"))


def test_models_and_tokenizers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = GRPOConfig(output_dir=str(tmp_path / "t"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(model, exact_answer, args=args, train_dataset=CHAT_ROWS, processing_class=tokenizer)
    assert trainer.rlvr_config.model.name == str(tiny_model_dir)
    tokenizer.chat_template = "{{ messages }}"
    with pytest.raises(ValueError, match="processing_class differs .* chat_template"):
        GRPOTrainer(model, exact_answer, args=args, train_dataset=CHAT_ROWS, processing_class=tokenizer)
    with pytest.raises(FileNotFoundError, match="rlvr never downloads"):
        GRPOTrainer("Qwen/Qwen2-0.5B-Instruct", exact_answer, args=args, train_dataset=CHAT_ROWS)
    with pytest.raises(ValueError, match="model must be a built-in alias or a local directory"):
        GRPOTrainer(torch_module(), exact_answer, args=args, train_dataset=CHAT_ROWS)


def torch_module():
    import torch

    return torch.nn.Linear(2, 2)


def test_datasets_checked(tiny_model_dir, tmp_path):
    from datasets import Dataset, DatasetDict

    args = GRPOConfig(output_dir=str(tmp_path / "d"))
    ds = Dataset.from_list(CHAT_ROWS)
    with pytest.raises(TypeError, match=r"pass one split, e.g. dataset\['train'\]"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=DatasetDict({"train": ds}))
    with pytest.raises(ValueError, match="train_dataset row 1 has no 'prompt' column"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=[CHAT_ROWS[0], {"question": "x"}])
    with pytest.raises(ValueError, match="eval_dataset row 0: the prompt must be"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=ds, eval_dataset=[{"prompt": ""}])
    with pytest.raises(ValueError, match="row 0, column 'answer': a object cannot be written to JSON"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=[{"prompt": "x", "answer": object()}])
    with pytest.raises(ValueError, match="eval_strategy='steps' needs an eval_dataset"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, train_dataset=ds,
                    args=GRPOConfig(output_dir=str(tmp_path / "d"), eval_strategy="steps"))
    with pytest.raises(ValueError, match=r"max_prompt_length=4: train_dataset row 0 has a \d+-token prompt"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, train_dataset=ds,
                    args=GRPOConfig(output_dir=str(tmp_path / "d"), max_prompt_length=4))
    GRPOTrainer(str(tiny_model_dir), exact_answer, train_dataset=ds,  # every prompt fits: nothing TRL would cut
                args=GRPOConfig(output_dir=str(tmp_path / "d"), max_prompt_length=200))


# --------------------------------------------------------------------------- what is refused

TRL_FIELDS_NOT_SUPPORTED = [
    "vllm_mode", "vllm_server_base_url", "model_init_kwargs", "min_p", "repetition_penalty", "generation_kwargs",
    "num_generations_eval", "cast_lm_head_to_fp32", "log_unique_prompts", "deepspeed", "fsdp", "lr_scheduler_kwargs",
    "torch_compile",
]


@pytest.mark.parametrize("name", TRL_FIELDS_NOT_SUPPORTED)
def test_unsupported_trl_field_is_an_error_naming_it(name):
    with pytest.raises(TypeError, match=rf"rlvr does not support the field '{name}'"):
        GRPOConfig(**{name: 1})
    args = GRPOConfig()
    with pytest.raises(AttributeError, match=rf"rlvr does not support the field '{name}'"):
        setattr(args, name, 1)  # set after construction: refused too, never silently kept


REFUSED_VALUES = {
    "loss_type": "vespo", "scale_rewards": "mean", "fp16": True, "use_vllm": True, "lr_scheduler_type": "cosine",
    "optim": "adamw_8bit", "adam_beta2": 0.99, "num_completions_to_print": 2, "save_strategy": "best",
    "eval_strategy": "best", "report_to": "mlflow", "shuffle_dataset": False, "push_to_hub": True, "max_steps": 0,
    "num_generations": 1, "delta": 0.5, "top_p": 0.0, "off_policy_mask_threshold": 0.5, "use_adaptive_entropy": True,
    "steps_per_generation": 4, "generation_batch_size": 3, "use_bias_correction_kl": "yes",
}


def test_trl_loss_fields_are_accepted_at_rlvr_s_own_behaviour():
    """A TRL field is refused only where its value asks for what rlvr does not do: at TRL's defaults (or a value
    meaning rlvr's behaviour) each is accepted, and use_bias_correction_kl maps to algo.kl_ratio_weighted."""
    GRPOConfig(off_policy_mask_threshold=None, use_adaptive_entropy=False, vespo_k_pos=2.0, entropy_target=0.2,
               steps_per_generation=2, gradient_accumulation_steps=2, generation_batch_size=16,
               per_device_train_batch_size=8)
    assert GRPOConfig().use_bias_correction_kl is True  # TRL 1.16's default


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_refused_value_is_an_error_naming_the_field(name):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{name}="):
        GRPOConfig(**{name: REFUSED_VALUES[name]})


def test_objective_fields_mapping(tiny_model_dir, tmp_path):
    """TRL's loss_type and importance_sampling_level become algo.objective and algo.aggregation; CISPO's absolute cap
    becomes an offset from 1 with no lower bound; SAPO's temperatures and the entropy terms pass through."""
    def algo(**fields):
        return _cfg(tiny_model_dir, tmp_path, **fields).algo

    a = algo(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4)
    assert (a.objective, a.aggregation, a.eps_low, a.eps_high) == ("gspo", "sequence_mean", 3e-4, 4e-4)
    a = algo(loss_type="luspo", importance_sampling_level="sequence")
    assert (a.objective, a.aggregation) == ("gspo", "sequence_sum")
    a = algo(loss_type="cispo", epsilon_high=5.0)
    assert (a.objective, a.aggregation, a.eps_low, a.eps_high) == ("cispo", "token_mean", 1.0, 4.0)
    a = algo(loss_type="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, entropy_coef=0.01,
             top_entropy_quantile=0.2)
    assert (a.objective, a.aggregation, a.sapo_tau_pos, a.sapo_tau_neg) == ("sapo", "sequence_mean", 0.9, 1.2)
    assert (a.entropy_coef, a.top_entropy_quantile) == (0.01, 0.2)
    a = algo(multi_objective_aggregation="normalize_then_sum", sync_ref_model=True, beta=0.04,
             ref_model_sync_steps=4, ref_model_mixup_alpha=1.0)
    assert (a.reward_aggregation, a.ref_sync_steps, a.ref_mixup_alpha) == ("normalize_then_sum", 4, 1.0)
    assert algo(beta=0.04).ref_sync_steps == 0  # sync_ref_model=False: the reference stays the starting model
    assert algo(beta=0.04).kl_ratio_weighted is True  # TRL's use_bias_correction_kl default
    assert algo(beta=0.04, use_bias_correction_kl=False).kl_ratio_weighted is False
    with pytest.raises(ValueError, match="sync_ref_model=True: refreshes the KL reference, which beta=0 does not"):
        GRPOConfig(sync_ref_model=True)
    with pytest.raises(ValueError, match="epsilon_high=None: loss_type='cispo' reads it as the absolute cap"):
        GRPOConfig(loss_type="cispo")
    with pytest.raises(ValueError, match="importance_sampling_level='sequence': rlvr's sapo is token-level"):
        GRPOConfig(loss_type="sapo", importance_sampling_level="sequence")


def test_other_refusals():
    with pytest.raises(ValueError, match="report_to='all'"):
        GRPOConfig(report_to="all")
    with pytest.raises(ValueError, match="loss_type='bnpo'.*gradient_accumulation_steps=1"):
        GRPOConfig(loss_type="bnpo", gradient_accumulation_steps=2, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="max_steps=3: must be a multiple of num_iterations=2"):
        GRPOConfig(max_steps=3, num_iterations=2)
    GRPOConfig(loss_type="bnpo", use_cpu=True, report_to=None, lr_scheduler_type="constant", optim="adamw_torch_fused")


def test_batch_not_divisible_by_num_generations_names_both():
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=6 .* not a multiple of num_generations=4"):
        GRPOConfig(per_device_train_batch_size=6, num_generations=4)
    GRPOConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=4)  # 4 completions


def test_trainer_arguments_refused(tiny_model_dir, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="callbacks"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=CHAT_ROWS, callbacks=[object()])
    with pytest.raises(ValueError, match="optimizers"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=CHAT_ROWS, optimizers=(object(), None))
    def shout(text):  # no type hints or docstring: no schema, refused at once (a test's own function: once Ray is
        return text  # imported, builtins.print is Ray's wrapper with another name)

    with pytest.raises(ValueError, match="tool shout"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args=args, train_dataset=CHAT_ROWS, tools=[shout])
    with pytest.raises(TypeError, match="args must be rlvr.GRPOConfig"):
        GRPOTrainer(str(tiny_model_dir), exact_answer, args={"learning_rate": 1e-5}, train_dataset=CHAT_ROWS)


def test_delta_below_the_upper_clip_is_refused():
    """rlvr's dual clip equals TRL's cap on the ratio only from delta = 1 + epsilon_high up."""
    with pytest.raises(ValueError, match=r"GRPOConfig\.delta=1\.1: must be >= 1 \+ epsilon_high = 1\.28"):
        GRPOConfig(delta=1.1, epsilon_high=0.28)
    GRPOConfig(delta=1.28, epsilon_high=0.28)


# --------------------------------------------------------------------------- agent training (tools, environments)

def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Counter:
    """A TRL-style environment: reset(**row) starts the count at the row's start column; increment is a tool."""

    def reset(self, start, **row):
        self.count = int(start)
        return f" (the counter starts at {start})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count > 0)


def counted(completions, environments, **kwargs):
    """A reward reading the environments, as TRL passes them."""
    return [float(isinstance(e, Counter)) for e in environments]


def test_tools_and_environment_factory_train_and_rerun_from_the_cli(tiny_long_model_dir, tmp_path):
    out = tmp_path / "agent"
    rows = [{"prompt": [{"role": "user", "content": f"Count from {s}."}], "start": s} for s in range(6)]
    args = GRPOConfig(output_dir=str(out), max_steps=2, num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=12, max_tool_calling_iterations=2, learning_rate=1e-3, report_to="none",
                      disable_tqdm=True)
    trainer = GRPOTrainer(str(tiny_long_model_dir), [counted], args=args, train_dataset=rows, eval_dataset=rows[:2],
                          tools=[multiply], environment_factory=Counter)
    env = trainer.rlvr_config.env
    assert env.tools == ("tests.test_api:multiply",) and env.factory == "tests.test_api:Counter"
    assert env.max_turns == 3 and env.max_episode_tokens == 12
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["rollout/reward/Counter_mean"] == 1.0  # get_reward: start 1..5 > 0 on every row drawn
    assert records[-1]["rollout/reward/tests.test_api:counted_mean"] == 1.0
    assert "episode/turns_mean" in records[-1]
    cli_out = tmp_path / "agent-cli"  # config.yaml names everything: `rlvr train` reruns it
    assert main(["train", str(out / "config.yaml"), f"output_dir={cli_out}"]) == 0
    assert (cli_out / "summary.json").is_file()


def test_agent_arguments_are_checked():
    with pytest.raises(ValueError, match="max_tool_calling_iterations"):
        GRPOConfig(max_tool_calling_iterations=-1)


# TRL 1.16.0's GRPOConfig defaults for every field rlvr presents as TRL's (read off trl/trainer/grpo_config.py and
# transformers' TrainingArguments); a default of rlvr's own would be listed with its reason in docs/api.md.
TRL_1_16_DEFAULTS = {
    "learning_rate": 1e-6, "num_generations": 8, "max_completion_length": 512, "beta": 0.0, "epsilon": 0.2,
    "epsilon_high": None, "delta": None, "loss_type": "dapo", "importance_sampling_level": "token",
    "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "multi_objective_aggregation": "sum_then_normalize",
    "sync_ref_model": False, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512, "entropy_coef": 0.0,
    "top_entropy_quantile": 1.0, "scale_rewards": "group", "num_iterations": 1, "mask_truncated_completions": False,
    "reward_weights": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "use_bias_correction_kl": True,
    "off_policy_mask_threshold": None, "use_adaptive_entropy": False, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005, "entropy_target": 0.2, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "steps_per_generation": None, "generation_batch_size": None,
    "max_tool_calling_iterations": None, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
}


def test_every_default_presented_as_trls_is_trl_1_16s():
    args = GRPOConfig()
    differs = {name: (getattr(args, name), trl) for name, trl in TRL_1_16_DEFAULTS.items()
               if getattr(args, name) != trl}
    assert not differs, f"rlvr's default differs from TRL 1.16's: {differs}"
