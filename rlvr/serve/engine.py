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

Bounds: a batch holds at most ``max_num_seqs`` completions and ``max_batch_tokens`` KV-cache positions
(completions × (longest prompt + max_tokens)); a request larger than that runs as several batches of whole
prompts, in order, and one whose single prompt cannot fit is refused. At most ``max_queued_rows`` completions
are accepted and unfinished at once (beyond: ``ServerBusy``, 503; the admission queue, rlvr.serve.admission). A
request whose future is cancelled (its client went away) is dropped: its queued prompts never run, and a running
batch whose every request is cancelled stops at the next decoding step. Nothing sent after an adapter load or unload
joins a batch that runs before it, so a request sent after ``load_inplace`` never sees the old weights.

Prefix reuse (``--prefix-cache-mb``): every completion's keys and values are held afterwards, least recently used
dropped beyond the bound, so a request whose prompt extends an earlier prompt + completion (an episode's next turn:
the same tokens, then an observation) feeds only its new tokens (rlvr.rollout.turn_cache). Held per adapter name and
emptied on every adapter load or unload, so no request ever continues another version's cache.

Device: the model lives on one device (``--device``: auto is a CUDA GPU when one is visible, else the CPU), in
``--dtype`` (auto: bf16 on a bf16-capable GPU, fp32 elsewhere); prompts are padded on the CPU and cross to the
model's device once per batch, every tensor of the generation is made there (sampling generators included), and
the batch's results cross back to the CPU once, as Python values, before anything is answered. Adapters are read
straight onto the model's device.

Adapter paths are checked against an ``AdapterPolicy`` (rlvr.serve.security) before anything is read or
fetched; errors say "adapter path not allowed" or "could not load adapter" with a fixed reason, never the
text of an exception (which may quote a remote server or a path). A downloaded copy is deleted once loaded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from rlvr.models.policy import backbone_and_head, load_causal_lm, load_tokenizer, model_context, resolve_model_dir
from rlvr.models.prompts import left_pad
from rlvr.platform.devices import resolve_device, sampling_generator, weight_dtype
from rlvr.platform.faults import fault_point
from rlvr.platform.seeds import completion_seed
from rlvr.rollout.decode_weights import DecodeCache, decode_dtype, decoding
from rlvr.rollout.engine import SampledTokens, SamplingParams, generate_groups
from rlvr.rollout.groups import eos_token_ids, stop_string_checker
from rlvr.rollout.turn_cache import PrefixStore, sample_continuing
from rlvr.serve.admission import DEFAULT_QUEUED_ROWS, AdmissionQueue, EngineError, settle
from rlvr.serve.security import NOT_ALLOWED, AdapterPathError, AdapterPolicy
from rlvr.store.bucket import fetch_version

DEFAULT_BATCH_TOKENS = 1 << 17  # 131,072 KV positions: ~6 GB of fp32 cache for SmolLM2-135M
DEFAULT_PREFIX_CACHE_MB = 1024  # ~22k positions of SmolLM2-135M's fp32 cache: 64 episodes of ~350 tokens


class _Abandoned(Exception):
    """Every request of the running batch was cancelled."""


@dataclass
class Generation:
    """The n completions of one prompt."""

    prompt_ids: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # of each sampled token, under the distribution it was drawn from
    top_logprobs: list[list[list[tuple[int, float]]]] | None  # per completion, per token: (token id, logp)
    finish_reason: list[str]  # "stop" (EOS or stop string) or "length"
    stop_reason: list[str | None]  # the stop string that ended it, if one did
    prompt_logprobs: list | None = None  # per prompt token after the first: (its logp, its rank, [(id, logp)] top k)


@dataclass
class Job:
    """A generation request: n completions of each prompt."""

    cancellable: ClassVar[bool] = True  # a client that goes away has it dropped
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    adapter: str | None  # None: the base model
    seed: int | None = None
    top_logprobs: int = 0
    hold: bool = False  # keep its completions for requests that extend them (an episode's turn: see prepare_completion)
    prompt_logprobs: int | None = None  # score the prompt's tokens too, with the k most likely beside each
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    taken: int = 0  # prompts handed to batches so far (a large request runs in several)
    results: list[Generation] = field(default_factory=list)

    def key(self) -> tuple:
        return (self.adapter, self.params, self.n, self.top_logprobs, self.hold, self.prompt_logprobs)

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    def tokens(self, prompt: list[int]) -> int:
        """KV-cache positions this prompt's n completions take in a batch."""
        return self.n * (len(prompt) + self.params.max_new_tokens)

    @property
    def prompt_logprob_entries(self) -> int:
        """What ``prompt_logprobs`` adds to the answer, once per prompt whatever n (completion_routes): per prompt
        token after the first, the token's own entry and k more; 0 when not asked."""
        if self.prompt_logprobs is None:
            return 0
        return sum(len(p) - 1 for p in self.prompts) * (self.prompt_logprobs + 1)


@dataclass
class AdapterJob:
    """An adapter load or unload, run between batches."""

    cancellable: ClassVar[bool] = False  # once queued, it runs to its end: the adapter table must say what happened
    action: str  # "load" or "unload"
    name: str
    path: str = ""
    inplace: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def _log(message: str) -> None:
    print(f"rlvr serve: {message}", file=sys.stderr, flush=True)


def load_on_engine_thread(engine, load) -> bool:
    """The engine thread's first work: ``load()`` its model (on ``engine.threads`` torch threads when set). A failure
    is kept in ``engine.load_error`` (answered by /health and every request) and logged; ``engine.ready`` is set
    either way. True when the model loaded."""
    try:
        if engine.threads:
            torch.set_num_threads(engine.threads)
        load()
    except Exception as err:  # noqa: BLE001 (reported by /health and every request)
        engine.load_error = f"{type(err).__name__}: {err}"
        _log(f"the model failed to load: {engine.load_error}")
        return False
    finally:
        engine.ready.set()
    return True


PROMPT_CHUNK = 256  # prompt positions whose [c, V] logits are held at once


def prompt_logprobs(model, prompt: list[int], temperature: float, k: int) -> list:
    """Per prompt token after the first: (log p(token | the tokens before it), its rank, the k most likely
    (id, logp)), at ``temperature`` (0: 1) - what vLLM reports in processed_logprobs mode. One sequence, no
    padding, so its positions are plain; the output layer runs a chunk of positions at a time."""
    backbone, head = backbone_and_head(model)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    hidden = backbone(input_ids=ids).last_hidden_state[0, :-1]  # [P - 1, H]: state j predicts token j + 1
    targets = ids[0, 1:]
    out = []
    for start in range(0, hidden.shape[0], PROMPT_CHUNK):
        logits = head(hidden[start:start + PROMPT_CHUNK]).float()  # [c, V]
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        chosen = logp.gather(1, targets[start:start + PROMPT_CHUNK, None])  # [c, 1]
        rank = (logp > chosen).sum(dim=1) + 1
        top = logp.topk(k, dim=1) if k else None
        for i in range(logp.shape[0]):
            best = list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else []
            out.append((float(chosen[i, 0]), int(rank[i]), best))
    return out


def _to_host(out: SampledTokens) -> SampledTokens:
    """A batch's results on the CPU: one crossing per tensor, the first waiting for the generation to end."""
    return SampledTokens(*(None if t is None else t.cpu() for t in (
        out.ids, out.mask, out.behaviour_logp, out.truncated, out.top_ids, out.top_logp)))


MAX_ADAPTER_CONFIG_BYTES = 1 << 20


def _regular(path: Path) -> int:
    """A descriptor of ``path`` opened without blocking, when it is a regular file (a FIFO never answers a reader
    that blocks; the engine thread would hang for every client); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # links were resolved inside the roots by the policy
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def check_adapter_files(path: Path) -> dict:
    """The adapter's config, after checking that its config and weights are regular files that can be read (before
    any model change). Every failure is the one ``NOT_ALLOWED`` answer; the reason goes to the server's log."""
    from safetensors.torch import load_file

    try:
        with os.fdopen(_regular(path / "adapter_config.json"), "rb") as f:
            raw = f.read(MAX_ADAPTER_CONFIG_BYTES + 1)
        if len(raw) > MAX_ADAPTER_CONFIG_BYTES:
            raise ValueError(f"adapter_config.json is over {MAX_ADAPTER_CONFIG_BYTES} bytes")
        config = json.loads(raw)
        os.close(_regular(path / "adapter_model.safetensors"))
        weights = load_file(str(path / "adapter_model.safetensors"))
    except (OSError, ValueError, RecursionError, RuntimeError) as err:
        _log(f"adapter at {str(path)!r} unreadable: {type(err).__name__}: {err}")
        raise EngineError(NOT_ALLOWED) from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA" or not weights:
        _log(f"adapter at {str(path)!r} is not a LoRA adapter")
        raise EngineError(NOT_ALLOWED)
    return config


class Engine:
    """Owns the model; everything that touches it runs on the engine thread."""

    def __init__(self, model: str, max_loras: int = 4, max_model_len: int = 0, max_num_seqs: int = 256,
                 batch_wait_s: float = 0.01, threads: int = 0, *, max_batch_tokens: int = 0,
                 max_queued_rows: int = DEFAULT_QUEUED_ROWS, adapter_policy: AdapterPolicy | None = None,
                 precision: str = "auto", device: str = "auto", dtype: str = "auto",
                 lora_modules: tuple[tuple[str, str], ...] = (), prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB):
        decode_dtype(precision)  # an unknown precision fails here, before the model loads (resolved once it has)
        self.precision = precision
        self.device = resolve_device(device, "--device")  # a device that is not there fails here, before loading
        self.weight_dtype = weight_dtype(dtype, self.device, lora=True, name="--dtype")  # bf16: nothing trains here
        self.model_dir = resolve_model_dir(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        context = model_context(self.model_dir)
        self.max_model_len = min(max_model_len, context) if max_model_len else context
        if min(max_loras, max_num_seqs, max_queued_rows) < 1 or min(max_batch_tokens, prefix_cache_mb) < 0:
            raise ValueError("--max-loras, --max-num-seqs and --max-queued-rows must be at least 1, "
                             "--max-batch-tokens and --prefix-cache-mb at least 0")
        self.max_loras, self.max_num_seqs = max_loras, max_num_seqs
        self.max_batch_tokens = max_batch_tokens or max(DEFAULT_BATCH_TOKENS, self.max_model_len)
        # its rows, cancelled: /stats; prompt log-probs bounded like a batch's KV positions (--max-batch-tokens)
        self.admission = AdmissionQueue(max_queued_rows, "completions", "prompts", self.max_batch_tokens)
        self.policy = adapter_policy or AdapterPolicy.default("127.0.0.1")
        self.batch_wait_s, self.threads = batch_wait_s, threads
        self.lora_modules = lora_modules  # (name, path): loaded once the model is, before the server is ready
        # public name -> lora_path it was loaded from; replaced whole by the engine thread, never changed in
        # place, so other threads may iterate the dict they read
        self.adapters: dict[str, str] = {}
        self._internal: dict[str, str] = {}  # public name -> peft adapter name (engine thread only)
        self._names = (f"a{i}" for i in itertools.count())
        self._waiting: list[Job | AdapterJob] = []  # taken from the admission queue, not finished (engine thread)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._base = self._peft = None
        self._decode_cache = DecodeCache()  # the last batch's folded weights; emptied on every adapter change
        # recent completions' keys and values, for requests that extend them (episode turns); emptied likewise
        self.prefixes = PrefixStore(int(prefix_cache_mb * 2**20)) if prefix_cache_mb else None
        self.busy_s = 0.0  # time spent generating
        self.batches = self.requests = self.rows = 0  # batches run, requests served in them, completions
        self.loads = 0  # adapter loads attempted
        self._thread = threading.Thread(target=self._run, name="rlvr-engine", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def close(self, wait_s: float = 5.0) -> None:
        """Refuse new requests (503), let the engine thread end once it has run those accepted before (waiting at
        most ``wait_s``)."""
        self.admission.close()
        if self._thread.is_alive():
            self._thread.join(wait_s)

    def check(self, job: Job) -> None:
        """Refuse (400) a request that can never run within the bounds; says which knob to lower."""
        if not job.prompts or job.n < 1:
            raise EngineError("a request needs at least one prompt and n >= 1")
        if job.n > self.max_num_seqs:
            raise EngineError(f"n={job.n} is more than this server decodes at once (--max-num-seqs "
                              f"{self.max_num_seqs}): lower n")
        self.admission.check_size(job.rows, f"{len(job.prompts)} prompts x n={job.n} = {job.rows} completions")
        longest = max(job.prompts, key=len)
        if job.tokens(longest) > self.max_batch_tokens:
            raise EngineError(f"n={job.n} x ({len(longest)} prompt + {job.params.max_new_tokens} completion tokens) "
                              f"= {job.tokens(longest)} tokens is more than one batch holds (--max-batch-tokens "
                              f"{self.max_batch_tokens}): lower n, max_tokens or the prompt length")
        entries = job.prompt_logprob_entries  # counted before anything is scored or built
        if entries > self.max_batch_tokens:
            raise EngineError(f"prompt_logprobs={job.prompt_logprobs} on {entries // (job.prompt_logprobs + 1)} prompt "
                              f"tokens = {entries} entries is more than this server answers at once "
                              f"(--max-batch-tokens {self.max_batch_tokens}): lower prompt_logprobs, or send fewer "
                              "or shorter prompts per request")

    def submit(self, job: Job | AdapterJob) -> concurrent.futures.Future:
        """Queue a job; EngineError (400) if it can never fit, ServerBusy (503) while the queue is full (an adapter
        job holds no rows: never), 503 once closed."""
        if isinstance(job, Job):
            self.check(job)
            return self.admission.submit(job, job.rows, job.prompt_logprob_entries)
        return self.admission.submit(job)

    # --- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        if not load_on_engine_thread(self, self._load_model_and_modules):
            return
        while True:
            self._waiting += self.admission.arrivals(wait=not self._waiting)
            if not self._waiting:
                return  # closed, and every request accepted before has run
            first = self._waiting[0]
            if isinstance(first, AdapterJob):
                self._waiting.pop(0)
                self._adapter_job(first)
                continue
            if first.future.cancelled():
                self._finish([first])
                continue
            if first.taken == 0:  # let requests sent together arrive together
                self._waiting += self.admission.arrivals(window_s=self.batch_wait_s)
            self._generate(self._next_batch())

    def _load_model_and_modules(self) -> None:
        """The base model, then the ``--lora-modules`` adapters (one that fails to load fails the whole load)."""
        self.load_model()
        for name, path in self.lora_modules:
            try:
                self._load(name, path, False)
            except EngineError:
                raise RuntimeError(f"--lora-modules {name}={path} could not be loaded (see above)") from None

    def load_model(self) -> None:
        """Load the base model onto the engine's device, in its weight dtype (the engine thread does this first)."""
        self._base = load_causal_lm(self.model_dir, self.weight_dtype).to(self.device).eval().requires_grad_(False)
        self.dtype = decode_dtype(self.precision, self._base)
        self.eos_ids = eos_token_ids(self._base, self.tokenizer)

    def _next_batch(self) -> list[tuple[Job, int, int]]:
        """(job, first prompt, end) pieces for the next batch: the oldest request's parameters, as many whole
        prompts as the bounds allow, oldest first; nothing from beyond an adapter change."""
        key = self._waiting[0].key()
        pieces, rows, longest = [], 0, 0
        for job in self._waiting:
            if not isinstance(job, Job):
                break  # requests sent after an adapter change must see the adapters as it leaves them
            if job.future.cancelled() or job.key() != key:
                continue
            end = job.taken
            while end < len(job.prompts):
                width = max(longest, len(job.prompts[end]))
                if rows + job.n > self.max_num_seqs or \
                        (rows + job.n) * (width + job.params.max_new_tokens) > self.max_batch_tokens:
                    break
                rows, longest, end = rows + job.n, width, end + 1
            if end > job.taken:
                pieces.append((job, job.taken, end))
                job.taken = end
            if job.taken < len(job.prompts):
                break  # the batch is full
        if not pieces:  # the oldest request was cancelled meanwhile, or (check() prevents it) does not fit
            job = self._waiting[0]
            settle(job.future, error=EngineError("a prompt does not fit in one batch (--max-batch-tokens)"))
            self._finish([job])
        return pieces

    def _finish(self, jobs: list[Job]) -> None:
        """Take finished, failed or cancelled requests off the waiting list."""
        gone = {id(j) for j in jobs}
        self._waiting = [j for j in self._waiting if id(j) not in gone]
        self.admission.drop_cancelled(jobs)  # counts those whose client went away

    def _adapter_job(self, job: AdapterJob) -> None:
        self._decode_cache.clear()  # peft may reuse or rewrite the tensors of a replaced adapter
        if self.prefixes is not None:
            self.prefixes.clear()
        try:
            result = self._unload(job.name) if job.action == "unload" else self._load(job.name, job.path, job.inplace)
        except Exception as err:  # noqa: BLE001 (the request fails, the engine goes on)
            settle(job.future, error=err)
        else:
            settle(job.future, result)

    def _fetch(self, name: str, path: str) -> tuple[Path, bool]:
        """A local, verified copy of the adapter at an allowed path, and whether it was downloaded (fixed error
        messages only)."""
        try:
            where = self.policy.resolve(path)
        except AdapterPathError:
            _log(f"refused lora_path {path[:300]!r} for {name!r}: outside {self.policy.describe()}")
            raise EngineError(NOT_ALLOWED) from None
        cache = Path(tempfile.mkdtemp(prefix="rlvr-serve-adapter-"))  # this download's own, removed once loaded
        try:
            local = fetch_version(where, cache)
        except Exception as err:  # noqa: BLE001 (missing, unreadable, not matching its manifest: one answer, no oracle)
            shutil.rmtree(cache, ignore_errors=True)
            _log(f"fetching {where!r} failed: {type(err).__name__}: {err}")
            raise EngineError(NOT_ALLOWED) from None
        downloaded = "://" in where and local.resolve().is_relative_to(cache.resolve())
        if not downloaded:  # a local version, read in place
            shutil.rmtree(cache, ignore_errors=True)
        return local, downloaded

    def _load(self, name: str, path: str, inplace: bool) -> str:
        replacing = name in self._internal
        if replacing and not inplace:
            raise EngineError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                              "in place, set 'load_inplace' to True.")
        if not replacing and len(self._internal) >= self.max_loras:
            raise EngineError(f"{len(self._internal)} adapters are resident, the most this server holds "
                              f"(--max-loras {self.max_loras}); unload one first")
        local, downloaded = self._fetch(name, path)
        try:
            check_adapter_files(local)
            self.loads += 1
            fault_point("adapter_load", self.loads)  # crash tests: die in the middle of the n-th load
            internal = next(self._names)
            try:
                if self._peft is None:
                    from peft import PeftModel

                    # torch_device: read onto the model's device (peft's own guess is the first GPU, whatever
                    # device the model is on)
                    self._peft = PeftModel.from_pretrained(self._base, str(local), adapter_name=internal,
                                                           torch_device=str(self.device)).eval()
                else:
                    self._peft.load_adapter(str(local), adapter_name=internal, torch_device=str(self.device))
            except Exception as err:  # noqa: BLE001 (whatever peft raises, the resident adapters stay as they were)
                self._drop(internal)
                _log(f"peft could not load {str(local)!r}: {type(err).__name__}: {err}")
                raise EngineError("could not load adapter: it does not fit this model") from None
        finally:
            if downloaded:  # its weights are in memory now (or it failed): the disk holds no copy
                shutil.rmtree(local.parent, ignore_errors=True)
        if replacing:
            self._drop(self._internal[name])
        self._internal[name] = internal
        self.adapters = {**self.adapters, name: path}
        return f"Success: LoRA adapter '{name}' added successfully."

    def _unload(self, name: str) -> str:
        if name not in self._internal:
            raise EngineError(f"The lora adapter '{name}' cannot be found.", status=404)
        self._drop(self._internal.pop(name))
        self.adapters = {k: v for k, v in self.adapters.items() if k != name}
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

    def _generate(self, pieces: list[tuple[Job, int, int]]) -> None:
        if not pieces:
            return
        jobs = [job for job, _, _ in pieces]
        first = jobs[0]
        started = time.perf_counter()
        try:
            if first.adapter is not None and first.adapter not in self._internal:
                raise EngineError(f"The model `{first.adapter}` does not exist.", status=404)
            prompts = [p for job, a, b in pieces for p in job.prompts[a:b]]
            generators = []
            for job, a, b in pieces:
                if job.seed is None:  # one seed per request, however many batches it runs in
                    job.seed = secrets.randbits(62)
                generators += [sampling_generator(completion_seed(job.seed, i, c), self.device)
                               for i in range(a, b) for c in range(job.n)]

            def abandoned(*_):
                if all(job.future.cancelled() for job in jobs):
                    raise _Abandoned

            with torch.no_grad(), self._policy(first.adapter) as model:
                with decoding(model, self.dtype, self._decode_cache) as (backbone, head):
                    hook = backbone.register_forward_pre_hook(abandoned)
                    try:
                        out = self._sample(backbone, head, prompts, first, generators)
                    finally:
                        hook.remove()
                # prompt log-probs through the model's own weights and precision (not the decode copy's)
                scored = None if first.prompt_logprobs is None else [
                    prompt_logprobs(model, p, first.params.temperature, first.prompt_logprobs) for p in prompts]
            out = _to_host(out)  # the batch's results cross to the CPU once
        except _Abandoned:
            self._finish(jobs)
            return
        except Exception as err:  # noqa: BLE001 (every request of the batch fails; the engine goes on)
            for job in jobs:
                settle(job.future, error=err)
            self._finish(jobs)
            return
        finally:
            self.busy_s += time.perf_counter() - started
        self.batches += 1
        self.requests += sum(a == 0 for _, a, _ in pieces)
        self.rows += sum((b - a) * job.n for job, a, b in pieces)
        row = 0
        for job, a, b in pieces:
            for prompt in job.prompts[a:b]:
                job.results.append(self._generation(prompt, out, range(row, row + job.n), job.params.stop))
                if scored is not None:
                    job.results[-1].prompt_logprobs = scored[row // job.n]
                row += job.n
            if job.taken == len(job.prompts):
                settle(job.future, job.results)
        self._finish([job for job in jobs if job.taken == len(job.prompts) or job.future.cancelled()])

    def _sample(self, backbone, head, prompts: list[list[int]], first: Job, generators: list) -> SampledTokens:
        """The batch's completions; with the prefix store, a prompt that extends a held completion feeds only its
        new tokens (rlvr.rollout.turn_cache), and every completion is held for the requests that extend it."""
        stop = stop_string_checker(self.tokenizer, first.params.stop)
        pad = self.tokenizer.pad_token_id
        if self.prefixes is None or not first.hold:
            ids, mask = left_pad(prompts, pad)  # on the CPU; to the model's device once
            return generate_groups(backbone, head, ids.to(self.device), mask.to(self.device), first.n, first.params,
                                   self.eos_ids, pad, generators, stop, first.top_logprobs)
        held = [self.prefixes.find(first.adapter, p) for p in prompts]
        got = sample_continuing(backbone, head, prompts, held, first.n, first.params, self.eos_ids, pad, generators,
                                stop, first.top_logprobs, keep_bytes=self.prefixes.max_bytes)
        self.prefixes.reused_tokens += got.reused
        for h in got.held:
            if h is not None:
                self.prefixes.put(first.adapter, h)
        return got.out

    def _policy(self, adapter: str | None):
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

    def _generation(self, prompt: list[int], out: SampledTokens, rows: range, stops: tuple[str, ...]) -> Generation:
        """One prompt's completions as Python values, from the batch's results on the CPU."""
        g = Generation(prompt, [], [], [] if out.top_ids is not None else None, [], [])
        for r in rows:
            n = int(out.mask[r].sum())
            tokens = out.ids[r, :n].tolist()
            g.token_ids.append(tokens)
            g.logprobs.append(out.behaviour_logp[r, :n].tolist())
            if g.top_logprobs is not None:
                g.top_logprobs.append([list(zip(out.top_ids[r, t].tolist(), out.top_logp[r, t].tolist()))
                                       for t in range(n)])
            truncated = bool(out.truncated[r])
            ended_by_string = not truncated and n > 0 and tokens[-1] not in self.eos_ids
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if ended_by_string else ""
            g.stop_reason.append(next((s for s in stops if s in text), None) if ended_by_string else None)
            g.finish_reason.append("length" if truncated else "stop")
        return g
