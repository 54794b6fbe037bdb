"""A Python API a TRL user recognises: ``GRPOTrainer`` and ``GRPOConfig`` with the names of TRL's GRPOTrainer, for
the subset rlvr supports, built on rlvr's own config (docs/api.md)::

    from rlvr import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="path/to/model", reward_funcs=[my_reward], train_dataset=dataset,
                          args=GRPOConfig(output_dir="runs/mine", learning_rate=1e-5, max_steps=50))
    trainer.train()

Underneath, the trainer turns its arguments into a ``rlvr.config.schema.RunConfig`` (``trainer.rlvr_config``) and runs
``rlvr.launch.train``, so the run writes what ``rlvr train`` writes, ``config.yaml`` included: the datasets go to
JSONL files beside the run directory and the reward functions are named by where they can be imported, so
``rlvr train OUTPUT_DIR/config.yaml`` runs the same training again. Every TRL field that rlvr cannot honour is an
error naming it; only TrainingArguments fields that change nothing here are accepted, with a note when set to a
value whose effect rlvr does not have (``api_checks.IGNORED_FIELDS``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rlvr.config.loading import build_config
from rlvr.config.schema import RunConfig
from rlvr.models.policy import ALL_LINEAR, resolve_model_dir
from rlvr.rewards import WeightedReward
from rlvr.rewards.base import TrainerState
from rlvr.store.metrics import read_metrics
from rlvr.trl_api.checks import (
    LOSS_TYPES,
    check_config,
    ignored_notes,
    is_finite_number,
    plain,
    scale_name,
    tracker_names,
)
from rlvr.trl_api.inputs import dataset_jsonl, dataset_rows, environment_objects, held_out_check, reward_entry

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainOutput"]

NO_EVAL_DATASET_EVAL_SIZE = 100  # training prompts measured before and after when there is no eval_dataset
# Fields of TRL's GRPOConfig (or of transformers' TrainingArguments) that users often set and rlvr does not support,
# with what to do instead; any other unknown field gets the generic message.
_HINTS = {
    "model_init_kwargs": "rlvr loads the model from its directory in fp32, or bf16 under LoRA on a bf16 GPU "
                         "(bf16=True runs it under bf16 autocast)",
    "vllm_mode": "rlvr samples in process, or on rollout servers (rlvr serve or vLLM) with rollout.backend=server "
                 "in a YAML config (docs/concepts/rollout_servers.md)",
    "generation_kwargs": "rlvr's sampling knobs are temperature, top_p, top_k and max_completion_length",
    "deepspeed": "rlvr trains in one process",
    "fsdp": "rlvr trains in one process",
}


class TrainOutput(NamedTuple):
    """What ``GRPOTrainer.train`` returns, shaped like transformers' ``TrainOutput``."""

    global_step: int
    """Optimizer steps taken, as TRL counts them: rlvr's train.steps x num_iterations."""
    training_loss: float
    """Mean of the per-step loss (``update/loss`` in metrics.jsonl) over the run's steps."""
    metrics: dict
    """rlvr's run summary (also in OUTPUT_DIR/summary.json): held-out accuracy before and after, steps, wall time,
    where the weights were saved (docs/reference/metrics.md)."""


@dataclass
class GRPOConfig:
    """Training settings under the names of TRL's ``GRPOConfig``, for what rlvr supports (docs/api.md has the
    table of each field and the rlvr config key it sets).

    Defaults are TRL's (with transformers' ``TrainingArguments`` underneath) except where noted: bf16 and
    gradient_checkpointing are off (a CPU trainer), the learning rate is constant after the warmup (TRL's default
    schedule decays it linearly; ``lr_scheduler_type`` names the one rlvr has). A field TRL has that is not listed
    here is an error naming it; so is a listed field set to a value rlvr cannot honour.

    Steps: TRL counts optimizer steps; each batch of completions is trained on ``num_iterations`` times, one
    optimizer step each, so rlvr's steps (sample, score, train) are ``max_steps / num_iterations``; ``save_steps``
    and ``eval_steps`` are converted the same way (rounded up to whole batches).
    """

    output_dir: str = "trainer_output"
    """Run directory (rlvr output_dir): config.yaml, metrics.jsonl, summary.json, checkpoints/, the weights in
    adapter/ (peft_config given) or model/. The datasets are written beside it, to OUTPUT_DIR.data/."""
    learning_rate: float = 1e-6
    """AdamW learning rate after the warmup (train.lr)."""
    num_generations: int = 8
    """G, completions per prompt (rollout.group_size); at least 2."""
    max_completion_length: int = 512
    """Completion length cap in tokens (rollout.max_new_tokens), TRL 1.16's default; also Dr. GRPO's constant."""
    max_prompt_length: int | None = None
    """None: prompts are not cut (a prompt that leaves no room for the completion in the model's context is an error
    naming the row). A number: every prompt of both datasets must fit it, else an error naming the row (rlvr never
    cuts prompts; TRL 1.16 has no such field)."""
    beta: float = 0.0
    """KL coefficient against the starting model (algo.beta; k3 estimator, as TRL)."""
    use_bias_correction_kl: bool = True
    """TRL's default: each token's KL estimate multiplied by the ratio pi_theta / pi_old, with its gradient
    (algo.kl_ratio_weighted; rlvr's YAML default is the plain estimator). No effect with beta=0."""
    off_policy_mask_threshold: float | None = None
    """None only: TRL's sequence mask for stale vLLM samples; rlvr samples on-policy here (for stale samples:
    algo.gap_mask in a YAML config)."""
    use_adaptive_entropy: bool = False
    """False only: the entropy bonus has the fixed coefficient entropy_coef (entropy_coef_min, entropy_coef_max,
    entropy_coef_delta and entropy_target, which only the adaptive bonus reads, are accepted and unused)."""
    entropy_coef_min: float = 0.0
    """Read by use_adaptive_entropy only (refused): accepted, unused."""
    entropy_coef_max: float = 1.0
    """Read by use_adaptive_entropy only (refused): accepted, unused."""
    entropy_coef_delta: float = 0.005
    """Read by use_adaptive_entropy only (refused): accepted, unused."""
    entropy_target: float = 0.2
    """Read by use_adaptive_entropy only (refused): accepted, unused."""
    vespo_k_pos: float = 2.0
    """Read by loss_type='vespo' only (refused): accepted, unused."""
    vespo_lambda_pos: float = 3.0
    """Read by loss_type='vespo' only (refused): accepted, unused."""
    vespo_k_neg: float = 3.0
    """Read by loss_type='vespo' only (refused): accepted, unused."""
    vespo_lambda_neg: float = 2.0
    """Read by loss_type='vespo' only (refused): accepted, unused."""
    steps_per_generation: int | None = None
    """None or gradient_accumulation_steps only: rlvr generates once per optimizer step (TRL's default)."""
    generation_batch_size: int | None = None
    """None or per_device_train_batch_size x gradient_accumulation_steps only (TRL's default)."""
    epsilon: float = 0.2
    """Lower clip of the ratio: ratio >= 1 - epsilon (algo.eps_low)."""
    epsilon_high: float | None = None
    """Upper clip: ratio <= 1 + epsilon_high (algo.eps_high); None: epsilon."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the ratio of negative-advantage tokens capped at delta (> 1); rlvr's
    dual clip (algo.dual_clip). None: off."""
    loss_type: str = "dapo"
    """The objective and how token losses become the step's loss (algo.objective, algo.aggregation): grpo (mean per
    sequence, then over sequences: sequence_mean), dapo (mean over every completion token of the step: token_mean),
    dr_grpo (sum over a constant, max_completion_length x completions: token_sum_constant), bnpo (token mean over the
    local batch: token_mean, so only with gradient_accumulation_steps=1, where the local batch is the step's), cispo
    (objective cispo, token_mean; epsilon_high is its absolute cap and must be set), sapo (objective sapo,
    sequence_mean), luspo (per-sequence sum: sequence_sum; use with importance_sampling_level='sequence'). vespo:
    refused."""
    importance_sampling_level: str = "token"
    """token, or sequence: GSPO's length-normalised sequence ratio (algo.objective=gspo) with the PPO-clip loss
    types (grpo, dapo, bnpo, dr_grpo, luspo)."""
    sapo_temperature_pos: float = 1.0
    """loss_type='sapo': the soft gate's temperature for positive advantages (algo.sapo_tau_pos)."""
    sapo_temperature_neg: float = 1.05
    """loss_type='sapo': the temperature for negative advantages (algo.sapo_tau_neg)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """With several reward functions (algo.reward_aggregation): sum_then_normalize (their weighted sum, then
    scale_rewards) or normalize_then_sum (GDPO: each normalised within its group, weighted, summed, then normalised
    over the batch; scale_rewards is not used)."""
    sync_ref_model: bool = False
    """Move the KL reference towards the policy every ref_model_sync_steps optimizer steps (algo.ref_sync_steps);
    needs beta != 0. With peft_config (TRL refuses that) the reference is an earlier adapter, mixed elementwise."""
    ref_model_mixup_alpha: float = 0.6
    """sync_ref_model: the share of the policy mixed into the reference (algo.ref_mixup_alpha)."""
    ref_model_sync_steps: int = 512
    """sync_ref_model: optimizer steps between refreshes (algo.ref_sync_steps)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef x the mean entropy of the step's trained tokens
    (algo.entropy_coef)."""
    top_entropy_quantile: float = 1.0
    """Train the policy term only on this share of the highest-entropy tokens (algo.top_entropy_quantile); rlvr takes
    the threshold over the whole step, as the paper does (TRL: over each micro-batch). 1: off."""
    scale_rewards: str | bool = "group"
    """Advantage scaling (algo.scale): group or True (each group's std), batch (the std of the whole batch), none or
    False (Dr. GRPO). mean: refused."""
    num_iterations: int = 1
    """mu: optimizer steps on each batch of completions (algo.num_iterations)."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_length are not trained on (algo.mask_truncated)."""
    reward_weights: list[float] | None = None
    """Weight of each reward function, in the order of reward_funcs (rewards[].weight); None: all 1."""
    temperature: float = 1.0
    """Sampling temperature (rollout.temperature); log-probs are scored at the same temperature, as TRL does."""
    top_p: float = 1.0
    """Nucleus sampling mass (rollout.top_p)."""
    top_k: int | None = 0
    """Top-k sampling, 0 or None: off (rollout.top_k)."""
    per_device_train_batch_size: int = 8
    """Completions per forward/backward (train.micro_batch_size). With gradient_accumulation_steps it fixes the
    completions per step, per_device_train_batch_size x gradient_accumulation_steps, which must be a multiple of
    num_generations: the prompts per step (train.prompts_per_step) are that divided by num_generations."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (see per_device_train_batch_size)."""
    max_steps: int = -1
    """Optimizer steps to train (>= 1, a multiple of num_iterations): train.steps = max_steps / num_iterations.
    -1: num_train_epochs decides."""
    num_train_epochs: float = 3.0
    """With max_steps=-1: train.steps = ceil(num_train_epochs x rows of train_dataset / prompts per step). rlvr draws
    the prompts of each step from a seeded stream of shuffled epochs (an epoch's last prompts share a step with the
    next epoch's first, none is dropped)."""
    warmup_steps: float = 0
    """Linear warmup over this many optimizer steps (train.warmup_steps; a number below 1 is a share of the run,
    as in transformers 5). rlvr reaches the full rate at step warmup_steps; transformers one step later."""
    warmup_ratio: float | None = None
    """Warmup as a share of the run's optimizer steps (train.warmup_steps, rounded up); set it or warmup_steps."""
    lr_scheduler_type: str = "constant_with_warmup"
    """rlvr's schedule: linear warmup, then constant (constant: the same without warmup). Others, including TRL's
    default linear decay, are refused."""
    weight_decay: float = 0.0
    """AdamW weight decay (train.weight_decay)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm, 0: off (train.max_grad_norm)."""
    optim: str = "adamw_torch"
    """adamw_torch or adamw_torch_fused: rlvr's optimizer, torch's AdamW. Others are refused."""
    adam_beta1: float = 0.9
    """Accepted at 0.9 only (rlvr's AdamW uses torch's defaults)."""
    adam_beta2: float = 0.999
    """Accepted at 0.999 only."""
    adam_epsilon: float = 1e-8
    """Accepted at 1e-8 only."""
    seed: int = 42
    """Seed of data order, sampling and initialisation (train.seed)."""
    logging_steps: float = 10
    """Accepted; rlvr logs every step (metrics.jsonl and the trackers of report_to). Also the eval interval when
    eval_strategy=steps and eval_steps is None, as in TRL."""
    report_to: str | list[str] | None = "none"
    """none (or None), tensorboard, wandb, trackio, or a list of them (log.trackers). all and other integrations
    are refused. rlvr always writes metrics.jsonl."""
    run_name: str | None = None
    """Run name in wandb and trackio (log.run_name); None: the name of output_dir."""
    disable_tqdm: bool = False
    """No live progress bar (log.progress = not disable_tqdm)."""
    log_completions: bool = False
    """Write every sampled completion with its rewards and prompt to OUTPUT_DIR/samples.jsonl, every step
    (log.samples)."""
    num_completions_to_print: int | None = None
    """Refused when set: rlvr prints no completions (log_completions=True writes them all to samples.jsonl)."""
    save_strategy: str = "steps"
    """steps (every save_steps), epoch (every epoch of train_dataset) or no (train.checkpoint_every = 0). rlvr
    always also writes a checkpoint at the end (and on Ctrl-C). best: refused."""
    save_steps: float = 500
    """Checkpoint interval in optimizer steps (a number below 1: a share of the run) -> train.checkpoint_every."""
    save_total_limit: int | None = None
    """Checkpoints kept (train.keep_last); None: all of them, as in TRL."""
    eval_strategy: str = "no"
    """no: rlvr evaluates before and after training only (eval.every = 0); steps: also every eval_steps; epoch:
    also every epoch. steps and epoch need an eval_dataset, as in TRL."""
    eval_steps: float | None = None
    """Evaluation interval in optimizer steps (None: logging_steps) -> eval.every."""
    per_device_eval_batch_size: int | None = None
    """Prompts per greedy evaluation batch (eval.batch_size); None: rlvr's default (64). It does not change the
    result."""
    bf16: bool = False
    """bf16 autocast for generation and training, fp32 master weights (model.autocast=bf16). Off by default (TRL's
    default is on): on a CPU it pays only where there are bf16 units (AMX)."""
    fp16: bool = False
    """Refused when True: rlvr runs fp32 or bf16 autocast."""
    use_cpu: bool = False
    """TRL's switch: True trains on the CPU even where a GPU is visible (train.device=cpu); False lets rlvr pick a
    CUDA GPU when one is visible (train.device=auto)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (model.gradient_checkpointing). Off by default (TRL's default is on)."""
    remove_unused_columns: bool = False
    """False (TRL's default): every dataset column goes to the reward functions as a keyword argument. True: only
    prompt is kept (the JSONL files hold only it)."""
    shuffle_dataset: bool = True
    """Accepted at True only: rlvr always draws prompts in a seeded random order."""
    use_vllm: bool = False
    """Accepted at False only: the trainer samples in process (rollout servers, vLLM included: rollout.backend=server
    in a YAML config)."""
    push_to_hub: bool = False
    """Accepted at False only: rlvr never uploads."""
    max_tool_calling_iterations: int | None = None
    """With tools or environment_factory: tool-calling rounds per episode, at most (env.max_turns is one more: the
    final answer). None: rlvr's default of 4 model turns (TRL's None is no limit but the length)."""
    # transformers' TrainingArguments fields that change nothing here: accepted; a value that would change something
    # under transformers gets a note when the trainer is built (api_checks.IGNORED_FIELDS, docs/api.md).
    log_level: str = "passive"
    """Accepted; rlvr prints its own progress and one-line errors, and leaves the library loggers' levels alone."""
    logging_first_step: bool = False
    """Accepted; rlvr logs every step, the first included."""
    logging_strategy: str = "steps"
    """Accepted; rlvr logs every step whatever it says."""
    logging_dir: str | None = None
    """Accepted; TensorBoard events go to OUTPUT_DIR/tensorboard (report_to='tensorboard')."""
    overwrite_output_dir: bool = False
    """Accepted; rlvr never overwrites a run: an earlier one in output_dir is moved aside to OUTPUT_DIR.prev-N."""
    do_train: bool = False
    """Accepted (read by scripts, not by the trainer, as in transformers)."""
    do_eval: bool = False
    """Accepted (read by scripts, not by the trainer, as in transformers)."""
    dataloader_num_workers: int = 0
    """Accepted; rlvr draws prompts from rows in memory, without a DataLoader."""
    dataloader_pin_memory: bool = True
    """Accepted; no DataLoader (as dataloader_num_workers)."""
    dataloader_persistent_workers: bool = False
    """Accepted; no DataLoader (as dataloader_num_workers)."""
    save_only_model: bool = False
    """Accepted; rlvr's checkpoints always hold the optimizer, scheduler and data cursor, which exact resume needs
    (the trained weights alone are OUTPUT_DIR/adapter or OUTPUT_DIR/model)."""
    save_safetensors: bool = True
    """Accepted; rlvr always saves safetensors."""
    gradient_checkpointing_kwargs: dict | None = None
    """Accepted; with gradient_checkpointing rlvr checkpoints with use_reentrant=False, whatever it says."""
    ddp_find_unused_parameters: bool | None = None
    """Accepted; rlvr's learners (torchrun) sum gradients themselves, without DDP."""

    def __post_init__(self) -> None:
        self.check()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELD_NAMES:  # a misspelled or unsupported field set after construction must not vanish
            raise AttributeError(_unsupported_message([name]))
        super().__setattr__(name, value)

    def check(self) -> None:
        """Every check that does not need the datasets; an error names the field (called on construction and again
        by GRPOTrainer, so fields changed after construction are checked too)."""
        check_config(self)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(GRPOConfig))
_dataclass_init = GRPOConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self: GRPOConfig, *args: Any, **kwargs: Any) -> None:
    unknown = [k for k in kwargs if k not in _FIELD_NAMES]
    if unknown:
        raise TypeError(_unsupported_message(unknown))
    _dataclass_init(self, *args, **kwargs)


GRPOConfig.__init__ = _init  # type: ignore[method-assign]


def _unsupported_message(names: list[str], owner: str = "GRPOConfig") -> str:
    fields = _FIELD_NAMES if owner == "GRPOConfig" else _DISTILL_FIELDS - _GRPO_ONLY
    lines = []
    for name in names:
        hint = _HINTS.get(name) or (_HINTS["vllm_mode"] if name.startswith("vllm_") else "")
        if owner != "GRPOConfig" and name in _GRPO_ONLY:
            hint = "a GRPOConfig field; TRL's DistillationConfig has none either"
        close = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.8)
        lines.append(f"{owner}: rlvr does not support the field {name!r}" + (f" ({hint})" if hint else "")
                     + (f" (did you mean {close[0]!r}?)" if close else ""))
    return "; ".join(lines) + f"; supported fields: {', '.join(sorted(fields))} (docs/api.md)"


# ---------------------------------------------------------------- the trainer


class GRPOTrainer:
    """Train ``model`` with GRPO on ``train_dataset``, scored by ``reward_funcs``; TRL's constructor, rlvr's trainer.

    - ``model``: a built-in alias (smollm2-135m-instruct) or a local directory saved with ``save_pretrained`` (rlvr
      never downloads). A transformers model object is accepted when its ``name_or_path`` is such a directory: rlvr
      loads the weights from there (changes made in memory are not seen).
    - ``reward_funcs``: one or a list of reward functions with TRL's signature ``f(prompts, completions, **kwargs) ->
      list[float | None]`` (every other dataset column comes as a keyword argument, plus ``completion_ids``), or
      names: an rlvr built-in (math_correct, format, ...) or ``'module:function'``. Each function is recorded in
      config.yaml as ``module:function``; a lambda, nested function or callable object trains, but cannot be named
      there (a warning says so), nor can ``__main__:function`` (a function of the running script) be imported by
      ``rlvr train`` later. A reward model (TRL's string form: a directory of an AutoModelForSequenceClassification
      with one label, or such a model object) is the ``reward_model`` built-in (docs/concepts/reward_models.md).
    - ``train_dataset`` / ``eval_dataset``: a ``datasets.Dataset`` or a list of dicts with a ``prompt`` column (a
      string, sent as it is, or chat messages, rendered with the model's chat template: TRL's standard and
      conversational formats) and any other columns, which reach the reward functions. They are written to
      ``OUTPUT_DIR.data/{train,eval}-HASH.jsonl`` (a file per content, so a later run never changes an earlier run's
      data) and config.yaml reads them (``task.name: jsonl``).
    - Accuracy: rlvr measures greedy accuracy before and after training (and every eval_steps with
      ``eval_strategy='steps'``): the share of prompts whose greedy completion scores exactly 1.0 on the first
      reward function rlvr can import by name (``task.eval_reward``), so list the correctness reward first. On all
      rows of ``eval_dataset``; without one, on the first 100 rows of ``train_dataset``, which are trained on (not
      held out: a note says so).
    - ``peft_config``: a ``peft.LoraConfig`` -> LoRA (model.lora_r, lora_alpha, lora_dropout, lora_targets from
      target_modules, 'all-linear' included; None takes peft's default modules for the architecture); LoRA options
      rlvr does not implement (use_dora, bias, modules_to_save, ...) are errors. None: full fine-tuning, as TRL.
    - ``processing_class``: None, or the tokenizer saved in the model's directory (rlvr loads it from there).
    - ``tools`` / ``environment_factory``: TRL's agent training. ``tools`` is a list of functions (type hints and a
      Google-style docstring: each becomes a tool the model can call); ``environment_factory`` a TRL-style
      environment class (``reset(**row)``, public methods as tools, optional ``get_reward()``). Each G sample is
      then an episode (docs/concepts/episodes.md); ``max_completion_length`` bounds each turn and the whole
      episode. They are recorded in config.yaml as env.factory / env.tools (``module:name``), with the same warning
      as reward functions when they cannot be imported by that name.
    - ``reward_processing_classes``, ``callbacks``, ``optimizers`` and any other argument: refused unless left unset.

    ``trainer.rlvr_config`` is the ``rlvr.config.schema.RunConfig`` that ``train()`` runs and writes to config.yaml.
    """

    def __init__(self, model: Any, reward_funcs: Any, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), peft_config: Any = None, tools: Any = None,
                 environment_factory: Any = None, **kwargs: Any):
        if kwargs:
            raise TypeError(f"GRPOTrainer: rlvr does not support the argument(s) {', '.join(map(repr, kwargs))}")
        for name, value in (("reward_processing_classes", reward_processing_classes), ("callbacks", callbacks),
                            ("optimizers", optimizers)):
            if value is not None and value != (None, None) and value != []:
                raise ValueError(f"GRPOTrainer: rlvr does not support {name} (rlvr builds its own AdamW and "
                                 "scheduler, has no callbacks, and reads a reward model's tokenizer from its "
                                 "directory); leave it unset")
        self.model_name = _model_name(model)
        model_dir = resolve_model_dir(self.model_name)
        if args is None:
            args = GRPOConfig(output_dir=f"{Path(self.model_name).name}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"GRPOTrainer: args must be rlvr.GRPOConfig, got {type(args).__module__}."
                            f"{type(args).__qualname__}")
        args.check()
        for note in ignored_notes(args):
            print(note)
        self.args = args
        self._model_dir, self._model = model_dir, None
        _check_processing_class(processing_class, model_dir)
        lora = _lora(peft_config, model_dir)

        if train_dataset is None:
            raise ValueError("GRPOTrainer: train_dataset is required (a datasets.Dataset or a list of dicts with a "
                             "prompt column)")
        train_rows = dataset_rows(train_dataset, "train_dataset", args.remove_unused_columns)
        self._train_rows = len(train_rows)
        eval_rows = None if eval_dataset is None else dataset_rows(eval_dataset, "eval_dataset",
                                                                    args.remove_unused_columns)
        if eval_rows is None and plain(args.eval_strategy) != "no":
            raise ValueError(f"GRPOConfig.eval_strategy={plain(args.eval_strategy)!r} needs an eval_dataset (as in "
                             "TRL)")
        if args.max_prompt_length is not None:
            _check_prompt_lengths(model_dir, args.max_prompt_length, train_rows, eval_rows)

        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("GRPOTrainer: reward_funcs is empty; pass at least one reward function")
        entries = [reward_entry(fn, i) for i, fn in enumerate(funcs)]
        names = [e[0] for e in entries]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"GRPOTrainer: reward_funcs lists {twice[0]!r} twice; each needs its own name (its "
                             "metrics are reported under it)")
        weights = [1.0] * len(funcs) if args.reward_weights is None else [float(w) for w in args.reward_weights]
        if len(weights) != len(funcs):
            raise ValueError(f"GRPOConfig.reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
        check = held_out_check(entries)
        unnamed = [f"{name} ({why})" for name, _, _, why in entries if why]
        if unnamed:
            warnings.warn(
                "rlvr: config.yaml cannot name these reward functions in a form `rlvr train OUTPUT_DIR/config.yaml` "
                f"can import: {'; '.join(unnamed)}. This run uses them as they are; to rerun it from the CLI, define "
                "them at the top level of a module (my_rewards.py: my_rewards:my_reward).", UserWarning, stacklevel=2)
        self.rewards = [WeightedReward(name, fn, w) for (name, _, fn, _), w in zip(entries, weights)]
        self.environment, env = environment_objects(tools, environment_factory, args.max_completion_length,
                                                    args.max_tool_calling_iterations)

        out = Path(os.path.normpath(args.output_dir))
        out = out if out.name else out.resolve()
        data_dir = out.with_name(f"{out.name}.data")  # beside the run: a fresh run moves what is inside aside
        train_path = self._data_file(data_dir, "train", dataset_jsonl(train_rows, "train_dataset"))
        if not check:
            eval_path, eval_size = train_path, 0
            print("rlvr: no reward is a correctness check (every one is a reward model, a judge, or none), so no "
                  "held-out accuracy is measured (it counts completions a correctness reward scores 1.0); list such a "
                  "reward first to measure it")
        elif eval_rows is None:
            eval_path, eval_size = train_path, min(len(train_rows), NO_EVAL_DATASET_EVAL_SIZE)
            print(f"rlvr: no eval_dataset: accuracy before and after training is measured on the first {eval_size} "
                  "rows of train_dataset, which are trained on (not held out); pass eval_dataset for a held-out "
                  "measure")
        else:
            eval_path = self._data_file(data_dir, "eval", dataset_jsonl(eval_rows, "eval_dataset"))
            eval_size = len(eval_rows)
        self.rlvr_config = _run_config(args, self.model_name, lora, len(train_rows), str(train_path), str(eval_path),
                                       eval_size, check, [(e[0], e[1], w) for e, w in zip(entries, weights)], env)
        self._summary: dict | None = None
        steps = self.rlvr_config.train.steps * self.rlvr_config.algo.num_iterations
        self.state = TrainerState(max_steps=steps)
        """TRL's trainer state: global_step, max_steps, epoch and, after train(), log_history (metrics.jsonl)."""
        self._processing_class = None

    @property
    def processing_class(self) -> Any:
        """The tokenizer rlvr uses, the one saved in the model's directory."""
        if self._processing_class is None:
            from rlvr.models.policy import load_tokenizer

            self._processing_class = load_tokenizer(self._model_dir)
        return self._processing_class

    @property
    def model(self) -> Any:
        """The policy as a transformers model (loaded on first use): the starting weights before train(), the
        trained ones after it (a peft model under LoRA)."""
        if self._model is None:
            from rlvr.models.policy import load_causal_lm

            saved = Path(self._summary["saved"]) if self._summary and "saved" in self._summary else None
            if saved is not None and saved.name == "model":
                self._model = load_causal_lm(saved)
            else:
                self._model = load_causal_lm(self._model_dir)
                if saved is not None:
                    from peft import PeftModel

                    self._model = PeftModel.from_pretrained(self._model, saved)
        return self._model

    def evaluate(self, eval_dataset: Any = None, **kwargs: Any) -> dict[str, float]:
        """Greedy accuracy of ``model`` (trained, after train()) on the held-out rows, as the run measures it before
        and after training: ``{"eval_accuracy": share correct, "eval_size": prompts}``."""
        if eval_dataset is not None or any(v is not None for v in kwargs.values()):
            raise TypeError("GRPOTrainer.evaluate: rlvr evaluates on the trainer's held-out rows (eval_dataset, or "
                            "the first rows of train_dataset); pass eval_dataset to GRPOTrainer instead")
        from rlvr.run.eval_only import held_out_accuracy

        return held_out_accuracy(self.rlvr_config, self.model, self.environment)

    @staticmethod
    def _data_file(data_dir: Path, split: str, text: str) -> Path:
        """Write a dataset once, named by its content: a file of that name already holds this text, and a later run
        with other data never changes an earlier run's file."""
        path = data_dir / f"{split}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.jsonl"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # every learner of a torchrun job writes its own
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        return path

    def train(self, resume_from_checkpoint: bool | str | None = None, **kwargs: Any) -> TrainOutput:
        """Run rlvr's training (``rlvr.launch.train``) on ``rlvr_config``; returns a ``TrainOutput`` whose
        ``metrics`` is rlvr's run summary (summary.json). ``resume_from_checkpoint``: True continues from the newest
        checkpoint in output_dir, a path from that checkpoint (rlvr's ``resume``)."""
        unsupported = [k for k, v in kwargs.items() if v is not None]
        if unsupported:
            raise TypeError(f"GRPOTrainer.train: rlvr does not support {', '.join(map(repr, unsupported))}")
        cfg = self.rlvr_config
        if resume_from_checkpoint:
            resume = "auto" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            cfg = dataclasses.replace(cfg, resume=resume)
        from rlvr.launch import train

        summary = train(cfg, rewards=self.rewards, environment=self.environment)
        self._summary, self._model = summary, None
        records = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
        losses = [r["update/loss"] for r in records if r.get("step", 0) >= 1 and is_finite_number(r.get("update/loss"))]
        loss = sum(losses) / len(losses) if losses else math.nan
        self.state.global_step = self.state.max_steps
        self.state.epoch = cfg.train.steps * cfg.train.prompts_per_step / max(self._train_rows, 1)
        self.state.log_history = records
        if "saved" in summary:  # rank 0 reports, as rlvr train does
            from rlvr.run.eval_only import accuracy_line

            print(accuracy_line(summary, cfg.output_dir))
        return TrainOutput(self.state.global_step, loss, summary)

    def save_model(self, output_dir: str | None = None) -> Path:
        """Copy the trained weights (OUTPUT_DIR/adapter or OUTPUT_DIR/model, saved by ``train``) into
        ``output_dir`` (default: args.output_dir itself, as TRL saves them there)."""
        if self._summary is None:
            raise RuntimeError("GRPOTrainer.save_model: call train() first (rlvr saves the weights when it ends)")
        target = Path(output_dir or self.args.output_dir)
        if "saved" not in self._summary:  # a learner other than rank 0 of a torchrun job: rank 0 saves
            return target
        source = Path(self._summary["saved"])
        if target.resolve() != source.resolve():
            shutil.copytree(source, target, dirs_exist_ok=True)
        return target


# ---------------------------------------------------------------- distillation (TRL's DistillationTrainer)

# GRPOConfig fields that TRL's DistillationConfig does not have: an error there, as in TRL
_GRPO_ONLY = frozenset({
    "delta", "entropy_coef", "entropy_coef_delta", "entropy_coef_max", "entropy_coef_min", "entropy_target", "epsilon",
    "epsilon_high", "generation_batch_size", "importance_sampling_level", "loss_type", "mask_truncated_completions",
    "max_prompt_length", "multi_objective_aggregation", "num_generations", "num_iterations",
    "off_policy_mask_threshold", "ref_model_mixup_alpha", "ref_model_sync_steps", "reward_weights",
    "sapo_temperature_neg", "sapo_temperature_pos", "scale_rewards", "steps_per_generation", "sync_ref_model",
    "top_entropy_quantile", "use_adaptive_entropy", "use_bias_correction_kl", "vespo_k_neg", "vespo_k_pos",
    "vespo_lambda_neg", "vespo_lambda_pos"})


@dataclass
class DistillationConfig(GRPOConfig):
    """Training settings under the names of TRL 1.16's ``DistillationConfig`` (on-policy distillation, GKD's
    generalised JSD over the whole vocabulary): TRL's training and generation fields as ``GRPOConfig`` takes them,
    plus the ones below; GRPO's own fields (loss_type, num_generations, epsilon, ...) are errors, as in TRL. One
    completion per prompt, no reward and no reference KL: the run is rlvr's distill.objective=jsd with
    distill.reward_weight=0 (docs/concepts/distillation.md)."""

    beta: float = 1.0
    """GKD's beta (distill.beta): 0 the forward KL(teacher || student), 1 the reverse KL (TRL's default), 0.5 the
    symmetric JSD. Not GRPO's KL coefficient: there is no reference model."""
    num_generations: int = 1
    """Not a DistillationConfig field (TRL samples one completion per prompt): fixed at 1."""
    teacher_model_name_or_path: str | None = None
    """The teacher (distill.teacher), when DistillationTrainer gets no teacher_model: an alias or a local directory."""
    teacher_model_revision: str | None = None
    """None only: rlvr loads the teacher from a directory."""
    teacher_model_init_kwargs: dict | None = None
    """None only: the teacher is loaded as the student is (fp32, or bf16 on a bf16 GPU)."""
    disable_dropout: bool = False
    """Accepted; rlvr's LoRA has no dropout unless model.lora_dropout says so."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _DISTILL_FIELDS:
            raise AttributeError(_unsupported_message([name], "DistillationConfig"))
        object.__setattr__(self, name, value)

    def check(self) -> None:
        if not is_finite_number(self.beta) or not 0 <= self.beta <= 1:
            raise ValueError(f"DistillationConfig.beta={self.beta!r}: must be in [0, 1] (GKD's interpolation: 0 "
                             "forward KL, 1 reverse KL)")
        for name in ("teacher_model_revision", "teacher_model_init_kwargs"):
            if getattr(self, name) is not None:
                raise ValueError(f"DistillationConfig.{name}: rlvr loads the teacher from a local directory as it "
                                 "loads the student; leave it None")
        shared = {name: getattr(self, name) for name in _FIELD_NAMES}  # checked as GRPOConfig checks them
        check_config(GRPOConfig(**{**shared, "num_generations": 2, "beta": 0.0,
                                   "per_device_train_batch_size": 2 * self.per_device_train_batch_size}))


_DISTILL_FIELDS = frozenset(f.name for f in dataclasses.fields(DistillationConfig))
_distill_dataclass_init = DistillationConfig.__init__


@functools.wraps(_distill_dataclass_init)
def _distill_init(self: DistillationConfig, *args: Any, **kwargs: Any) -> None:
    unknown = [k for k in kwargs if k not in _DISTILL_FIELDS or k in _GRPO_ONLY]
    if unknown:
        raise TypeError(_unsupported_message(unknown, "DistillationConfig"))
    _distill_dataclass_init(self, *args, **kwargs)


DistillationConfig.__init__ = _distill_init  # type: ignore[method-assign]


class DistillationTrainer(GRPOTrainer):
    """On-policy distillation with TRL 1.16's constructor: the student ``model`` samples one completion per prompt
    of ``train_dataset``, the ``teacher_model`` (an alias, a local directory, or a model loaded from one; else
    ``args.teacher_model_name_or_path``) scores every token, and the student minimises GKD's generalised JSD with
    ``args.beta`` at ``args.temperature``. ``model``, datasets, ``peft_config``, ``processing_class`` and ``tools``
    as ``GRPOTrainer`` takes them. rlvr's addition: ``reward_funcs``, whose first correctness reward measures held-out
    accuracy before and after (never trained on); without it no accuracy is measured. ``callbacks``, ``optimizers``
    and ``quantization_config`` are refused unless unset."""

    def __init__(self, model: Any, teacher_model: Any = None, args: DistillationConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 callbacks: Any = None, optimizers: Any = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: Any = None, reward_funcs: Any = None):
        if quantization_config is not None:
            raise ValueError("DistillationTrainer: rlvr does not quantize models; leave quantization_config unset")
        if args is None:
            args = DistillationConfig(output_dir=f"{Path(_model_name(model)).name}-Distillation")
        if not isinstance(args, DistillationConfig):
            raise TypeError(f"DistillationTrainer: args must be rlvr.DistillationConfig, got "
                            f"{type(args).__module__}.{type(args).__qualname__}")
        if teacher_model is None and not args.teacher_model_name_or_path:
            raise ValueError("DistillationTrainer: pass teacher_model, or set DistillationConfig."
                             "teacher_model_name_or_path")
        args = copy.copy(args)  # the caller's stays as given
        object.__setattr__(args, "teacher_model_name_or_path",
                           _model_name(teacher_model) if teacher_model is not None else args.teacher_model_name_or_path)
        super().__init__(model, reward_funcs if reward_funcs is not None else "no_reward", args, train_dataset,
                         eval_dataset, processing_class, None, callbacks, optimizers, peft_config, tools)


def _model_name(model: Any) -> str:
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    if hasattr(model, "peft_config") and hasattr(model, "disable_adapter"):
        raise ValueError("GRPOTrainer: model is a peft model; pass the base model's directory and the LoRA settings "
                         "as peft_config")
    name = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not isinstance(name, str) or not name or not Path(name).is_dir():
        raise ValueError(f"GRPOTrainer: model must be a built-in alias or a local directory saved with "
                         f"save_pretrained(); rlvr loads models by path, and this {type(model).__name__} was not "
                         f"loaded from a local directory (name_or_path {name!r}): save it with "
                         "model.save_pretrained(DIR) and pass DIR")
    return name


def _check_processing_class(tokenizer: Any, model_dir: Path) -> None:
    """None, or the tokenizer saved in the model's directory: rlvr loads the tokenizer from there."""
    if tokenizer is None:
        return
    name = getattr(tokenizer, "name_or_path", "")
    fix = ("rlvr loads the tokenizer saved in the model's directory; pass processing_class=None, or save yours there "
           "with tokenizer.save_pretrained(MODEL_DIR)")
    if not (isinstance(name, str) and name and Path(name).is_dir() and Path(name).resolve() == model_dir.resolve()):
        raise ValueError(f"GRPOTrainer: processing_class was not loaded from {model_dir} (name_or_path {name!r}); "
                         f"{fix}")
    from rlvr.models.policy import load_tokenizer

    saved = load_tokenizer(model_dir)
    for attr in ("chat_template", "eos_token"):
        if getattr(tokenizer, attr, None) != getattr(saved, attr, None):
            raise ValueError(f"GRPOTrainer: processing_class differs from the tokenizer saved in {model_dir} (its "
                             f"{attr}); {fix}")


def _check_prompt_lengths(model_dir: Path, limit: int, train_rows: list[dict], eval_rows: list[dict] | None) -> None:
    from rlvr.models.policy import load_tokenizer
    from rlvr.models.prompts import prompt_token_ids

    tokenizer = load_tokenizer(model_dir)
    for what, rows in (("train_dataset", train_rows), ("eval_dataset", eval_rows or [])):
        for i, row in enumerate(rows):
            n = len(prompt_token_ids(tokenizer, row["prompt"]))
            if n > limit:
                raise ValueError(f"GRPOConfig.max_prompt_length={limit}: {what} row {i} has a {n}-token prompt. TRL "
                                 "would cut it to its last max_prompt_length tokens; rlvr never cuts prompts: "
                                 "shorten or drop the row, raise max_prompt_length, or set it to None")


# LoraConfig fields rlvr maps (r, lora_alpha, lora_dropout, target_modules) or that describe nothing it trains.
_LORA_MAPPED = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "auto_mapping",
                "peft_version", "base_model_name_or_path", "revision", "runtime_config", "megatron_core"}


def _lora(peft_config: Any, model_dir: Path) -> dict | None:
    """model.lora_* keys of a peft LoraConfig; None for full fine-tuning."""
    if peft_config is None:
        return None
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise TypeError(f"GRPOTrainer: peft_config must be a peft.LoraConfig (rlvr trains LoRA adapters or all "
                        f"weights); got {type(peft_config).__name__}")
    default = LoraConfig()
    other = [f.name for f in dataclasses.fields(LoraConfig) if f.name not in _LORA_MAPPED
             and getattr(peft_config, f.name) != getattr(default, f.name)]
    if other:
        sets = ", ".join(f"{n}={getattr(peft_config, n)!r}" for n in other)
        raise ValueError(f"GRPOTrainer: peft_config sets {sets}; rlvr does not support it (it takes r, lora_alpha, "
                         "lora_dropout and target_modules)")
    task = plain(peft_config.task_type)
    if task not in (None, "CAUSAL_LM"):
        raise ValueError(f"GRPOTrainer: peft_config.task_type={task!r}; GRPO trains a causal LM (CAUSAL_LM)")
    targets = peft_config.target_modules
    if targets is None:  # peft's default modules for the architecture
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        if model_type not in DEFAULTS:
            raise ValueError(f"GRPOTrainer: peft_config.target_modules is None and peft has no default modules for "
                             f"model_type {model_type!r}; name them, or use 'all-linear'")
        targets = DEFAULTS[model_type]
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            raise ValueError(f"GRPOTrainer: peft_config.target_modules={targets!r} is a regular expression; rlvr "
                             f"takes a list of module names or {ALL_LINEAR!r}")
        targets = [ALL_LINEAR]
    return {"lora_r": int(peft_config.r), "lora_alpha": float(peft_config.lora_alpha),
            "lora_dropout": float(peft_config.lora_dropout), "lora_targets": sorted(targets)}


def _batches(optimizer_steps: float, total: int, mu: int) -> int:
    """An interval TRL gives in optimizer steps (below 1: a share of the run's ``total``) in rlvr steps (batches,
    each trained on ``mu`` times), rounded up."""
    steps = math.ceil(optimizer_steps * total) if optimizer_steps < 1 else math.ceil(optimizer_steps)
    return max(1, math.ceil(steps / mu))


def _run_config(a: GRPOConfig, model_name: str, lora: dict | None, n_train: int, train_path: str, eval_path: str,
                eval_size: int, check: str, rewards: list[tuple[str, dict, float]], env: dict) -> RunConfig:
    prompts = a.per_device_train_batch_size * a.gradient_accumulation_steps // a.num_generations
    mu = a.num_iterations
    epoch = max(1, math.ceil(n_train / prompts))  # rlvr steps per pass over train_dataset
    steps = a.max_steps // mu if a.max_steps > 0 else max(1, math.ceil(a.num_train_epochs * n_train / prompts))
    total = steps * mu  # optimizer steps
    warmup = a.warmup_steps if a.warmup_ratio is None else a.warmup_ratio
    warmup_steps = math.ceil(warmup * total) if 0 < warmup < 1 else int(warmup)

    save = plain(a.save_strategy)
    every = {"no": 0, "epoch": epoch, "steps": _batches(a.save_steps, total, mu)}[save]
    keep = a.save_total_limit or ((steps // every if every else 0) + 1)
    evaluation = plain(a.eval_strategy)
    eval_every = {"no": 0, "epoch": epoch,
                  "steps": _batches(a.logging_steps if a.eval_steps is None else a.eval_steps, total, mu)}[evaluation]
    distill = {}
    if isinstance(a, DistillationConfig):  # GKD's JSD alone: no reward trained on, no reference KL
        distill = {"teacher": a.teacher_model_name_or_path, "objective": "jsd", "beta": float(a.beta),
                   "reward_weight": 0.0}
    return build_config({
        "distill": distill,
        "output_dir": a.output_dir,
        "model": {"name": model_name, "lora": lora is not None, **(lora or {}),
                  "autocast": "bf16" if a.bf16 else "none", "gradient_checkpointing": a.gradient_checkpointing},
        "task": {"name": "jsonl", "train_path": train_path, "eval_path": eval_path, "eval_size": eval_size,
                 "eval_reward": check, "system_prompt": ""},
        "rewards": [{"name": name, "weight": weight, "kwargs": kwargs} for name, kwargs, weight in rewards],
        "rollout": {"group_size": a.num_generations, "temperature": float(a.temperature), "top_p": float(a.top_p),
                    "top_k": a.top_k or 0, "max_new_tokens": a.max_completion_length},
        "algo": {"name": "grpo", "preset": "grpo", "scale": scale_name(a.scale_rewards), **_objective(a),
                 "dual_clip": float(a.delta or 0.0), "beta": 0.0 if distill else float(a.beta), "kl_estimator": "k3",
                 "kl_ratio_weighted": bool(a.use_bias_correction_kl),
                 "entropy_coef": float(a.entropy_coef), "top_entropy_quantile": float(a.top_entropy_quantile),
                 "reward_aggregation": a.multi_objective_aggregation,
                 "ref_sync_steps": a.ref_model_sync_steps if a.sync_ref_model else 0,
                 "ref_mixup_alpha": float(a.ref_model_mixup_alpha),
                 "dynamic_sampling": False, "num_iterations": mu, "mask_truncated": a.mask_truncated_completions},
        "train": {"steps": steps, "prompts_per_step": prompts, "micro_batch_size": a.per_device_train_batch_size,
                  "lr": float(a.learning_rate), "warmup_steps": warmup_steps, "weight_decay": float(a.weight_decay),
                  "max_grad_norm": float(a.max_grad_norm), "seed": a.seed, "checkpoint_every": every,
                  "keep_last": keep, "device": "cpu" if a.use_cpu else "auto"},
        "eval": {"every": eval_every,
                 **({"batch_size": a.per_device_eval_batch_size} if a.per_device_eval_batch_size else {})},
        "log": {"trackers": tracker_names(a.report_to), "run_name": a.run_name or "", "progress": not a.disable_tqdm,
                "samples": a.log_completions},
        "env": env,
    })


def _objective(a: GRPOConfig) -> dict:
    """The algo keys of TRL's loss_type, importance_sampling_level and clip fields."""
    objective, aggregation = LOSS_TYPES[plain(a.loss_type)]
    if a.importance_sampling_level == "sequence":
        objective = "gspo"
    high = float(a.epsilon if a.epsilon_high is None else a.epsilon_high)
    if objective == "cispo":  # TRL's epsilon_high is CISPO's absolute cap and it has no lower bound
        return {"objective": objective, "aggregation": aggregation, "eps_low": 1.0, "eps_high": high - 1.0}
    return {"objective": objective, "aggregation": aggregation, "eps_low": float(a.epsilon), "eps_high": high,
            "sapo_tau_pos": float(a.sapo_temperature_pos), "sapo_tau_neg": float(a.sapo_temperature_neg)}
