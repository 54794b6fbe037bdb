"""The engine of ``rlvr serve`` for a sequence-classification model (a reward model): one thread owns the model and
scores the token ids of every request waiting when a batch starts (plus those arriving within ``batch_wait_s``)
together, in forward passes of similar lengths (rlvr.rewards.reward_model.classify_ids: right padding, the score at
each row's last token), at most ``max_num_seqs`` rows and ``max_batch_tokens`` padded positions each.

It offers what the shared parts of the server read from an engine (rlvr.serve.handling, info_routes): the
tokenizer, ``max_model_len``, ``ready`` / ``load_error``, ``submit``, the counters of /stats, no adapters. At most
``max_queued_rows`` texts are accepted and unfinished at once (beyond: ``ServerBusy``, 503; the admission queue,
rlvr.serve.admission); a request whose client went away is dropped unscored.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from rlvr.models.policy import load_tokenizer, model_context
from rlvr.platform.devices import resolve_device, weight_dtype
from rlvr.rewards.reward_model import classify_ids, load_classifier, reward_model_dir
from rlvr.serve.admission import DEFAULT_QUEUED_ROWS, AdmissionQueue, EngineError, settle
from rlvr.serve.engine import DEFAULT_BATCH_TOKENS, _log, load_on_engine_thread


@dataclass
class ClassifyJob:
    """The texts of one /classify request, to be scored together."""

    cancellable: ClassVar[bool] = True  # a client that goes away has it dropped
    rows: list[list[int]]  # token ids of each text, none empty, none longer than max_model_len
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


def activation(config) -> str:
    """vLLM's default activation of a classifier's outputs (its get_act_fn, without sentence-transformers' own):
    identity for regression, sigmoid for multi-label or one label, softmax otherwise."""
    problem = getattr(config, "problem_type", None) or ""
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or config.num_labels < 2:
        return "sigmoid"
    return "softmax"


def activate(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """[n, num_labels] -> [n, num_labels]"""
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1) if kind == "softmax" else logits


class ClassifyEngine:
    """Owns the classifier; everything that touches it runs on the engine thread."""

    def __init__(self, model: str, max_model_len: int = 0, max_num_seqs: int = 256, batch_wait_s: float = 0.01,
                 threads: int = 0, *, max_batch_tokens: int = 0, max_queued_rows: int = DEFAULT_QUEUED_ROWS,
                 device: str = "auto", dtype: str = "auto"):
        self.device = resolve_device(device, "--device")
        self.weight_dtype = weight_dtype(dtype, self.device, lora=True, name="--dtype")
        self.model_dir = reward_model_dir(model)
        self.tokenizer = load_tokenizer(self.model_dir)
        context = model_context(self.model_dir)
        self.max_model_len = min(max_model_len, context) if max_model_len else context
        if min(max_num_seqs, max_queued_rows) < 1 or max_batch_tokens < 0:
            raise ValueError("--max-num-seqs and --max-queued-rows must be at least 1, --max-batch-tokens at least 0")
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens or max(DEFAULT_BATCH_TOKENS, self.max_model_len)
        self.batch_wait_s, self.threads = batch_wait_s, threads
        self.adapters: dict[str, str] = {}  # none: /v1/models and /stats read it
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.admission = AdmissionQueue(max_queued_rows, "texts", "texts")  # its rows, cancelled: /stats
        self.busy_s = 0.0
        self.batches = self.requests = self.rows = 0
        self._thread = threading.Thread(target=self._run, name="rlvr-classify", daemon=True)

    def start(self) -> ClassifyEngine:
        self._thread.start()
        return self

    def close(self, wait_s: float = 5.0) -> None:
        """Refuse new requests (503) and let the engine thread end once it has scored those accepted before
        (waiting at most ``wait_s``)."""
        self.admission.close()
        if self._thread.is_alive():
            self._thread.join(wait_s)

    def submit(self, job: ClassifyJob) -> concurrent.futures.Future:
        """Queue a job; EngineError (400) if it can never fit, ServerBusy (503) while the queue is full, 503 once
        closed."""
        return self.admission.submit(job, len(job.rows))

    def _run(self) -> None:
        if not load_on_engine_thread(self, self._load_model):
            return
        while True:  # requests sent together (within batch_wait_s of the first) are scored together
            jobs = self.admission.arrivals(wait=True, window_s=self.batch_wait_s)
            if not jobs:
                return  # closed, and every request accepted before has been scored
            live = self.admission.drop_cancelled(jobs)
            if live:
                self._score(live)

    def _load_model(self) -> None:
        """The classifier on its device, its activation and its labels."""
        self.model = load_classifier(self.model_dir, self.device, self.weight_dtype)
        self.activation = activation(self.model.config)
        self.labels = self.model.config.id2label or {}

    def _score(self, jobs: list[ClassifyJob]) -> None:
        """Score every text of ``jobs`` (logits [texts, num_labels] on the CPU) and answer each job its slice."""
        rows = [row for job in jobs for row in job.rows]
        started = time.perf_counter()
        try:
            logits = classify_ids(self.model, rows, self.max_num_seqs, self.max_batch_tokens)  # [N, num_labels]
        except Exception as err:  # noqa: BLE001 (the requests fail, the engine goes on)
            _log(f"scoring failed: {type(err).__name__}: {err}")
            for job in jobs:
                settle(job.future, error=EngineError("scoring failed (see the server's log)", 500))
            return
        finally:
            self.busy_s += time.perf_counter() - started
        self.batches += 1
        self.requests += len(jobs)
        self.rows += len(rows)
        at = 0
        for job in jobs:
            settle(job.future, logits[at:at + len(job.rows)])
            at += len(job.rows)
