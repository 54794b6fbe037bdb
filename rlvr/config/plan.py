"""Memory planner: the peak training (and sampling) memory of a GRPO or PPO run, per device, component by component.

Every component is a formula in the model's numbers (layers L, hidden H, MLP width I, attention heads a,
key/value width H_kv = kv_heads * head_dim, vocabulary V, parameters P) and the run's (weights' dtype, optimizer,
LoRA, beta, batch, lengths, micro-batch, checkpointing, devices):

weights        P * w               w = 4 (fp32) or 2 (bf16); + V * H * 4 for a bf16 base under LoRA (the frozen
                                   output layer computes through an fp32 copy: rlvr.models.architecture.output_layer)
reference      P * w               full fine-tuning with a KL term (beta > 0, or PPO's reward KL); 0 under LoRA
                                   (the reference is the base model with the adapter switched off)
trainable      P_t = P (full) or the adapter: r * sum over adapted linears of (in + out), times L
gradients      P_t * g             g = 4 (fp32) or 2 (bf16)
optimizer      P_t * s             AdamW s = 8 (two fp32 moments) (+4: the fp32 master copy under bf16),
                                   8-bit AdamW s = 2, SGD s = 0
critic (PPO)   full: P * w + P * (g + s) + its head; LoRA: a second adapter, P_t * (4 + g + s) + head
activations    sum over a micro-batch's tokens of L * A * e bytes, e = 4 or 2. A, the values Hugging Face's
               Llama saves for backward per token and layer, counted tensor by tensor (tests/test_plan.py):
                   A = 8H + 2H_kv + 4I + a + 2    (norm inputs and outputs, projection inputs, q/k/v, the
                                                   attention output and its log-sum-exp, gate, up, SiLU, product)
                   - 2H + n_lora * r              under LoRA: frozen norm weights keep no normalised copy; each
                                                   adapted linear keeps its r-wide bottleneck (exact for LoRA on
                                                   all linear layers, rlvr's default; an upper bound for fewer,
                                                   whose frozen linears keep no input)
                   + 2(H - H_kv) + L_seq          when the attention has a padding mask (prompts of different
                                                   lengths): keys and values repeated to every head, and the
                                                   mask row over the L_seq keys
               The plain step runs mb completions of P_len + T_len tokens; rlvr's lean step runs u = mb / G
               prompts once (P_len tokens each) and mb completions of T_len tokens that attend to P_len + T_len
               keys and hold their prompt's keys and values (mb * P_len * 2H per layer). With activation
               checkpointing only each layer's input (H per token) is kept, plus one layer's A while it is
               recomputed. PPO's critic runs after the policy's backward, so the peak holds the larger of
               the two (the policy's), not both.
logits         plain step (TRL's way: logits of the completion positions, log-softmax kept for backward):
               mb * T_len * V * 4 saved, and twice that as gradient buffers in backward;
               lean step: never held; a chunk of c tokens exists at a time: 2 * c * V * 4 (logits and
               softmax), plus the fused head's stored output-layer gradient V * H * 4 when it trains (its
               stored input gradients, mb * T_len * H * 4, count as activations)
Sharding over D devices (ZeRO): stage 1 divides the optimizer states, stage 2 also the gradients, stage 3
(FSDP) also the weights (the reference and critic weights too); activations and logits are per device.

The peak of a step is the sum: weights and optimizer states persist; with several micro-batches the gradients
of the earlier ones are held while the last one's activations and logits are alive.

Sampling (the in-process sampler, rlvr/rollout/decode_weights.py) has a peak of its own, ``sampling()``: in a
synchronous run it comes between train steps, never during one. n = B * G / D rows; d = the decoding dtype's bytes
(rollout.precision: bf16 2, fp32 4; auto: the weights' when bf16, else bf16 from 50M parameters, the hardware
assumed to have bf16 units as GPUs do, else fp32):

resident       weights, reference, critic, gradients (the last step's, dropped when the next one starts) and
               optimizer states, as in training (from the second step on)
folded copies  d * (L * sum over copied linears of in * out + V * H when d != w), made when a generation starts
               and freed at its end; the copied linears are the adapted ones, every one when d != w (cast): under
               all-linear LoRA every weight but the embedding and norms, and the output layer when cast.
               rollout.fold_lora=false: 0. auto folds on a GPU while the resident state, the copies, the KV
               cache and the logits leave FOLD_HEADROOM (a quarter) of its memory free (decode_weights.fold_fits)
KV cache       2 * L * n * (P_len + T_len) * H_kv * e    keys and values preallocated for the whole generation,
                                                         in the weights' dtype (rlvr/rollout/kv_cache.py)
logits         n * V * 4 * 2                             one step's fp32 logits while the next step's are computed
                                                         (or the sampler's CDF of the same shape is built)
               + n * V * 2                               the bf16 product before its fp32 cast, when the output
                                                         layer decodes in bf16

Not modelled: the allocator's slack (freed memory it keeps: glibc heap holes on CPU, the CUDA caching
allocator's fragmentation), the framework and library baseline, and attention kernels that save less than the
math path counted here (flash attention); while sampling, the prefill's transients (B prompts of P_len tokens
through one layer at a time), top-k / top-p / temperature's extra [n, V] buffers, and the gathering of ZeRO-3's
sharded weights (the copies are counted whole). Against measured CPU peaks the plain step's plan is close and rlvr's
lean step's falls short by the freed heap glibc keeps (rlvr/platform/memory.py); the planner error per
configuration: BENCHMARKS.md, "Memory: PPO vs GRPO, measured" (benchmarks/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlvr.config.schema import RunConfig
from rlvr.models.policy import ALL_LINEAR
from rlvr.rollout.decode_weights import AUTO_BF16_MIN_PARAMETERS, FOLD_HEADROOM

GB = 1e9


@dataclass(frozen=True)
class Arch:
    """A decoder's numbers (Llama-style: RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        h, i, kv = self.hidden, self.intermediate, self.kv_width
        attention = h * h * 2 + h * kv * 2  # q, o; k, v
        mlp = 3 * h * i
        norms = 2 * h
        embed = self.vocab * h * (1 if self.tied_embeddings else 2)
        return self.layers * (attention + mlp + norms) + embed + h

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        h, i, kv = self.hidden, self.intermediate, self.kv_width
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def adapted(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """The linear layers that LoRA ``targets`` name (``all-linear``: every one)."""
        return tuple(self.linear_shapes()) if tuple(targets) == (ALL_LINEAR,) else tuple(targets)

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in self.adapted(targets))

    def activation_values(self, keys: int, masked: bool, lora_rank: int = 0, lora_linears: int = 0) -> int:
        """Values saved for backward per token and layer (see the module docstring)."""
        a = 8 * self.hidden + 2 * self.kv_width + 4 * self.intermediate + self.heads + 2
        if lora_rank:
            a += -2 * self.hidden + lora_linears * lora_rank
        if masked:
            a += 2 * (self.hidden - self.kv_width) + keys
        return a


# Public configuration numbers of well-known checkpoints.
ARCHS = {
    "smollm2-135m": Arch("SmolLM2-135M", 30, 576, 1536, 9, 3, 49152, tied_embeddings=True),
    "1.5b": Arch("Qwen2.5-1.5B", 28, 1536, 8960, 12, 2, 151936, tied_embeddings=True),
    "7b": Arch("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 152064),
    "8b": Arch("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128256),
    "70b": Arch("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128256),
}
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "sgd": 0}


_DEFAULTS = RunConfig()  # the plan's defaults are the config's: one set


@dataclass(frozen=True)
class PlannedRun:
    """What is trained, how, and on what; every default is the run config's, with its ``auto`` settings resolved as
    on a CUDA device with bf16 units (the device a plan is for)."""

    algo: str = _DEFAULTS.algo.name  # grpo or ppo
    dtype: str = _DEFAULTS.model.dtype  # model.dtype: auto (bf16 base under LoRA, else fp32), fp32, or bf16
    # (bf16 weights, gradients, activations; fp32 optimizer + master)
    optimizer: str = "adamw"  # adamw (rlvr's), adamw_8bit, sgd
    lora_rank: int = _DEFAULTS.model.lora_r if _DEFAULTS.model.lora else 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)  # or names of Arch.linear_shapes
    beta: float = _DEFAULTS.algo.beta  # GRPO's KL coefficient (PPO: the reward's kl_coef)
    prompts: int = _DEFAULTS.train.prompts_per_step  # B
    group: int = _DEFAULTS.rollout.group_size  # G
    prompt_len: int = 64  # a task's prompts (no config field)
    completion_len: int = _DEFAULTS.rollout.max_new_tokens
    micro_batch: int = _DEFAULTS.train.micro_batch_size  # completions per forward/backward
    checkpointing: bool | str = _DEFAULTS.model.gradient_checkpointing  # auto: on, as on a CUDA device
    lean: bool = True  # rlvr's step (prompt once per group, fused output layer); False: the plain step
    padded: bool = True  # prompts of different lengths (a padding mask in attention), as RL batches have
    chunk: int = _DEFAULTS.train.logprob_chunk  # tokens per output-layer chunk (lean step)
    devices: int = 1
    zero: int = 0  # ZeRO stage: 0 none, 1 optimizer, 2 + gradients, 3 + weights (FSDP)
    decode_precision: str = _DEFAULTS.rollout.precision  # rollout.precision: fp32, bf16, auto
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # model.dtype=auto on a bf16 GPU (rlvr.platform.devices.weight_dtype)
            object.__setattr__(self, "dtype", "bf16" if self.lora_rank else "fp32")
        if self.checkpointing == "auto":  # model.gradient_checkpointing=auto on a CUDA device
            object.__setattr__(self, "checkpointing", True)


def _bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def plan(arch: Arch, run: PlannedRun) -> dict[str, float]:
    """Bytes per device of every component at the peak of a training step, and the total."""
    if run.algo not in ("grpo", "ppo"):
        raise ValueError(f"algo must be grpo or ppo, got {run.algo!r}")
    if run.optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_BYTES)}, got {run.optimizer!r}")
    if run.zero not in (0, 1, 2, 3) or run.devices < 1:
        raise ValueError("zero must be 0-3 and devices >= 1")
    w = _bytes(run.dtype)
    lora = run.lora_rank > 0
    P = arch.params
    P_t = arch.lora_params(run.lora_rank, run.lora_targets) if lora else P
    grad_b = 4 if lora else w  # adapters train in fp32
    opt_b = OPTIMIZER_BYTES[run.optimizer] + (4 if run.dtype == "bf16" and not lora else 0)
    d = run.devices
    shard_opt = d if run.zero >= 1 else 1
    shard_grad = d if run.zero >= 2 else 1
    shard_w = d if run.zero >= 3 else 1

    out: dict[str, float] = {}
    head_fp32 = arch.vocab * arch.hidden * 4 if lora and w == 2 else 0  # a frozen bf16 head's fp32 copy
    out["weights"] = (P * w + (P_t * 4 if lora else 0) + head_fp32) / shard_w
    kl = run.beta != 0.0
    out["reference"] = P * w / shard_w if (kl and not lora) else 0.0
    out["gradients"] = P_t * grad_b / shard_grad
    out["optimizer"] = P_t * opt_b / shard_opt
    critic = 0.0
    if run.algo == "ppo":
        head = arch.hidden * 4 * (1 + 1 + 2)  # weight + grad + two moments (fp32, tiny)
        if lora:
            critic = P_t * 4 / shard_w + P_t * grad_b / shard_grad + P_t * opt_b / shard_opt + head
        else:
            critic = P * w / shard_w + P * grad_b / shard_grad + P * opt_b / shard_opt + head
    out["critic"] = critic

    e = _bytes(run.dtype)
    mb = min(run.micro_batch, run.prompts * run.group)
    P_len, T_len = run.prompt_len, run.completion_len
    r, n_lora = (run.lora_rank, len(arch.adapted(run.lora_targets))) if lora else (0, 0)

    def values(keys: int, masked: bool) -> int:
        return arch.activation_values(keys, masked, r, n_lora)

    if run.lean:  # prompts once, completions attending to prompt + completion, the prompt's keys/values per row
        prompts_mb = max(mb // run.group, 1)
        tokens = prompts_mb * P_len + mb * T_len
        per_layer = (prompts_mb * P_len * values(P_len, run.padded) + mb * T_len * values(P_len + T_len, True)
                     + mb * P_len * 2 * arch.hidden)
    else:
        tokens = mb * (P_len + T_len)
        per_layer = tokens * values(P_len + T_len, run.padded)
    if run.checkpointing:
        act = (arch.layers * tokens * arch.hidden + per_layer) * e
    else:
        act = arch.layers * per_layer * e
    out["activations"] = act  # the critic's, run after the policy's backward, are no larger

    t_tokens = mb * run.completion_len
    if run.lean:
        out["activations"] += t_tokens * arch.hidden * 4  # the fused head's stored input gradients
        logits = 2 * min(run.chunk, t_tokens) * arch.vocab * 4  # one chunk's logits and softmax, transient
        logits += arch.vocab * arch.hidden * 4 if not lora else 0  # its stored output-layer gradient
    else:  # the log-softmax kept for backward, and two gradient buffers of that size in backward
        logits = 3 * t_tokens * arch.vocab * 4
    out["logits"] = logits
    out["total"] = sum(out.values())
    return out


def decode_bytes(arch: Arch, run: PlannedRun) -> int:
    """Bytes per weight of the decoding matmuls (rlvr.rollout.decode_weights.decode_dtype): rollout.precision, or
    auto: the weights' when they are bf16, bf16 from AUTO_BF16_MIN_PARAMETERS on (bf16 units assumed), else fp32."""
    if run.decode_precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"decode_precision must be auto, fp32 or bf16, got {run.decode_precision!r}")
    if run.decode_precision != "auto":
        return _bytes(run.decode_precision)
    return 2 if run.dtype == "bf16" or arch.params >= AUTO_BF16_MIN_PARAMETERS else 4


def folded_copies(arch: Arch, run: PlannedRun) -> int:
    """Bytes of the weight copies a folded generation holds (rlvr.rollout.decode_weights.folded_bytes): every
    adapted linear, and every linear plus the output layer when the decoding dtype is not the weights'."""
    d = decode_bytes(arch, run)
    cast = d != _bytes(run.dtype)
    shapes = arch.linear_shapes()
    copied = tuple(shapes) if cast else (arch.adapted(run.lora_targets) if run.lora_rank else ())
    per_layer = sum(shapes[t][0] * shapes[t][1] for t in copied)
    return (arch.layers * per_layer + (arch.vocab * arch.hidden if cast else 0)) * d


def sampling(arch: Arch, run: PlannedRun, fold: bool = True) -> dict[str, float]:
    """Bytes per device of every component at the peak of the sampling phase (the in-process sampler, between two
    train steps), with the LoRA adapters folded into copies of the weights (``fold``) or not, and the total."""
    train = plan(arch, run)
    out = {k: train[k] for k in ("weights", "reference", "critic", "gradients", "optimizer")}
    rows = -(-run.prompts * run.group // run.devices)  # each device samples its share of the B * G completions
    out["folded"] = float(folded_copies(arch, run)) if fold else 0.0
    out["kv_cache"] = (2 * arch.layers * rows * (run.prompt_len + run.completion_len) * arch.kv_width
                       * _bytes(run.dtype))
    head_bytes = decode_bytes(arch, run) if fold else _bytes(run.dtype)
    out["logits"] = rows * arch.vocab * (2 * 4 + (2 if head_bytes == 2 else 0))
    out["total"] = sum(out.values())
    return out


def fold_threshold(arch: Arch, run: PlannedRun) -> float:
    """The smallest device memory (bytes) on which rollout.fold_lora=auto folds: the state resident when a generation
    starts, the copies and the generation's KV cache and logits must leave FOLD_HEADROOM of it free
    (rlvr.rollout.decode_weights.fold_fits)."""
    return sampling(arch, run, fold=True)["total"] / (1.0 - FOLD_HEADROOM)


def auto_folds(arch: Arch, run: PlannedRun, device_memory: float) -> bool:
    """rollout.fold_lora=auto's choice on a GPU of ``device_memory`` bytes (on a CPU it always folds)."""
    return device_memory >= fold_threshold(arch, run)


SAMPLING_ROWS = {"weights": "weights", "reference": "reference", "critic": "critic", "gradients": "gradients",
                 "optimizer": "optimizer", "folded": "folded copies", "kv_cache": "KV cache", "logits": "logits",
                 "total": "total, folded"}


def sampling_table(arch: Arch, runs: dict[str, PlannedRun]) -> str:
    """A markdown table of the sampling phase's components (GB per device), folded, and its total not folded."""
    folded = {name: sampling(arch, r, fold=True) for name, r in runs.items()}
    unfolded = {name: sampling(arch, r, fold=False) for name, r in runs.items()}
    lines = ["| component | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for k, label in SAMPLING_ROWS.items():
        cells = [f"{p[k] / GB:.2f}" if k != "total" else f"**{p[k] / GB:.2f}**" for p in folded.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| total, not folded | " + " | ".join(f"**{p['total'] / GB:.2f}**" for p in unfolded.values())
                 + " |")
    return "\n".join(lines)


def table(arch: Arch, runs: dict[str, PlannedRun]) -> str:
    """A markdown table of every component (GB per device) for several runs."""
    plans = {name: plan(arch, r) for name, r in runs.items()}
    keys = ["weights", "reference", "critic", "gradients", "optimizer", "activations", "logits", "total"]
    lines = ["| component | " + " | ".join(plans) + " |", "|---|" + "---|" * len(plans)]
    for k in keys:
        cells = [f"{p[k] / GB:.2f}" if k != "total" else f"**{p[k] / GB:.2f}**" for p in plans.values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ppo_vs_grpo(arch: Arch, run: PlannedRun) -> tuple[dict, dict, float]:
    """PPO's and GRPO's plans for the same run and the saving (fraction of PPO's peak)."""
    ppo, grpo = plan(arch, replace(run, algo="ppo")), plan(arch, replace(run, algo="grpo"))
    return ppo, grpo, 1.0 - grpo["total"] / ppo["total"]


def resolve_arch(name: str) -> Arch:
    """A named architecture (``1.5b``, ``7b``, ``8b``, ``70b``, ``smollm2-135m``), a built-in model alias, or a
    local model directory (its config.json)."""
    if name.lower() in ARCHS:
        return ARCHS[name.lower()]
    from transformers import AutoConfig

    from rlvr.models.policy import resolve_model_dir

    try:
        directory = resolve_model_dir(name)
    except (FileNotFoundError, ValueError):
        raise ValueError(f"{name!r} is neither a named architecture ({', '.join(ARCHS)}), a built-in alias nor a "
                         "local model directory") from None
    return arch_from_config(AutoConfig.from_pretrained(directory))


def report(arch: Arch, run: PlannedRun) -> str:
    """PPO's and GRPO's components side by side, with the saving, as printed by ``rlvr plan``."""
    ppo, grpo, saving = ppo_vs_grpo(arch, run)
    setting = (f"{arch.name} ({arch.params / 1e9:.2f}B parameters), {run.dtype}, {run.optimizer}, "
               + (f"LoRA r={run.lora_rank}" if run.lora_rank else "full fine-tuning")
               + f", KL {'on' if run.beta else 'off'}, {run.prompts}x{run.group} completions of {run.prompt_len}+"
               f"{run.completion_len} tokens, micro-batch {run.micro_batch}"
               + (", activation checkpointing" if run.checkpointing else "")
               + (", rlvr's lean step" if run.lean else ", plain step")
               + (f", {run.devices} devices with ZeRO-{run.zero}" if run.devices > 1 else ""))
    runs = {"PPO": replace(run, algo="ppo"), "GRPO": replace(run, algo="grpo")}
    rows = -(-run.prompts * run.group // run.devices)
    dtype = "bf16" if decode_bytes(arch, run) == 2 else "fp32"
    thresholds = ", ".join(f"{name} from {fold_threshold(arch, r) / GB:.1f} GB" for name, r in runs.items())
    return (f"{setting}\ntraining step, per device, GB:\n\n" + table(arch, runs)
            + f"\n\nGRPO's saving over PPO: {saving:.0%} ({(ppo['total'] - grpo['total']) / GB:.2f} GB per device)\n"
            + f"\nsampling (in-process, between train steps: {rows} rows of {run.prompt_len}+{run.completion_len} "
            f"tokens, decoding in {dtype}), per device, GB:\n\n" + sampling_table(arch, runs)
            + f"\n\nrollout.fold_lora=auto folds on a GPU with a quarter of its memory free after the copies: "
            f"{thresholds} (always on a CPU)\n")


def arch_from_config(config) -> Arch:
    """An Arch from a Hugging Face config (a local model directory's config.json)."""
    heads = config.num_attention_heads
    return Arch(getattr(config, "name_or_path", "") or config.model_type, config.num_hidden_layers,
                config.hidden_size, config.intermediate_size, heads,
                getattr(config, "num_key_value_heads", None) or heads, config.vocab_size,
                bool(getattr(config, "tie_word_embeddings", False)))
