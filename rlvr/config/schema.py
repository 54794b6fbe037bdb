"""Run configuration: its sections as frozen dataclasses, one docstring per field.

Each section checks its own fields in ``__post_init__`` (a field typed ``Literal[...]`` holds one of those values);
reading a config from YAML and overrides, and the checks across sections, are rlvr/config/loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlvr.config.algo import PRESETS, AlgoConfig
from rlvr.config.checks import at_least, check_choices, switch
from rlvr.config.diloco import DilocoConfig
from rlvr.core.ppo import PPOSettings
from rlvr.models.policy import ALL_LINEAR
from rlvr.platform.devices import DTYPES, check_device_spec, weight_dtype
from rlvr.rewards.base import ON_ERROR
from rlvr.rollout.decode_weights import PRECISIONS
from rlvr.rollout.http_client import API_KEY_ENV

ARITHMETIC_SYSTEM_PROMPT = "Reply with only the number."
TASKS = ("arithmetic", "word_problems", "tool_problems", "jsonl", "math_jsonl", "code_jsonl", "hf")

# The values of the fields typed Literal[...] below: check_choices checks them, the docs list them.
AUTOCAST, RUNTIMES, TRANSPORTS = ("auto", "none", "bf16"), ("embedded", "ray"), ("ws", "http")
BACKENDS = ("local", "server", "vllm_colocate")
ANSWER_FORMATS, PROBLEM_KINDS = ("raw", "gsm8k", "math"), ("products", "word", "two_step")
GRAMMARS = ("varied", "simple", "mixed")
DISTILL_OBJECTIVES = ("sampled_kl", "jsd")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """Built-in alias (smollm2-135m-instruct) or a local directory saved with save_pretrained()."""
    lora: bool = True
    """Train LoRA adapters (reference = adapter disabled) instead of all weights."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)
    """Names of the linear modules that get adapters (e.g. [q_proj, v_proj]), or all-linear: every linear layer of the
    decoder whatever its naming scheme (fused qkv_proj, query_key_value, ...) and the stacked expert weights of MoE
    layers; never the output layer; MoE routers stay frozen."""
    autocast: Literal[AUTOCAST] = "auto"
    """none (fp32) or bf16: run generation and training matmuls under bf16 autocast (fp32 master weights;
    log-probs, the output layer and the loss stay fp32). Only worth it where the hardware has bf16 units (AMX,
    GPUs). auto: bf16 for fp32 weights on a CUDA card with bf16 units (full fine-tuning there; TRL's default too),
    none elsewhere, the CPU included."""
    gradient_checkpointing: bool | str = "auto"
    """Recompute each layer's activations in backward: far less memory for about one extra forward pass. auto: on
    for a CUDA device (where memory is what runs out; TRL's default), off on the CPU (where time is)."""
    dtype: Literal[DTYPES] = "auto"
    """The weights' dtype: auto is bf16 for the frozen base under LoRA on a GPU with bf16 units (compute capability
    8.0+) and fp32 everywhere else, the CPU included; fp32; or bf16 (LoRA only: full fine-tuning would step bf16
    weights - use model.autocast=bf16 there). LoRA parameters, optimizer state, log-probs and the loss stay fp32
    either way (docs/concepts/devices.md)."""

    def __post_init__(self) -> None:
        check_choices(self)
        switch(self, "gradient_checkpointing")
        if self.dtype == "bf16" and not self.lora:
            weight_dtype("bf16", torch.device("cpu"), lora=False)  # raises, saying why and what to use instead
        at_least(self, 1, "lora_r")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0; got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1); got {self.lora_dropout}")


@dataclass(frozen=True)
class TaskConfig:
    name: Literal[TASKS] = "arithmetic"
    """arithmetic or word_problems (generated from the seed); jsonl, math_jsonl (needs an answer column) or
    code_jsonl (needs test columns), read from train_path / eval_path (or train_path split by eval_fraction); hf: any
    Hugging Face datasets source (task.source). Both kinds read rows through the column map (docs/data.md)."""
    digits: int = 1
    """arithmetic: digits per operand (1 means 0-9)."""
    operators: tuple[str, ...] = ("+", "*")
    """arithmetic: operators drawn from + - * (the default + and * with 1 digit: 200 questions, 100 held out)."""
    eval_size: int = 100
    """Held-out questions (arithmetic: carved out of the question space; jsonl: first rows of eval_path; hf: first
    rows of eval_split, or rows held out of train_split when eval_split is ''; with eval_fraction: the first of the
    rows it holds out)."""
    eval_fraction: float = 0.0
    """jsonl tasks and hf: hold out this share (0-1) of the rows of train_path / train_split instead of reading an
    eval file or split: round(share x rows) rows chosen by task.seed, never trained on (0: off). Leave eval_path
    empty, and eval_split unset (it becomes ''); each side needs at least one row."""
    train_size: int = 0
    """arithmetic: training questions to keep (0: all that are not held out); word_problems: rows (0: 2,000); hf:
    the first rows of train_split to read (0: all; needed with streaming)."""
    seed: int = 1234
    """arithmetic, word_problems: seed of the questions (separate from train.seed, so every run shares one
    held-out set); hf and jsonl tasks: seed of the rows held out of the training rows (eval_fraction, or hf with
    eval_split '')."""
    system_prompt: str = ARITHMETIC_SYSTEM_PROMPT
    """arithmetic, word_problems: system message of every prompt (empty for none); hf and jsonl tasks: the system
    message put before a question string (a prompt_column other than prompt, or prompt_template). word_problems,
    hf, jsonl and math_jsonl replace the arithmetic default with their own step-by-step instruction, code_jsonl
    with none."""
    train_steps: tuple[int, ...] = (1, 2)
    """word_problems: operations per training problem, drawn from this list (1-4 in the varied grammar, 1-3 in the
    simple one)."""
    eval_steps: tuple[int, ...] = (2,)
    """word_problems: operations per held-out problem (held-out problems come from stories never trained on)."""
    few_shot: int = 2
    """word_problems, tool_problems: worked examples (0-2) shown before each question as earlier chat turns."""
    problem_kind: Literal[PROBLEM_KINDS] = "two_step"
    """tool_problems: the questions - products (bare a * b), word (one product told as a story) or two_step (a
    product plus or minus a third number, in a story); operands 12-99, held-out products never trained on."""
    example_kind: str = ""
    """tool_problems: the kind of the worked examples ('' = task.problem_kind)."""
    chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template; false renders them as a plain transcript
    (system paragraph, 'Q: ...' / 'A: ...' turns, ending in 'A:') for base models trained without one (e.g.
    gemma3-270m; pair it with rollout.stop so the model stops after its answer). String prompts are sent as they
    are either way; true with a model that has a chat template warns about them (a chat model given bare text tends
    to ramble)."""
    max_number: int = 40
    """word_problems: largest starting amount (added amounts up to 3/4 of it; multipliers 2-5)."""
    curriculum: tuple[int, ...] = ()
    """word_problems (or any task whose rows have a steps column): train first on problems with this many
    operations, stage by stage, e.g. [1, 2]: one-operation problems, then two, then task.train_steps; a stage ends
    when the first reward's mean reaches task.curriculum_pass_rate on 3 steps in a row, or after
    task.curriculum_stage_steps steps (the synchronous loop only; () for none)."""
    curriculum_pass_rate: float = 0.5
    """task.curriculum: the pass rate (first reward's mean over the step's samples) that ends a stage."""
    curriculum_stage_steps: int = 20
    """task.curriculum: the most steps a stage lasts."""
    grammar: Literal[GRAMMARS] = "varied"
    """word_problems: varied (groups, prices, units, two events in a sentence, events out of order, distractors,
    differences; 1-4 operations; held out by setting and by phrasing) or simple (one operation per sentence, 1-3;
    held out by story; the grammar of docs/experiments/word_problems.md runs A-K) or mixed (1-3 operations: each
    training row simple or varied with equal odds, the simple ones free of the varied held-out settings and of the
    words only its held-out phrasings use; held out and prompted like varied)."""
    train_path: str = ""
    """jsonl tasks: training rows, one JSON object per line (prompt or messages, or the columns the column map
    names: prompt_column, answer_column; docs/data.md)."""
    eval_path: str = ""
    """jsonl tasks: held-out rows in the same format ('' with eval_fraction)."""
    drop_long_prompts: bool = False
    """Skip (and count) prompts that leave no room for rollout.max_new_tokens in the model's context,
    instead of stopping with an error naming the row."""
    eval_reward: str = ""
    """Reward whose value 1.0 means 'correct' for held-out accuracy ('' = arithmetic_correct for
    arithmetic, code_tests for code_jsonl, math_correct otherwise)."""
    source: str = ""
    """hf: a local parquet / arrow / json / jsonl / csv file or glob, a directory of such files (splits from the
    file names: train.parquet, test.parquet), a directory written by save_to_disk, or a Hub dataset id (only where
    the Hub is reachable; otherwise download it elsewhere and point here at the local copy)."""
    subset: str = ""
    """hf: the dataset's configuration, load_dataset's name (e.g. main for GSM8K on the Hub; '' = default)."""
    train_split: str = "train"
    """hf: split the training rows come from."""
    eval_split: str = "test"
    """hf: split the held-out rows come from ('' = hold out eval_size rows of train_split, chosen by task.seed)."""
    prompt_column: str = "prompt"
    """hf and jsonl tasks: column holding the prompt. The column prompt (or messages) is read as TRL reads it: a
    string is sent as it is, chat messages [{role, content}, ...] as they are. Any other column (GSM8K: question)
    holds a question: a string is sent as the user message after task.system_prompt, chat messages as they are."""
    prompt_template: str = ""
    """hf and jsonl tasks: the prompt as a template over columns instead of prompt_column, e.g. 'Question:
    {question}' (literal braces doubled: {{ }}); the result is a question string (user message after
    task.system_prompt)."""
    answer_column: str = "answer"
    """hf and jsonl tasks: column holding the gold answer, copied to the answer column reward functions read after
    answer_format ('' = none: rewards read the source columns themselves). Required on every row for hf and
    math_jsonl, or when named or given an answer_format; otherwise an answer column is passed on as it is."""
    answer_format: Literal[ANSWER_FORMATS] = "raw"
    """hf and jsonl tasks: raw (the column as is), gsm8k (the text after ####, thousands separators removed) or math
    (the last \\boxed{...} or \\fbox{...}, nested braces kept)."""
    streaming: bool = False
    """hf: read rows as a stream (datasets streaming=True), only the first train_size (+ eval_size) of them,
    instead of loading or converting the whole source first."""

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "digits", "curriculum_stage_steps")
        at_least(self, 0, "eval_size", "train_size", "few_shot")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in [0, 1) (the share of the training rows held out; 0: off); "
                             f"got {self.eval_fraction}")
        if not 0 < self.curriculum_pass_rate <= 1:
            raise ValueError(f"curriculum_pass_rate must be in (0, 1]; got {self.curriculum_pass_rate}")


@dataclass(frozen=True)
class RewardConfig:
    name: str = "arithmetic_correct"
    """Built-in reward (arithmetic_correct, math_correct, format) or 'package.module:function'."""
    weight: float = 1.0
    """Weight of this function in the total reward."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the built-in factory or bound to the user function."""
    on_error: Literal[ON_ERROR] = "raise"
    """When the function raises or times out: raise (stop with an error naming it) or none (score the batch
    None for this function, excluded and counted)."""
    timeout_s: float = 0.0
    """Seconds one call may take (0: no limit); exceeding it counts as an error."""
    model: str = ""
    """For reward_model and judge: the model that scores (a directory or Hub id for a reward model; the served
    model's name for a judge); passed to the built-in as its ``model`` argument."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.model and "model" in self.kwargs:
            raise ValueError(f"reward {self.name!r}: give the model once, as model: or as kwargs.model, not both")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (0: no limit); got {self.timeout_s}")


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    """G: completions sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 disables)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 32
    """Completion length cap; a completion without EOS by then counts as truncated."""
    stop: tuple[str, ...] = ()
    """Stop strings: a completion ends with the token that completes one of them (kept in the completion)."""
    precision: Literal[PRECISIONS] = "auto"
    """Decoding matmuls (the in-process sampler, and the rollout servers the run starts): fp32; bf16 (bf16 copies of
    the weights, activations and the sampled distribution fp32; the importance weight corrects the log-prob gap); or
    auto: bf16 for a model of 50M+ parameters where the hardware has bf16 matmul units (AMX, AVX512-BF16, CUDA), fp32
    otherwise. LoRA adapters are folded into the decoding weights (rollout.fold_lora); without folding the sampler
    decodes in the model's own dtype."""
    per_completion_seeds: bool | str = "auto"
    """Draw each completion's tokens from a generator of its own, seeded by the completion's position in the step's
    batch, instead of one generator for the batch: then how the batch is split (over the learners of a torchrun
    job, or its micro-batches) cannot change what is sampled. auto: on with several learners, off in one process
    (one generator: one draw for the whole batch, slightly faster decoding; the demo's recorded numbers)."""
    fold_lora: bool | str = "auto"
    """The in-process sampler decodes with each LoRA adapter folded into a copy of its layer's weight (one matmul a
    layer instead of three); the copy is made when a generation starts and freed when it ends, and costs the size of
    every adapted weight (269 MB at 135M in bf16, ~13 GB for a 7B model). true, false, or auto: on a GPU, fold
    only while a quarter of the device's memory stays free after the copies and the generation's KV cache and
    logits (`rlvr plan` counts them); on the CPU, always. Samples are the same either way up to rounding."""
    backend: Literal[BACKENDS] = "local"
    """local: sample from the training model in this process; server: sample on rollout servers (rlvr serve or
    vLLM) over HTTP, with the LoRA adapter published to rollout.bucket and loaded by every server after each
    update; vllm_colocate: a vLLM engine in the learner's process (the one-GPU recipe), the weights pushed to it in
    memory after each update and, on CUDA, asleep while the learner steps (rollout.vllm_*)."""
    vllm_sleep_level: int = 1
    """backend=vllm_colocate, on CUDA: what the engine releases while the learner steps: 0 nothing; 1 its KV cache
    (its weights copied to host memory); 2 both (LoRA's base weights are pushed again from the learner at each
    wake). vLLM's CPU build has no sleep mode: there the setting is skipped, with a warning."""
    vllm_gpu_memory_utilization: float = 0.3
    """backend=vllm_colocate: the engine's share of the GPU's memory (weights, KV cache, activations); the
    learner has the rest. Unused when rollout.vllm_kv_cache_gb sets the KV cache's size."""
    vllm_kv_cache_gb: float = 0.0
    """backend=vllm_colocate: the engine's KV cache in GiB; 0 = on CUDA from rollout.vllm_gpu_memory_utilization,
    on the CPU 1 GiB (vLLM's CPU build would otherwise reserve that share of the host's memory)."""
    vllm_max_model_len: int = 0
    """backend=vllm_colocate: tokens per sequence (prompt and completion) the engine plans for; 0 = the model's
    own limit."""
    servers: tuple[str, ...] = ()
    """backend=server: base URLs of the rollout servers, e.g. [http://10.0.0.5:8000, http://10.0.0.6:8000]."""
    bucket: str = ""
    """backend=server: where adapters are published, a directory or an fsspec URL (s3://..., gs://...) the
    servers can read ('' = OUTPUT_DIR/adapters, for servers on this machine or a shared disk)."""
    keep_versions: int = 2
    """backend=server: adapter versions kept loaded on the servers and in the bucket."""
    request_timeout_s: float = 600.0
    """backend=server: seconds one generation request may take, all of it (connecting, generating, reading the
    answer), before it is retried on another server."""
    api_key_env: str = API_KEY_ENV
    """backend=server, or async with rollout.servers: the name of the environment variable that holds the servers'
    API key (sent as Authorization: Bearer KEY, as rlvr serve --api-key and vLLM --api-key expect); the key itself
    never goes into a config file. Unset or empty variable: no key is sent. Servers the learner starts get a random
    key of their own per run."""
    server_wait_s: float = 300.0
    """backend=server: seconds to wait for servers to come up, and for any server at all to be reachable
    again before the run stops with an error."""

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "group_size", "max_new_tokens", "keep_versions")
        at_least(self, 0, "temperature", "top_k", "server_wait_s", "vllm_kv_cache_gb", "vllm_max_model_len")
        if self.vllm_sleep_level not in (0, 1, 2):
            raise ValueError(f"vllm_sleep_level must be 0, 1 or 2; got {self.vllm_sleep_level}")
        if not 0 < self.vllm_gpu_memory_utilization < 1:
            raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1); got {self.vllm_gpu_memory_utilization}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0; got {self.request_timeout_s}")
        switch(self, "fold_lora")
        switch(self, "per_completion_seeds")


PPOConfig = PPOSettings  # the ppo section: its fields are documented and checked in rlvr.core.ppo


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 60
    """Training steps (each: sample, score, update)."""
    prompts_per_step: int = 8
    """B: prompts per step (the batch is B * G completions)."""
    micro_batch_size: int = 16
    """Completions per forward/backward; does not change the update."""
    lr: float = 5e-4
    """AdamW learning rate (after warmup)."""
    warmup_steps: int = 0
    """Linear warmup of the learning rate over this many optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    threads: int = 0
    """torch intra-op threads (0: all cores)."""
    device: str = "auto"
    """Where the policy, the reference, the optimizer state, PPO's critic, the in-process sampler and the train step
    live: auto (the current CUDA device when one is visible, else the CPU), cpu, cuda, cuda:N or mps. Rewards,
    verifiers and environments always run on the CPU (docs/concepts/devices.md). Under torchrun every learner
    takes cuda:LOCAL_RANK for auto and cuda."""
    shard_weights: bool | str = "auto"
    """Several learners (torchrun): shard the trained weights, their gradients and the optimizer state across the
    learners with FSDP2 (each decoder layer its own group, gathered for its forward and backward, then freed), so
    a learner holds about 1/N of them; false: every learner holds a whole replica and the gradients are all-reduced
    once per step. auto: sharded for full fine-tuning, replicated under LoRA (the adapter is small; the frozen base
    can be sharded too with true). One process: ignored. docs/concepts/distributed.md."""
    collective_timeout_s: float = 600.0
    """Several learners (torchrun): seconds any collective (gathering a step's groups, summing gradients) may wait
    for the other ranks before the job stops with an error; a rank that died ends the others within it."""
    heap_threshold_kb: int = 0
    """glibc's malloc only (the rlvr command runs on mimalloc where installed: platform/allocator.py): allocations of at
    least this many KiB are mmapped and returned when freed (platform/memory.py); 0 keeps glibc's defaults. 512 lowers
    a LoRA step's peak RSS under glibc, at a cost in step time where page faults are slow; 256 lowers the lean step's
    peak a little more, at a further cost on small batches (figures: docs/experiments/performance.md, "The train
    step and the allocator")."""
    logprob_chunk: int = 512
    """Tokens per output-layer chunk when computing log-probs; fewer for a large vocabulary, so one chunk's logits
    stay within 32M elements (128 MB in fp32; Gemma 3's 262k vocabulary gets 128)."""
    checkpoint_every: int = 10
    """Write a checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    keep_last: int = 2
    """Checkpoints to keep (the newest complete one is never deleted)."""
    max_consecutive_skips: int = 3
    """Stop after this many consecutive steps whose updates were all skipped as non-finite."""

    def __post_init__(self) -> None:
        check_device_spec(self.device)
        switch(self, "shard_weights")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0; got {self.collective_timeout_s}")
        at_least(self, 1, "steps", "prompts_per_step", "micro_batch_size", "logprob_chunk", "keep_last",
                  "max_consecutive_skips")
        at_least(self, 0, "warmup_steps", "weight_decay", "max_grad_norm", "threads", "heap_threshold_kb",
                  "checkpoint_every")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr} (a learning rate of 0 trains nothing)")


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Greedy held-out evaluation every this many steps (0: only before and after training)."""
    on_start: bool = True
    """Evaluate the starting weights before the first step (TRL: eval_on_start); false skips it (runs of one model
    that differ only after step 0 need it once)."""
    batch_size: int = 64
    """Prompts per evaluation batch."""
    max_new_tokens: int = 0
    """Completion cap during evaluation (0: rollout.max_new_tokens)."""
    extra_path: str = ""
    """A second held-out set, evaluated beside the task's at every evaluation (eval/extra_accuracy): a JSONL file.
    word_problems: rows of question and answer, each question put into the task's prompt (system message and
    worked examples), e.g. examples/data/word_problems_independent.jsonl; jsonl tasks: rows like
    task.eval_path's."""
    metrics: tuple[RewardConfig, ...] = ()
    """Measures of the held-out replies that the run never trains on, each logged as eval/metric/NAME (its mean over
    the replies it scored) at every evaluation: a judge of another model or family asked whether the reply does what
    the message asks, a lexicon, any reward function (entries as in rewards; weight unused). Every evaluation also
    logs the run's own rewards on the held-out replies (eval/reward/NAME, eval/reward), their mean length, and the
    truncated and refusing shares."""
    gaming_rise: float = 0.1
    """The gaming check (rlvr/run/gaming.py): it fires when a trained reward (weight > 0) on the held-out replies rose
    by at least this much since the first evaluation while a measure the run does not train on (eval.metrics, a
    weight-0 reward, or accuracy by a task.eval_reward that is not a trained reward) fell by at least gaming_fall:
    the log says the run may be gaming its reward, summary.json's gaming holds the replies whose reward rose most.
    0 in either turns the check off."""
    gaming_fall: float = 0.1
    """See gaming_rise."""
    gaming_rewards: tuple[str, ...] = ()
    """The trained rewards the gaming check watches rise (names in rewards, weight > 0; empty: every trained reward).
    Name the judge when other trained terms may rise at the cost of an independent measure by design (a relevance
    term trading some warmth): that is a trade-off, not the judge being gamed."""

    def __post_init__(self) -> None:
        at_least(self, 1, "batch_size")
        at_least(self, 0, "every", "max_new_tokens", "gaming_rise", "gaming_fall")


@dataclass(frozen=True)
class AsyncConfig:
    enabled: bool = False
    """Overlap generation and training: rollout servers keep sampling with the latest published adapter while
    the learner trains on groups already scored (written ``async`` in configs and overrides)."""
    runtime: Literal[RUNTIMES] = "embedded"
    """embedded: start async.servers `rlvr serve` processes on this machine (or use rollout.servers if given);
    ray: place them as Ray actors on the Ray cluster at async.ray_address."""
    servers: int = 1
    """Rollout servers to start (ignored when rollout.servers lists servers that already run)."""
    server_threads: int = 1
    """torch threads per started server."""
    server_device: str = "cpu"
    """Where the servers the run starts decode (rlvr serve --device): cpu (the default: on a GPU machine the GPU is
    the learner's), auto, cuda or cuda:N (each server holds its own copy of the model there); Ray servers asking
    for a GPU reserve one (num_gpus=1) and see it as cuda."""
    learner_threads: int = 0
    """torch threads of the learner (0: the cores the servers leave)."""
    pin: bool = True
    """embedded: pin the learner and each server to their own cores (sched_setaffinity), where there are enough."""
    max_inflight_groups: int = 0
    """Groups dispatched or scored but not yet trained, at most (0: train.prompts_per_step: the next batch is
    generated while the current one trains, one version behind). A slow learner makes the dispatchers wait
    instead of filling memory; more than that only helps when generation is the slower side, and groups that
    wait longer than max_staleness versions are dropped."""
    max_staleness: int = 1
    """A group sampled more than this many policy versions before the learner's current one is dropped (its
    prompt sampled again), never trained."""
    server_restarts: int = 3
    """Times a started server that dies is restarted (embedded: by the learner; ray: Ray's max_restarts)."""
    ray_address: str = ""
    """ray: address of an existing Ray cluster ('' starts a local one in this process)."""
    server_host: str = "127.0.0.1"
    """ray: address the servers listen on. 127.0.0.1 (default): loopback only, so they are placed on the learner's
    node and nobody else can reach them; node: the address Ray knows each node by (servers anywhere on the
    cluster, reachable by anyone on that network: they require this run's random API key, but HTTP is plain
    text, so use a network you trust); or an explicit address such as 0.0.0.0."""
    learner_wait_s: float = 0.0
    """Seconds the learner waits for the next scored group before the run stops with an error (0: 4 attempts x
    (rollout.request_timeout_s + rollout.server_wait_s) + 300 s for scoring, the longest a healthy pool can take)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check_device_spec(self.server_device)
        at_least(self, 1, "server_threads")
        at_least(self, 0, "servers", "learner_threads", "max_inflight_groups", "max_staleness", "server_restarts",
                  "learner_wait_s")


@dataclass(frozen=True)
class EnvConfig:
    factory: str = ""
    """A TRL-style environment class (or function returning one) as 'package.module:Name': one instance per
    episode, reset(**row) -> optional text added to the prompt, every public method a tool, optional
    get_reward(). '' with env.tools set: an environment of those tools only. See docs/concepts/episodes.md."""
    tools: tuple[str, ...] = ()
    """Tools besides the environment's methods: built-in calculator (exact arithmetic) and python (runs code in
    the graders' sandbox), or your own functions as 'package.module:function' (type hints and a docstring)."""
    url: str = ""
    """An environment served over HTTP in the OpenEnv style (reset / step), e.g. http://127.0.0.1:8000: each model
    turn is sent as the action {"message": text}, the observation comes back as the next turn, the server's reward
    is one more reward (named openenv). Not with env.factory or env.tools."""
    transport: Literal[TRANSPORTS] = "ws"
    """env.url: ws (the server's WebSocket, one connection per episode: what openenv-core serves) or http (POST
    /reset and /step: only for servers that keep one episode's state across requests)."""
    api_key_env: str = "RLVR_ENV_API_KEY"
    """env.url: environment variable holding the server's API key (sent as a Bearer token when set)."""
    max_turns: int = 4
    """Model turns per episode, at most (an episode ends earlier on a turn without a tool call)."""
    max_episode_tokens: int = 512
    """Completion tokens per episode (model turns and tool results together), at most."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run; a call past it is abandoned and the model reads a timeout."""
    stop_after_call: bool = True
    """End a model turn at '</tool_call>' (the tool's result follows at once), instead of letting the model go on
    writing (and inventing a result) until its end-of-turn token."""

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 1, "max_turns", "max_episode_tokens", "tool_timeout_s")

    @property
    def enabled(self) -> bool:
        """Episodes instead of single completions: an environment, tools or an environment server are set."""
        return bool(self.factory or self.tools or self.url)


@dataclass(frozen=True)
class DistillConfig:
    teacher: str = ""
    """On-policy distillation: a teacher model (a directory, or a name resolved like model.name) scores every token
    the student samples, in this process and on the learner's device, frozen; '' with distill.url unset: off. It
    must share the student's tokenizer and chat template (checked at start). 'self': the student's own starting
    weights (LoRA: the base under the adapter), with distill.hint. See docs/concepts/distillation.md."""
    adapter: str = ""
    """A LoRA adapter directory applied to distill.teacher (e.g. a run's adapter/ trained by rlvr)."""
    hint: str = ""
    """Privileged context: text the teacher reads at the end of the prompt's last user turn and the student never
    sees, formatted with the row's columns (e.g. 'The answer is {answer}.'); '' : the teacher reads the student's
    prompt. With distill.teacher=self the teacher is the student's own starting weights (self-distillation, no
    second model)."""
    url: str = ""
    """A served teacher instead: a vLLM-compatible server (rlvr serve, vllm serve) whose /v1/completions answers
    prompt_logprobs; the student's token ids are sent as the prompt. Not with distill.teacher."""
    model: str = ""
    """distill.url: the served model's name ('' : the one /v1/models lists first)."""
    api_key_env: str = API_KEY_ENV
    """distill.url: the environment variable holding the server's API key (sent as a Bearer token when set)."""
    request_timeout_s: float = 120.0
    """distill.url: seconds one scoring request may take, sending to the last byte."""
    objective: Literal[DISTILL_OBJECTIVES] = "sampled_kl"
    """sampled_kl: each sampled token's advantage gets -coef * (log p_student - log p_teacher), the single-sample
    reverse KL as a reward (works with a served teacher); jsd: a loss of coef x GKD's generalised JSD between the two
    distributions over the whole vocabulary at every completion token (token mean; an in-process teacher: TRL's
    DistillationTrainer)."""
    beta: float = 1.0
    """distill.objective=jsd: GKD's beta in [0, 1]: 0 is the forward KL(teacher || student), 1 the reverse KL
    (TRL DistillationConfig's default), 0.5 the symmetric JSD."""
    coef: float = 1.0
    """The teacher term's weight: sampled_kl, the Tinker cookbook's kl_penalty_coef; jsd, the loss's."""
    reward_weight: float = 1.0
    """Weight of the verifier's group advantage beside the teacher's: 1 adds them, 0 is distillation alone (the
    rewards are still computed and logged, never trained on)."""

    def __post_init__(self) -> None:
        check_choices(self)
        at_least(self, 0, "coef", "reward_weight")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"distill.beta must be in [0, 1] (0: forward KL, 1: reverse KL); got {self.beta}")
        if self.objective == "jsd" and self.url:
            raise ValueError("distill.objective=jsd compares whole distributions, which a server does not send; use "
                             "distill.teacher (in process), or distill.objective=sampled_kl with distill.url")
        if not self.request_timeout_s > 0:
            raise ValueError(f"distill.request_timeout_s must be > 0; got {self.request_timeout_s}")
        if self.teacher and self.url:
            raise ValueError("distill.teacher (a model here) and distill.url (a served one) exclude each other; "
                             "set one")
        if self.adapter and self.teacher in ("", "self"):
            raise ValueError("distill.adapter is applied to distill.teacher; set distill.teacher to its base model")

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.url)


@dataclass(frozen=True)
class LogConfig:
    trackers: tuple[str, ...] = ("tensorboard",)
    """Where metrics go besides metrics.jsonl (same names and steps): tensorboard (event files in tensorboard/),
    wandb (Weights & Biases, offline unless WANDB_MODE is set; pip install 'rlvr[wandb]') and trackio (a local
    database, trackio/ unless TRACKIO_DIR is set; pip install 'rlvr[trackio]'). See docs/trackers.md."""
    project: str = "rlvr"
    """Project name in wandb and trackio."""
    run_name: str = ""
    """Run name in wandb and trackio ('' = the name of output_dir)."""
    progress: bool = True
    """Show a live progress bar."""
    plot: bool = True
    """Write plot.png (reward and held-out accuracy against step) at the end."""
    samples: bool = True
    """Write samples.jsonl: every completion's text and reward, with its prompt's row index, per step."""
    sample_token_ids: bool = False
    """Also write each completion's token ids into samples.jsonl."""

    def __post_init__(self) -> None:
        from rlvr.store.trackers import TRACKERS

        unknown = [t for t in self.trackers if t not in TRACKERS]
        if unknown:
            raise ValueError(f"trackers: unknown tracker {unknown[0]!r}; allowed: {', '.join(TRACKERS)}")
        object.__setattr__(self, "trackers", tuple(dict.fromkeys(self.trackers)))  # each tracker once


@dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    """Run directory: config, metrics, summary, plot, checkpoints, trained weights."""
    resume: str = ""
    """'' starts fresh (an earlier run in output_dir is moved aside); 'auto' continues from the newest
    complete checkpoint in output_dir (fresh if there is none); a path continues from that checkpoint."""
    import_dirs: tuple[str, ...] = ()
    """Folders that module:name rewards, tools and environment classes are imported from, after the working directory
    and the config's folder (then PYTHONPATH and installed packages). A run's config.yaml records here the folders its
    own modules came from, so it imports them from any directory."""
    model: ModelConfig = ModelConfig()
    """The policy: which model, LoRA or full fine-tuning."""
    task: TaskConfig = TaskConfig()
    """Where prompts and answers come from, and the held-out split."""
    rewards: tuple[RewardConfig, ...] = (RewardConfig(),)
    """Reward functions and weights; the total is their weighted sum."""
    rollout: RolloutConfig = RolloutConfig()
    """Group size and sampling."""
    algo: AlgoConfig = field(default_factory=lambda: AlgoConfig(**PRESETS["grpo"]))
    """The objective: preset and knobs."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The critic's settings, used with algo.name=ppo."""
    train: TrainConfig = TrainConfig()
    """Steps, batch shape, optimizer, seed."""
    eval: EvalConfig = EvalConfig()
    """Greedy held-out evaluation."""
    env: EnvConfig = EnvConfig()
    """Multi-turn episodes with tools and environments (off unless env.factory or env.tools is set)."""
    log: LogConfig = LogConfig()
    """Metric sinks."""
    asynchronous: AsyncConfig = AsyncConfig()
    """Asynchronous GRPO: learner and rollout servers overlapped (``async`` in YAML and overrides)."""
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    """Learners on separate machines that exchange a delta every diloco.inner_steps steps through a bucket."""
    distill: DistillConfig = DistillConfig()
    """On-policy distillation: a teacher scores every sampled token, alone or beside the rewards."""
