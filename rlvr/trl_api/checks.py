"""The checks of ``rlvr.GRPOConfig`` (rlvr/api.py) that need no dataset: each field's type and range, and the values
rlvr cannot honour, each an error naming the field; and the TRL names rlvr maps (loss types, strategies)."""

from __future__ import annotations

from typing import Any

from rlvr.config.algo import REWARD_AGGREGATIONS
from rlvr.platform.numbers import is_finite_float32
from rlvr.store.trackers import TRACKERS

# TRL's loss_type -> rlvr's (algo.objective, algo.aggregation); each aggregation divides the summed token losses once
# per step, over the whole batch. ppo_clip becomes gspo with importance_sampling_level="sequence".
LOSS_TYPES = {"grpo": ("ppo_clip", "sequence_mean"), "dapo": ("ppo_clip", "token_mean"),
              "bnpo": ("ppo_clip", "token_mean"), "dr_grpo": ("ppo_clip", "token_sum_constant"),
              "cispo": ("cispo", "token_mean"), "sapo": ("sapo", "sequence_mean"),
              "luspo": ("ppo_clip", "sequence_sum")}
TRL_IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = {"group": "group", "batch": "batch", "none": "none"}
STRATEGIES = ("no", "steps", "epoch")


def plain(value: Any) -> Any:
    """The value of a string enum (transformers' IntervalStrategy, SchedulerType) as its string."""
    return getattr(value, "value", value)


def refuse(field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"GRPOConfig.{field}={value!r}: {why}")


def is_finite_number(value: Any) -> bool:
    return is_finite_float32(value)


def check_config(a: Any) -> None:
    """Every check of the rlvr.GRPOConfig ``a`` that needs no dataset; an error names the field."""
    for name in ("learning_rate", "beta", "epsilon", "temperature", "top_p", "num_train_epochs", "warmup_steps",
                 "weight_decay", "max_grad_norm", "logging_steps", "save_steps"):
        if not is_finite_number(getattr(a, name)) or getattr(a, name) < 0:
            raise refuse(name, getattr(a, name), "must be a number >= 0")
    for name in ("num_generations", "max_completion_length", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "num_iterations", "max_steps", "seed"):
        if not isinstance(getattr(a, name), int) or isinstance(getattr(a, name), bool):
            raise refuse(name, getattr(a, name), "must be an int")
    for name in ("max_prompt_length", "save_total_limit", "per_device_eval_batch_size"):
        value = getattr(a, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise refuse(name, value, "must be None or an int >= 1")
    value = a.max_tool_calling_iterations
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise refuse("max_tool_calling_iterations", value, "must be None or an int >= 0")
    for name in ("epsilon_high", "eval_steps", "warmup_ratio"):
        value = getattr(a, name)
        if value is not None and (not is_finite_number(value) or value < 0):
            raise refuse(name, value, "must be None or a number >= 0")
    for name in ("mask_truncated_completions", "disable_tqdm", "log_completions", "bf16", "use_cpu",
                 "gradient_checkpointing", "remove_unused_columns"):
        if not isinstance(getattr(a, name), bool):
            raise refuse(name, getattr(a, name), "must be True or False")
    if a.num_generations < 2:
        raise refuse("num_generations", a.num_generations, "must be >= 2 (a group of one has no signal)")
    for name in ("max_completion_length", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "num_iterations"):
        if getattr(a, name) < 1:
            raise refuse(name, getattr(a, name), "must be >= 1")
    completions = a.per_device_train_batch_size * a.gradient_accumulation_steps
    if completions % a.num_generations:
        raise ValueError(
            f"GRPOConfig: per_device_train_batch_size={a.per_device_train_batch_size} x gradient_accumulation_steps="
            f"{a.gradient_accumulation_steps} = {completions} completions per step is not a multiple of "
            f"num_generations={a.num_generations}; each step samples whole groups of num_generations completions "
            "(prompts per step = completions per step / num_generations): change one of them")
    if a.max_steps == 0 or a.max_steps < -1:
        raise refuse("max_steps", a.max_steps, "must be >= 1 (or -1: train num_train_epochs epochs)")
    if a.max_steps > 0 and a.max_steps % a.num_iterations:
        raise refuse("max_steps", a.max_steps,
                      f"must be a multiple of num_iterations={a.num_iterations}: each batch of completions is trained "
                      "on num_iterations times, one optimizer step each, and rlvr counts steps in batches")
    if a.max_steps == -1 and a.num_train_epochs <= 0:
        raise refuse("num_train_epochs", a.num_train_epochs, "must be > 0 when max_steps is -1")
    if a.temperature <= 0:
        raise refuse("temperature", a.temperature, "must be > 0 (GRPO compares sampled completions)")
    if not 0 < a.top_p <= 1:
        raise refuse("top_p", a.top_p, "must be in (0, 1]")
    if a.top_k is not None and (not isinstance(a.top_k, int) or isinstance(a.top_k, bool) or a.top_k < 0):
        raise refuse("top_k", a.top_k, "must be an int >= 0 (0 or None: off)")
    if a.delta is not None and (not is_finite_number(a.delta) or a.delta <= 1):
        raise refuse("delta", a.delta, "must be > 1 (or None: off)")
    high = a.epsilon if a.epsilon_high is None else a.epsilon_high
    if a.delta is not None and is_finite_number(high) and a.delta < 1 + high:
        # TRL caps every token's ratio at delta; rlvr's dual clip caps negative-advantage tokens only. The two are
        # the same loss when delta >= 1 + epsilon_high (a positive advantage's ratio is clipped there first).
        raise refuse("delta", a.delta, f"must be >= 1 + epsilon_high = {1 + high:g}, where rlvr's dual clip and "
                                        "TRL's cap on the ratio give the same loss")
    loss_type = plain(a.loss_type)
    if loss_type == "vespo":
        raise refuse("loss_type", loss_type, "VESPO's sequence weight is not implemented; closest: loss_type='cispo' "
                                              "(a clipped, detached ratio on REINFORCE)")
    if loss_type not in LOSS_TYPES:
        raise refuse("loss_type", loss_type, f"rlvr does not support it; supported: {', '.join(LOSS_TYPES)}")
    if a.importance_sampling_level not in TRL_IS_LEVELS:
        raise refuse("importance_sampling_level", a.importance_sampling_level, "must be token or sequence")
    if a.importance_sampling_level == "sequence" and LOSS_TYPES[loss_type][0] != "ppo_clip":
        raise refuse("importance_sampling_level", "sequence", f"rlvr's {loss_type} is token-level; the sequence ratio "
                                                               "(GSPO) goes with grpo, dapo, bnpo, dr_grpo or luspo")
    if loss_type == "cispo" and (a.epsilon_high is None or not is_finite_number(a.epsilon_high) or a.epsilon_high <= 1):
        raise refuse("epsilon_high", a.epsilon_high, "loss_type='cispo' reads it as the absolute cap of the ratio and "
                                                      "needs it set above 1 (MiniMax-M1, TRL's docs: 5.0); left unset, "
                                                      "TRL falls back to epsilon=0.2 and caps every on-policy token")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not is_finite_number(getattr(a, name)) or getattr(a, name) <= 0:
            raise refuse(name, getattr(a, name), "must be a number > 0")
    if a.multi_objective_aggregation not in REWARD_AGGREGATIONS:
        raise refuse("multi_objective_aggregation", a.multi_objective_aggregation,
                      f"must be one of {', '.join(REWARD_AGGREGATIONS)}")
    if a.sync_ref_model and not (is_finite_number(a.beta) and a.beta > 0):
        raise refuse("sync_ref_model", True, "refreshes the KL reference, which beta=0 does not use: set beta > 0")
    if not is_finite_number(a.ref_model_mixup_alpha) or not 0 < a.ref_model_mixup_alpha <= 1:
        raise refuse("ref_model_mixup_alpha", a.ref_model_mixup_alpha, "must be in (0, 1]")
    if not isinstance(a.ref_model_sync_steps, int) or isinstance(a.ref_model_sync_steps, bool) \
            or a.ref_model_sync_steps < 1:
        raise refuse("ref_model_sync_steps", a.ref_model_sync_steps, "must be an int >= 1")
    if not isinstance(a.use_bias_correction_kl, bool):
        raise refuse("use_bias_correction_kl", a.use_bias_correction_kl, "must be True or False")
    if a.off_policy_mask_threshold is not None:
        raise refuse("off_policy_mask_threshold", a.off_policy_mask_threshold,
                     "rlvr's trust region for stale samples is algo.gap_mask (DPPO) in a YAML config; None only here")
    if a.use_adaptive_entropy is not False:
        raise refuse("use_adaptive_entropy", a.use_adaptive_entropy, "rlvr's entropy bonus has a fixed coefficient "
                                                                      "(entropy_coef); False only")
    if a.steps_per_generation not in (None, a.gradient_accumulation_steps):
        raise refuse("steps_per_generation", a.steps_per_generation, "rlvr generates once per optimizer step: None "
                                                                      "or gradient_accumulation_steps")
    if a.generation_batch_size not in (None, a.per_device_train_batch_size * a.gradient_accumulation_steps):
        raise refuse("generation_batch_size", a.generation_batch_size, "rlvr generates one optimizer step's batch: "
                                                                        "None or per_device_train_batch_size x "
                                                                        "gradient_accumulation_steps")
    if not is_finite_number(a.entropy_coef) or a.entropy_coef < 0:
        raise refuse("entropy_coef", a.entropy_coef, "must be a number >= 0")
    if not is_finite_number(a.top_entropy_quantile) or not 0 < a.top_entropy_quantile <= 1:
        raise refuse("top_entropy_quantile", a.top_entropy_quantile, "must be in (0, 1] (1: off)")
    if loss_type == "bnpo" and a.gradient_accumulation_steps != 1:
        raise refuse("loss_type", loss_type,
                      "bnpo normalises over each micro-batch of gradient accumulation; rlvr normalises once over the "
                      "step's whole batch, which is bnpo only with gradient_accumulation_steps=1: use loss_type="
                      "'dapo' (the same normalisation over the whole batch) or gradient_accumulation_steps=1")
    scale_name(a.scale_rewards)
    tracker_names(a.report_to)
    if a.reward_weights is not None and (not isinstance(a.reward_weights, (list, tuple))
                                         or not all(is_finite_number(w) for w in a.reward_weights)):
        raise refuse("reward_weights", a.reward_weights, "must be None or a list of numbers")
    if a.warmup_ratio is not None and a.warmup_steps:
        raise refuse("warmup_ratio", a.warmup_ratio, f"set warmup_ratio or warmup_steps ({a.warmup_steps}), not both")
    if a.warmup_ratio is not None and a.warmup_ratio >= 1:
        raise refuse("warmup_ratio", a.warmup_ratio, "must be in [0, 1)")
    scheduler = plain(a.lr_scheduler_type)
    if scheduler not in ("constant_with_warmup", "constant"):
        raise refuse("lr_scheduler_type", scheduler,
                      "rlvr's schedule is a linear warmup then a constant rate: constant_with_warmup (or constant, "
                      "without warmup)")
    if scheduler == "constant" and (a.warmup_steps or a.warmup_ratio):
        raise refuse("lr_scheduler_type", scheduler, "has no warmup; use constant_with_warmup with a warmup")
    if plain(a.optim) not in ("adamw_torch", "adamw_torch_fused"):
        raise refuse("optim", plain(a.optim), "rlvr's optimizer is torch's AdamW: adamw_torch or adamw_torch_fused")
    for name, default in (("adam_beta1", 0.9), ("adam_beta2", 0.999), ("adam_epsilon", 1e-8)):
        if getattr(a, name) != default:
            raise refuse(name, getattr(a, name), f"rlvr's AdamW uses torch's default ({default}); it is not settable")
    if a.num_completions_to_print is not None:
        raise refuse("num_completions_to_print", a.num_completions_to_print,
                      "rlvr prints no completions; log_completions=True writes every one to OUTPUT_DIR/samples.jsonl")
    if plain(a.save_strategy) not in STRATEGIES:
        raise refuse("save_strategy", plain(a.save_strategy), f"rlvr supports {', '.join(STRATEGIES)}")
    if plain(a.eval_strategy) not in STRATEGIES:
        raise refuse("eval_strategy", plain(a.eval_strategy), f"rlvr supports {', '.join(STRATEGIES)}")
    if a.save_steps <= 0:
        raise refuse("save_steps", a.save_steps, "must be > 0")
    if a.logging_steps <= 0:
        raise refuse("logging_steps", a.logging_steps, "must be > 0")
    if a.eval_steps is not None and a.eval_steps <= 0:
        raise refuse("eval_steps", a.eval_steps, "must be > 0")
    if a.fp16:
        raise refuse("fp16", a.fp16, "rlvr runs fp32 or, with bf16=True, bf16 autocast")
    for name, allowed, why in (("shuffle_dataset", True, "rlvr always draws prompts in a seeded random order"),
                               ("use_vllm", False, ("this trainer samples in process; rollout servers (vLLM "
                                 "included) are set up with rollout.backend=server in a YAML config")),
                               ("push_to_hub", False, "rlvr never uploads")):
        if getattr(a, name) is not allowed:
            raise refuse(name, getattr(a, name), f"only {allowed} is supported: {why}")


def scale_name(value: Any) -> str:
    value = plain(value)
    if isinstance(value, bool):
        return "group" if value else "none"
    if value not in SCALE_REWARDS:
        raise refuse("scale_rewards", value, "rlvr supports group (or True), batch, none (or False)")
    return SCALE_REWARDS[value]


def tracker_names(report_to: Any) -> list[str]:
    names = [report_to] if report_to is None or isinstance(report_to, str) else list(report_to)
    names = [n for n in names if n not in (None, "none")]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise refuse("report_to", report_to,
                      f"rlvr does not report to {bad[0]!r}; it supports none, {', '.join(TRACKERS)} or a list of them "
                      "(and always writes metrics.jsonl)")
    return names


# GRPOConfig's accepted TrainingArguments fields that change nothing: name -> (values that match what rlvr does
# anyway, the note printed for any other value).
IGNORED_FIELDS: dict[str, tuple[tuple, str]] = {
    "log_level": (("passive",), "rlvr prints its own progress and leaves the library loggers' levels alone"),
    "logging_first_step": ((False, True), ""),
    "logging_strategy": (("steps",), "rlvr logs every step"),
    "logging_dir": ((None,), "TensorBoard events go to OUTPUT_DIR/tensorboard"),
    "overwrite_output_dir": ((False,), "rlvr never overwrites a run: an earlier one is moved aside (.prev-N)"),
    "do_train": ((False, True), ""),
    "do_eval": ((False, True), ""),
    "dataloader_num_workers": ((0,), "rlvr draws prompts from rows in memory, without a DataLoader"),
    "dataloader_pin_memory": ((True, False), ""),
    "dataloader_persistent_workers": ((False, True), ""),
    "save_only_model": ((False,), "checkpoints still hold the optimizer and scheduler state, which resume needs"),
    "save_safetensors": ((True,), "rlvr always saves safetensors"),
    "gradient_checkpointing_kwargs": ((None, {"use_reentrant": False}), "rlvr checkpoints with use_reentrant=False"),
    "ddp_find_unused_parameters": ((None,), "rlvr's learners sum gradients themselves, without DDP"),
    # TRL's own fields that only a refused setting reads (loss_type='vespo', use_adaptive_entropy=True)
    **{name: ((default,), "only loss_type='vespo' reads it") for name, default in (
        ("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0), ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0))},
    **{name: ((default,), "only use_adaptive_entropy=True reads it") for name, default in (
        ("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0), ("entropy_coef_delta", 0.005), ("entropy_target", 0.2))},
}


def ignored_notes(a: Any) -> list[str]:
    """One note per accepted field of ``a`` set to a value whose effect under transformers rlvr does not have."""
    return [f"rlvr: GRPOConfig.{name}={getattr(a, name)!r} has no effect here: {note}"
            for name, (same, note) in IGNORED_FIELDS.items() if note and getattr(a, name) not in same]
