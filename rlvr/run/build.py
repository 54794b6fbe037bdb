"""Builders shared by ``rlvr train``, ``rlvr eval`` and any runtime: data, rewards, model, optimizer, sampler.

Each takes the config section it needs and returns a ready object; none of them trains or writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from rlvr.config.schema import ModelConfig, RewardConfig, RolloutConfig, RunConfig, TrainConfig
from rlvr.models.policy import (
    LoraSpec,
    load_tokenizer,
    load_trainable,
    model_context,
    resolve_model_dir,
    trainable_parameters,
)
from rlvr.models.prompts import plain_text
from rlvr.platform.devices import weight_dtype
from rlvr.rewards import RewardFn, WeightedReward, build_reward
from rlvr.rollout import LocalSampler, Sampler, SamplingParams
from rlvr.run.scoring import EnvironmentObjects, EnvironmentSetup, build_environment_setup
from rlvr.tasks import fit_prompts, load_extra_eval, load_task


@dataclass
class TaskData:
    train_rows: list[dict]
    eval_rows: list[dict]
    check: RewardFn  # 1.0 means correct (held-out accuracy)
    dropped_prompts: int  # rows skipped for prompts too long for the context (task.drop_long_prompts)
    model_dir: Path
    tokenizer: object
    env_setup: EnvironmentSetup | None = None  # multi-turn episodes (env.factory, env.tools or env.url set)
    extra_rows: list[dict] = field(default_factory=list)  # eval.extra_path's held-out rows (none: [])
    task_rows: list[dict] = field(default_factory=list)  # every training row before a DiLoCo learner's shard
    check_name: str = ""  # the reward ``check`` was built from (task.eval_reward, or the task's default)

    def close(self) -> None:
        """Release what the episodes' tools hold (nothing without episodes)."""
        if self.env_setup is not None:
            self.env_setup.close()


def lora_spec(model: ModelConfig) -> LoraSpec | None:
    if not model.lora:
        return None
    return LoraSpec(r=model.lora_r, alpha=model.lora_alpha, dropout=model.lora_dropout,
                    target_modules=model.lora_targets)


def load_data(cfg: RunConfig, environment: EnvironmentObjects | None = None) -> TaskData:
    """Rows, correctness check and tokenizer; prompt lengths are checked here, before any model loads, so bad
    input fails fast."""
    train_rows, eval_rows, check_name = load_task(cfg.task)
    extra_rows = load_extra_eval(cfg.task, cfg.eval.extra_path) if cfg.eval.extra_path else []
    if not cfg.task.chat_template:  # base models: chat messages become a plain Q:/A: transcript
        train_rows, eval_rows, extra_rows = ([{**r, "prompt": plain_text(r["prompt"])} for r in rows]
                                             for rows in (train_rows, eval_rows, extra_rows))
    check = build_reward(check_name)
    model_dir = resolve_model_dir(cfg.model.name)
    tokenizer = load_tokenizer(model_dir)
    if cfg.task.chat_template:  # strings are sent as they are (rlvr.models.prompts); a chat model rambles on bare text
        import sys

        from rlvr.models.prompts import bare_string_warning

        warning = bare_string_warning(tokenizer, [r["prompt"] for r in (*train_rows, *eval_rows)])
        if warning:
            print(f"rlvr: warning: {warning}", file=sys.stderr, flush=True)
    columns = sorted({k for r in train_rows[:1] for k in r})
    setup = build_environment_setup(cfg.env, tokenizer, columns, environment)  # validated before the model loads
    budget = "env.max_episode_tokens" if setup else "rollout.max_new_tokens"  # the prompt, then this much
    room = model_context(model_dir) - (cfg.env.max_episode_tokens if setup else cfg.rollout.max_new_tokens)
    if setup:  # reset's text joins the prompt only when an episode starts: checked there against the same room
        setup.max_prompt_tokens = room
    encode = setup.prompt_ids if setup else None  # episodes: with the tools described
    train_rows, dropped_train = fit_prompts(tokenizer, train_rows, room, cfg.task.drop_long_prompts, "train",
                                            encode, budget)
    task_rows = train_rows
    if cfg.diloco.learner and cfg.diloco.rollouts != "step":
        # a DiLoCo learner trains its own shard: the rows whose index (once fitted) is k modulo K; under
        # diloco.rollouts=step the learners split each step's batch instead (rlvr/run/shared_rollouts.py)
        from rlvr.config.diloco import parse_learner

        k, learners = parse_learner(cfg.diloco.learner)
        task_rows, train_rows = train_rows, train_rows[k::learners]
    eval_rows, dropped_eval = fit_prompts(tokenizer, eval_rows, room, cfg.task.drop_long_prompts, "eval", encode,
                                          budget)
    dropped_extra = 0
    if extra_rows:
        extra_rows, dropped_extra = fit_prompts(tokenizer, extra_rows, room, cfg.task.drop_long_prompts,
                                                "eval.extra_path", encode, budget)
    return TaskData(train_rows, eval_rows, check, dropped_train + dropped_eval + dropped_extra, model_dir, tokenizer,
                    setup, extra_rows, task_rows, check_name)


def build_rewards(rewards: tuple[RewardConfig, ...], device: str = "cpu") -> list[WeightedReward]:
    """The configured reward functions; an in-process reward model (or similarity's encoder) that names no device
    of its own runs on ``device`` (train.device: beside the policy)."""
    out = []
    for r in rewards:
        kwargs = {**r.kwargs, **({"model": r.model} if r.model else {})}
        if r.name in ("reward_model", "similarity") and not kwargs.get("base_url"):
            kwargs.setdefault("device", device)
        out.append(WeightedReward(r.name, build_reward(r.name, kwargs), r.weight, r.on_error, r.timeout_s))
    return out


def build_policy(model_dir: Path, model: ModelConfig, device: torch.device | None = None) -> nn.Module:
    """The policy on ``device`` (default: the CPU) with its weights in model.dtype and activation checkpointing
    (model.gradient_checkpointing) resolved for that device."""
    device = torch.device("cpu") if device is None else device
    checkpointing = model.gradient_checkpointing
    if checkpointing == "auto":
        checkpointing = device.type == "cuda"
    return load_trainable(model_dir, lora_spec(model), checkpointing, device,
                          weight_dtype(model.dtype, device, model.lora))


def build_optimizer(model: nn.Module, train: TrainConfig, params: list | None = None) -> torch.optim.Optimizer:
    """AdamW over ``params`` (default: the model's trainable parameters): torch's fused kernel when they all live on
    CUDA (one launch per step instead of several per parameter, as Hugging Face's Trainer defaults to there); the
    CPU keeps the for-each implementation its recorded runs used."""
    params = trainable_parameters(model) if params is None else params
    return torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay, fused=fused_adamw(params) or None)


def fused_adamw(params: list) -> bool:
    """Whether AdamW over ``params`` (tensors, or param-group dicts) takes the fused CUDA kernel."""
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(p.device.type == "cuda" for p in tensors)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over train.warmup_steps optimizer steps, then constant."""
    warmup = train.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)


def retune_optimizer(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, train: TrainConfig
) -> None:
    """Apply the configured lr and weight decay to restored optimizer/scheduler state (a checkpoint restores the
    values it was saved with); the warmup schedule already comes from ``train`` via ``build_scheduler``."""
    scheduler.base_lrs = [train.lr for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(max(scheduler.last_epoch, 0))
        group["weight_decay"] = train.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def sampling_params(rollout: RolloutConfig, max_new_tokens: int | None = None, greedy: bool = False) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if greedy else rollout.temperature,
        top_p=1.0 if greedy else rollout.top_p,
        top_k=0 if greedy else rollout.top_k,
        max_new_tokens=max_new_tokens or rollout.max_new_tokens,
        stop=tuple(rollout.stop),
    )


def build_local_sampler(cfg: RunConfig, model: nn.Module, tokenizer, learners: int = 1) -> Sampler:
    """Completions from ``model`` itself, in this process (one of ``learners`` under torchrun)."""
    from rlvr.learn.sharding import sampled_on_whole_weights

    seeds = cfg.rollout.per_completion_seeds
    sampler = LocalSampler(model, tokenizer, cfg.model.autocast, precision=cfg.rollout.precision,
                           fold_lora=cfg.rollout.fold_lora,
                           per_completion_seeds=learners > 1 if seeds == "auto" else seeds)
    return sampled_on_whole_weights(model, sampler)  # sharded weights (FSDP2): gathered for each generation


def _server_sampler(cfg: RunConfig, model: nn.Module, tokenizer, run_dir: Path, learners: int) -> Sampler:
    """The rollout servers rollout.servers, with the key rollout.api_key_env names."""
    from rlvr.rollout.http_client import api_key_from_env

    r = cfg.rollout
    return build_remote_sampler(cfg, model, tokenizer, run_dir, r.servers, api_key_from_env(r.api_key_env))


def _colocated_sampler(cfg: RunConfig, model: nn.Module, tokenizer, run_dir: Path, learners: int) -> Sampler:
    """A vLLM engine in this process, built from the model's own directory (rollout.vllm_*)."""
    from rlvr.models.architecture import unwrap
    from rlvr.platform.devices import model_device
    from rlvr.rollout.colocated import ColocatedSampler, EngineSettings, build_engine

    r, device = cfg.rollout, model_device(model)
    kv_gb = r.vllm_kv_cache_gb or (1.0 if device.type == "cpu" else 0.0)
    settings = EngineSettings(
        model_dir=str(resolve_model_dir(cfg.model.name)),
        dtype=unwrap(model).get_input_embeddings().weight.dtype,
        lora_rank=cfg.model.lora_r if cfg.model.lora else 0, seed=cfg.train.seed, device_type=device.type,
        sleep_level=r.vllm_sleep_level, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        kv_cache_bytes=int(kv_gb * (1 << 30)) if kv_gb else None, max_model_len=r.vllm_max_model_len or None,
        distributed=learners > 1)
    return ColocatedSampler(model, tokenizer, build_engine(settings), settings)


@dataclass(frozen=True)
class SamplerBackend:
    """A value of ``rollout.backend``: how a synchronous run's sampler is built, and what the run must know of it.
    A new backend is its own builder and one row of SAMPLER_BACKENDS (and its name in the config's BACKENDS)."""

    build: object  # (cfg, model, tokenizer, run_dir, learners) -> Sampler
    in_process: bool  # samples the training model's own weights (rollout.fold_lora applies)
    publishes_adapters: bool  # loads each new adapter on servers (several learners: rank 0 publishes)


SAMPLER_BACKENDS = {
    "local": SamplerBackend(lambda cfg, model, tokenizer, run_dir, learners: build_local_sampler(
        cfg, model, tokenizer, learners), in_process=True, publishes_adapters=False),
    "server": SamplerBackend(_server_sampler, in_process=False, publishes_adapters=True),
    "vllm_colocate": SamplerBackend(_colocated_sampler, in_process=False, publishes_adapters=False),
}


def build_sampler(cfg: RunConfig, model: nn.Module, tokenizer, run_dir: Path, learners: int = 1) -> Sampler:
    """Where a synchronous run's completions come from (``rollout.backend``: SAMPLER_BACKENDS)."""
    return SAMPLER_BACKENDS[cfg.rollout.backend].build(cfg, model, tokenizer, run_dir, learners)


def build_remote_sampler(cfg: RunConfig, model: nn.Module, tokenizer, run_dir: Path, urls, api_key: str | None, *,
                         resolve=None, startup_s: float = 0.0, keep_versions: int = 0, max_attempts: int = 4,
                         probe_interval_s: float = 5.0) -> Sampler:
    """A sampler over rollout servers at ``urls`` that load the trainer's adapter from the bucket (rollout.bucket,
    default the run's adapters/ folder); waits until they answer (at least ``startup_s`` for servers this run
    started). ``resolve``: how to find a restarted server again (Ray)."""
    from rlvr.rollout.pool import ServerPool
    from rlvr.rollout.remote_sampler import RemoteSampler
    from rlvr.store.bucket import AdapterBucket

    r = cfg.rollout
    pool = ServerPool(urls, api_key=api_key, request_timeout_s=r.request_timeout_s, resolve=resolve,
                      no_server_wait_s=r.server_wait_s, probe_interval_s=probe_interval_s, max_attempts=max_attempts)
    pool.wait_ready(max(r.server_wait_s, startup_s))
    bucket = AdapterBucket(r.bucket or run_dir / "adapters")
    return RemoteSampler(pool, tokenizer, model, bucket, keep_versions=keep_versions or r.keep_versions)
