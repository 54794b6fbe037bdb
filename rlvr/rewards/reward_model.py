"""Reward models: a sequence-classification model with one label scores each prompt + completion; its raw output
(the logit of that label) is the reward. In process (``AutoModelForSequenceClassification`` on ``device``), or
served over the ``/classify`` API of vLLM and ``rlvr serve`` (rlvr.rewards.classify_client).

What is scored, the same in both forms:
- ``chat="auto"`` with a chat template: the template applied to the prompt's messages (a string prompt is one user
  message) plus the completion as the assistant's turn, ``add_generation_prompt=False``, tokenized without added
  special tokens (the template writes them): vLLM's ``/classify`` with ``messages``. TRL scores string prompts as
  plain ``prompt + completion`` instead; rlvr templates both.
- ``chat=False``, or no chat template: the prompt's text (messages' contents joined by newlines) followed by the
  completion's, tokenized with the tokenizer's special tokens: vLLM's ``/classify`` with ``input`` texts.
- Longer than ``max_length`` tokens: the last ``max_length`` are kept (the prompt's start goes first), as vLLM's
  ``truncate_prompt_tokens`` with ``truncation_side: left``. The completion is text (``completion_text``: an
  episode's last assistant turn).
- The score is the head's output at the last token (decoder models; an encoder's pooling is its own). Batches are
  right-padded; HF reads the score at the rightmost token that is not ``pad_token_id``, so each batch pads with an
  id that ends none of its rows (the config's pad id when it can): a row ending in the pad token (an EOS used as
  pad) is scored at its true last token, as vLLM does and as it is unbatched.

The weights load once, at the first call (``check_rewards``' placeholder call, before training); the config (one
label, an architecture ``*ForSequenceClassification``) and tokenizer are checked when the reward is built. A model
that cannot score a completion (empty text) gives None.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlvr.models.prompts import chat_token_ids, defused
from rlvr.rewards.base import completion_text, plain_text

SEQ_CLS = "ForSequenceClassification"
MAX_CONFIG_BYTES = 4 << 20
CHAT_MODES = ("auto", True, False)


def seq_cls_config(path: Path) -> dict | None:
    """config.json of a directory holding a sequence-classification model (an architecture ``*ForSequence
    Classification``), or None (no such file, unreadable, another kind of model)."""
    file = Path(path) / "config.json"
    try:
        if not file.is_file() or file.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(architectures, str):
        architectures = [architectures]
    if not isinstance(architectures, list) or not any(isinstance(a, str) and a.endswith(SEQ_CLS)
                                                       for a in architectures):
        return None
    return config


def find_reward_model(name: str) -> Path | None:
    """The directory ``name`` names (a local directory, or a Hub id in the Hugging Face cache; nothing is
    downloaded) when it holds a sequence-classification model; None otherwise."""
    from rlvr.models.policy import hub_cache_dir

    if not isinstance(name, str) or not name or "\x00" in name:
        return None
    path = Path(name).expanduser()
    if not path.is_dir():
        path = hub_cache_dir(name)
    return path if path is not None and seq_cls_config(path) is not None else None


def reward_model_dir(name: str) -> Path:
    """``find_reward_model``, or a one-line error saying what is expected."""
    path = find_reward_model(name)
    if path is None:
        where = Path(name).expanduser()
        what = ("has no config.json naming a *ForSequenceClassification architecture" if where.is_dir() else
                "is neither a local directory nor a Hub id in the Hugging Face cache (rlvr never downloads models)")
        raise ValueError(f"reward_model: model {name!r} {what}; pass a directory saved with save_pretrained() of an "
                         "AutoModelForSequenceClassification with one label (num_labels=1)")
    return path


def check_one_label(num_labels: Any, where: str) -> None:
    if num_labels != 1:
        raise ValueError(f"reward_model: {where} has num_labels={num_labels}; a reward model has exactly one label "
                         "(num_labels=1: one score per completion)")


def load_classifier(path: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``AutoModelForSequenceClassification`` from ``path`` on ``device``, frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: transformers cannot load it as AutoModelForSequenceClassification: "
                         f"{' '.join(str(err).split())[:300]}") from err
    return model.to(device).eval().requires_grad_(False)


def score_ids(tokenizer: Any, prompt: Any, text: str, chat: bool, max_length: int) -> list[int]:
    """The token ids a reward model scores for one completion (see the module docstring), its last ``max_length``
    kept. The completion (and the prompt's messages) are read as text: a special-token string in them is never a
    turn boundary (rlvr.models.prompts.chat_token_ids; plain text: such strings broken by a word joiner)."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        messages.append({"role": "assistant", "content": text})
        ids = chat_token_ids(tokenizer, messages, add_generation_prompt=False)
    else:
        ids = tokenizer(plain_text(prompt, defused(tokenizer, text)), add_special_tokens=True)["input_ids"]
    return list(ids[-max_length:]) if max_length > 0 else list(ids)


def batch_pad_id(model: nn.Module, rows: list[list[int]]) -> int:
    """A padding id that ends none of ``rows``: the config's pad id when it can, else the smallest other id."""
    ends = {row[-1] for row in rows}
    pad = model.config.get_text_config().pad_token_id
    if pad is not None and pad not in ends:
        return int(pad)
    return next(i for i in range(len(ends) + 1) if i not in ends)


def length_batches(rows: list[list[int]], batch_size: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices of ``rows`` in batches of similar lengths, longest first: at most ``batch_size`` rows, and (when
    ``max_tokens`` > 0) at most ``max_tokens`` padded positions, a longer row alone."""
    batches: list[list[int]] = []
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i])):
        b = batches[-1] if batches else None
        if b is None or len(b) >= batch_size or (max_tokens and (len(b) + 1) * len(rows[b[0]]) > max_tokens):
            batches.append([i])
        else:
            b.append(i)
    return batches


@torch.inference_mode()
def classify_ids(model: nn.Module, rows: list[list[int]], batch_size: int, max_tokens: int = 0) -> torch.Tensor:
    """[N, num_labels] float32 on the CPU: the head's output for each row of token ids (none empty), in batches of
    similar lengths (``length_batches``), right-padded."""
    config = model.config.get_text_config()
    device = next(model.parameters()).device
    out = torch.empty(len(rows), model.config.num_labels, dtype=torch.float32, device="cpu")
    for b_idx in length_batches(rows, batch_size, max_tokens):
        b_rows = [rows[i] for i in b_idx]
        width = max(len(r) for r in b_rows)
        pad = batch_pad_id(model, b_rows)
        b_ids = torch.full((len(b_rows), width), pad, dtype=torch.long, device="cpu")  # [b, T]
        b_mask = torch.zeros((len(b_rows), width), dtype=torch.long, device="cpu")  # [b, T]
        for r, row in enumerate(b_rows):
            b_ids[r, :len(row)] = torch.tensor(row, dtype=torch.long, device="cpu")
            b_mask[r, :len(row)] = 1
        kept = config.pad_token_id
        config.pad_token_id = pad  # HF pools at the rightmost token that is not this id: the last real one
        try:
            logits = model(input_ids=b_ids.to(device), attention_mask=b_mask.to(device)).logits  # [b, num_labels]
        finally:
            config.pad_token_id = kept
        out[torch.tensor(b_idx, device="cpu")] = logits.float().cpu()  # one crossing per batch
    return out


class LocalScorer:
    """A reward model in this process: the tokenizer now, the weights at the first call (once, under a lock: the
    asynchronous runtime may score from several threads)."""

    def __init__(self, model: str | nn.Module, device: str, batch_size: int, max_length: int, chat: Any):
        from rlvr.models.policy import load_tokenizer
        from rlvr.platform.devices import resolve_device

        self.model: nn.Module | None = None
        self.batch_size, self.max_length = batch_size, max_length
        if isinstance(model, nn.Module):  # an object from GRPOTrainer(reward_funcs=model): used where it is
            check_one_label(getattr(model.config, "num_labels", None), type(model).__name__)
            source = find_reward_model(str(getattr(model, "name_or_path", "") or ""))
            if source is None:
                raise ValueError(f"reward_model: the {type(model).__name__} object has no tokenizer to use (its "
                                 "name_or_path is not a directory holding it); save the model and its tokenizer "
                                 "with save_pretrained(DIR) and pass DIR")
            self.path, self.device = None, next(model.parameters()).device
            self._use(model.eval().requires_grad_(False))
            tokenizer = load_tokenizer(source)
        else:
            self.path = reward_model_dir(model)
            config = seq_cls_config(self.path) or {}
            check_one_label(config.get("num_labels", len(config.get("id2label") or {}) or 2), str(self.path))
            self.device = resolve_device(device, "reward_model device")
            tokenizer = load_tokenizer(self.path)
        self.tokenizer = tokenizer
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat == "auto" else chat
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"reward_model: chat=True but the tokenizer of {self.path or 'the model'} has no chat "
                             "template; use chat: auto or false (plain prompt + completion text)")
        self._lock = threading.Lock()

    def _use(self, model: nn.Module) -> None:
        """Score with ``model``: at most its context is read."""
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if context:
            self.max_length = min(self.max_length, int(context))
        self.model = model

    def _loaded(self) -> nn.Module:
        if self.model is None:
            model = load_classifier(self.path, self.device)
            check_one_label(model.config.num_labels, str(self.path))
            self._use(model)
        return self.model

    def score(self, prompts: list, texts: list[str]) -> list[float | None]:
        with self._lock:
            model = self._loaded()
            rows = [score_ids(self.tokenizer, p, t, self.chat, self.max_length) for p, t in zip(prompts, texts)]
            present = [i for i, row in enumerate(rows) if row]
            values: list[float | None] = [None] * len(rows)
            if present:
                scores = classify_ids(model, [rows[i] for i in present], self.batch_size)  # [n, 1]
                for i, v in zip(present, scores[:, 0].tolist()):
                    values[i] = v
            return values


class RewardModel:
    """The reward function: ``f(prompts, completions, **columns) -> list[float | None]`` (TRL's signature)."""

    def __init__(self, scorer: Any, name: str):
        self.scorer, self.name = scorer, name

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        texts = [completion_text(c) for c in completions]
        values = self.scorer.score(list(prompts), texts)
        log_metric = columns.get("log_metric")
        stats = getattr(self.scorer, "drain_stats", None)
        if log_metric is not None and stats is not None:
            for key, value in stats().items():
                log_metric(f"reward_model/{key}", value)
        return values

    def close(self) -> None:
        """A served reward model's threads and connections closed (nothing to do in process)."""
        close = getattr(self.scorer, "close", None)
        if close is not None:
            close()

    def __repr__(self) -> str:
        return f"reward_model({self.name})"


def reward_model(model: str | nn.Module, base_url: str = "", api_key_env: str = "", batch_size: int = 8,
                 max_length: int = 1024, device: str = "cpu", chat: bool | str = "auto", timeout_s: float = 60.0,
                 retries: int = 3, backoff_s: float = 0.5) -> RewardModel:
    """A reward model as a reward function (see the module docstring).

    ``model``: a directory (or Hub id in the local cache) of an ``AutoModelForSequenceClassification`` with one
    label, or such a model object (in process only; its tokenizer is read from its ``name_or_path``); served, the
    name the server serves it under (vLLM's ``--model`` or ``--served-model-name``).
    ``base_url``: score over that server's ``/classify`` (vLLM or ``rlvr serve``; a trailing ``/v1`` is dropped)
    instead of in process, with the API key read from the environment variable ``api_key_env``.
    ``batch_size``: completions per forward pass in process; served, requests in flight at once (one conversation
    each, or ``batch_size`` texts each with ``chat: false``).
    ``max_length``: tokens scored, the last ones kept (at most the model's context).
    ``device``: cpu, cuda, cuda:N or auto (in process).
    ``chat``: auto (the chat template when the tokenizer has one; served: always), true or false.
    Served: each request has ``timeout_s`` seconds; timeouts, connection errors, 429 and 5xx are retried up to
    ``retries`` times (``backoff_s`` doubling, or the server's Retry-After); a completion whose request still fails
    or whose answer is malformed scores None (rlvr.rewards.classify_client)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"reward_model: batch_size must be an integer >= 1; got {batch_size!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"reward_model: max_length must be an integer >= 1; got {max_length!r}")
    if chat not in CHAT_MODES or isinstance(chat, int) and not isinstance(chat, bool):
        raise ValueError(f"reward_model: chat must be auto, true or false; got {chat!r}")
    if base_url:
        from rlvr.rewards.classify_client import ClassifyClient

        if not isinstance(model, str):
            raise ValueError("reward_model: a served reward model is named by a string (model: DIR or the served "
                             "name), not a model object")
        scorer = ClassifyClient(base_url, model, api_key_env, batch_size, max_length, chat is not False, timeout_s,
                                retries, backoff_s)
        return RewardModel(scorer, f"{model} at {base_url}")
    name = model if isinstance(model, str) else type(model).__name__
    return RewardModel(LocalScorer(model, device, batch_size, max_length, chat), name)
