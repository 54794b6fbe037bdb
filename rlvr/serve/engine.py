"""The serving engine behind ``rlvr serve``: one thread owns the model, runs batches of compatible requests on
rlvr's group sampler, and loads or unloads LoRA adapters between batches.

Batching: requests waiting when a batch starts (plus those arriving within ``batch_wait_s``) that share the
adapter, the sampling parameters and n run as one batch, each prompt prefilled once for its n samples.
Requests for another adapter or other parameters wait for the next batch (oldest first), so one batch never
mixes adapters. A completion's randomness comes from its own generator, seeded from the request's ``seed``,
so a seeded request gives the same tokens whatever it is batched with.

Adapters are held by peft, several at once (``max_loras``), under internal names, so that ``load_inplace``
can swap one without a moment where the name is missing; the files are checked (readable config and
safetensors) before the model is touched, and a failed load leaves the resident adapters as they were.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import queue
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlvr.bucket import fetch_version
from rlvr.faults import fault_point
from rlvr.models import backbone_and_head, load_causal_lm, load_tokenizer, model_context, resolve_model_dir
from rlvr.prompts import left_pad
from rlvr.rollout.engine import SamplingParams, generate_groups
from rlvr.rollout.groups import eos_token_ids, stop_string_checker


class EngineError(Exception):
    """A request the engine refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Generation:
    """The n completions of one prompt."""

    prompt_ids: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each sampled token, under the distribution it was drawn from
    top_logprobs: list[list[list[tuple[int, float]]]] | None  # per completion, per token: (token id, logp)
    finish_reason: list[str]  # "stop" (EOS or stop string) or "length"
    stop_reason: list[str | None]  # the stop string that ended it, if one did


@dataclass
class Job:
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    adapter: str | None  # None: the base model
    seed: int | None = None
    top_logprobs: int = 0
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def key(self) -> tuple:
        return (self.adapter, self.params, self.n, self.top_logprobs)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class AdapterJob:
    action: str  # "load" or "unload"
    name: str
    path: str = ""
    inplace: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def _row_seed(seed: int, prompt: int, choice: int) -> int:
    return ((seed * 1_000_003 + prompt) * 1_009 + choice) % (1 << 63)


def check_adapter_files(path: Path) -> dict:
    """The adapter's config, after checking that its config and weights can be read (before any model change)."""
    from safetensors.torch import load_file

    try:
        config = json.loads((path / "adapter_config.json").read_text())
        weights = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError) as err:
        raise EngineError(f"cannot read a LoRA adapter at {path}: {err}") from None
    if config.get("peft_type", "LORA") != "LORA" or not weights:
        raise EngineError(f"{path} does not hold a LoRA adapter (peft_type {config.get('peft_type')!r})")
    return config


class Engine:
    """Owns the model; everything that touches it runs on the engine thread."""

    def __init__(self, model: str, max_loras: int = 4, max_model_len: int = 0, max_num_seqs: int = 256,
                 batch_wait_s: float = 0.01, threads: int = 0):
        self.model_dir = resolve_model_dir(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        context = model_context(self.model_dir)
        self.max_model_len = min(max_model_len, context) if max_model_len else context
        self.max_loras, self.max_num_seqs = max_loras, max_num_seqs
        self.batch_wait_s, self.threads = batch_wait_s, threads
        self.adapters: dict[str, str] = {}  # public name -> lora_path it was loaded from
        self._internal: dict[str, str] = {}  # public name -> peft adapter name
        self._names = (f"a{i}" for i in itertools.count())
        self._queue: queue.Queue = queue.Queue()
        self._waiting: list = []
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._cache = Path(tempfile.mkdtemp(prefix="rlvr-serve-adapters-"))
        self._base = self._peft = None
        self.busy_s = 0.0  # time spent generating
        self.batches = self.requests = self.rows = 0  # batches run, requests served in them, completions
        self.loads = 0  # adapter loads attempted
        self._thread = threading.Thread(target=self._run, name="rlvr-engine", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def submit(self, job: Job | AdapterJob) -> concurrent.futures.Future:
        self._queue.put(job)
        return job.future

    # --- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.threads:
                torch.set_num_threads(self.threads)
            self._base = load_causal_lm(self.model_dir).eval()
            self.eos_ids = eos_token_ids(self._base, self.tokenizer)
        except Exception as err:  # noqa: BLE001 (reported by /health and every request)
            self.load_error = f"{type(err).__name__}: {err}"
            return
        finally:
            self.ready.set()
        while True:
            first = self._waiting.pop(0) if self._waiting else self._queue.get()
            if isinstance(first, AdapterJob):
                self._settle(first, self._adapter_job)
                continue
            time.sleep(self.batch_wait_s)  # let requests sent together arrive together
            batch = [first]
            while True:  # everything queued so far, in arrival order
                try:
                    self._waiting.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows, rest = first.rows, []
            for job in self._waiting:
                if isinstance(job, Job) and job.key() == first.key() and rows + job.rows <= self.max_num_seqs:
                    batch.append(job)
                    rows += job.rows
                else:
                    rest.append(job)
            self._waiting = rest
            self._generate(batch)

    @staticmethod
    def _settle(job, fn) -> None:
        try:
            job.future.set_result(fn(job))
        except Exception as err:  # noqa: BLE001 (the request fails, the engine goes on)
            job.future.set_exception(err)

    def _adapter_job(self, job: AdapterJob) -> str:
        if job.action == "unload":
            return self._unload(job.name)
        return self._load(job.name, job.path, job.inplace)

    def _load(self, name: str, path: str, inplace: bool) -> str:
        replacing = name in self._internal
        if replacing and not inplace:
            raise EngineError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.")
        if not replacing and len(self._internal) >= self.max_loras:
            raise EngineError(f"{len(self._internal)} adapters are resident, the most this server holds "
                              f"(--max-loras {self.max_loras}); unload one first")
        try:
            local = fetch_version(path, self._cache)
        except FileNotFoundError as err:
            raise EngineError(f"Loading lora {name} failed: no adapter found at {path} ({err})", status=404) from None
        except (OSError, RuntimeError, ValueError) as err:
            raise EngineError(f"cannot fetch the LoRA adapter at {path}: {err}") from None
        check_adapter_files(local)
        self.loads += 1
        fault_point("adapter_load", self.loads)  # crash tests: die in the middle of the n-th load
        internal = next(self._names)
        try:
            if self._peft is None:
                from peft import PeftModel

                self._peft = PeftModel.from_pretrained(self._base, str(local), adapter_name=internal).eval()
            else:
                self._peft.load_adapter(str(local), adapter_name=internal)
        except Exception as err:  # noqa: BLE001 (whatever peft raises, the resident adapters stay as they were)
            self._drop(internal)
            raise EngineError(f"cannot load the LoRA adapter at {path}: {type(err).__name__}: {err}") from None
        if replacing:
            self._drop(self._internal[name])
        self._internal[name], self.adapters[name] = internal, path
        return f"Success: LoRA adapter '{name}' added successfully."

    def _unload(self, name: str) -> str:
        if name not in self._internal:
            raise EngineError(f"The lora adapter '{name}' cannot be found.", status=404)
        self._drop(self._internal.pop(name))
        del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _drop(self, internal: str) -> None:
        """Remove a peft adapter; without any left, the model is unwrapped back to the plain base model."""
        if self._peft is None or internal not in self._peft.peft_config:
            return
        if len(self._peft.peft_config) == 1:
            self._base = self._peft.unload()
            self._peft = None
        else:
            self._peft.delete_adapter(internal)

    def _generate(self, batch: list[Job]) -> None:
        first = batch[0]
        started = time.perf_counter()
        try:
            if first.adapter is not None and first.adapter not in self._internal:
                raise EngineError(f"The model `{first.adapter}` does not exist.", status=404)
            prompts = [p for job in batch for p in job.prompts]
            ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
            generators = []
            for job in batch:
                seed = job.seed if job.seed is not None else secrets.randbits(62)
                generators += [torch.Generator().manual_seed(_row_seed(seed, i, c))
                               for i in range(len(job.prompts)) for c in range(job.n)]
            with torch.no_grad(), self._policy(first.adapter) as model:
                backbone, head = backbone_and_head(model)
                out = generate_groups(backbone, head, ids, mask, first.n, first.params, self.eos_ids,
                                      self.tokenizer.pad_token_id, generators,
                                      stop_string_checker(self.tokenizer, first.params.stop), first.top_logprobs)
        except Exception as err:  # noqa: BLE001 (every request of the batch fails; the engine goes on)
            for job in batch:
                job.future.set_exception(err)
            return
        finally:
            self.busy_s += time.perf_counter() - started
            self.batches, self.requests = self.batches + 1, self.requests + len(batch)
            self.rows += sum(job.rows for job in batch)
        row = 0
        for job in batch:
            results = []
            for prompt in job.prompts:
                results.append(self._generation(prompt, out, range(row, row + job.n), job.params.stop))
                row += job.n
            job.future.set_result(results)

    def _policy(self, adapter: str | None):
        import contextlib

        if self._peft is None:
            return contextlib.nullcontext(self._base)
        if adapter is None:
            @contextlib.contextmanager
            def disabled():
                with self._peft.disable_adapter():
                    yield self._peft
            return disabled()
        self._peft.set_adapter(self._internal[adapter])
        return contextlib.nullcontext(self._peft)

    def _generation(self, prompt: list[int], out, rows: range, stops: tuple[str, ...]) -> Generation:
        g = Generation(prompt, [], [], [] if out.top_ids is not None else None, [], [])
        for r in rows:
            n = int(out.mask[r].sum())
            tokens = out.ids[r, :n].tolist()
            g.token_ids.append(tokens)
            g.logprobs.append(out.behaviour_logp[r, :n].tolist())
            if g.top_logprobs is not None:
                g.top_logprobs.append([list(zip(out.top_ids[r, t].tolist(), out.top_logp[r, t].tolist()))
                                       for t in range(n)])
            ended_by_string = not out.truncated[r] and n > 0 and tokens[-1] not in self.eos_ids
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if ended_by_string else ""
            g.stop_reason.append(next((s for s in stops if s in text), None) if ended_by_string else None)
            g.finish_reason.append("length" if out.truncated[r] else "stop")
        return g
