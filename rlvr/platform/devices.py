"""Where a run computes and in what precision: ``train.device`` and ``model.dtype`` resolved against the hardware,
the generators sampling draws from, and the one-line advice an out-of-memory error becomes.

What runs where (docs/concepts/devices.md): the policy, the reference, the optimizer state, PPO's critic, the
in-process sampler and the train step live on the run's device; rewards, verifiers, environments and every piece of
bookkeeping stay on the CPU and see plain Python values. Tensors cross once per step each way: the sampled groups
come back to the CPU, the step's batch goes to the device.
"""

from __future__ import annotations

import re

import torch

DEVICE_FORMS = "auto, cpu, cuda, cuda:N or mps"
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:[0-9]+)?")
DTYPES = ("auto", "fp32", "bf16")


def _said(name: str, value: str) -> str:
    """``value`` for the setting ``name`` as a user writes it: a flag (``--device cuda``) or a key
    (``train.device=cuda``)."""
    return f"{name} {value}" if name.startswith("--") else f"{name}={value}"


def check_device_spec(spec: str, name: str = "device") -> None:
    """The spelling of a device setting (``name`` in the message; whether the device exists is checked when it is
    resolved)."""
    if not isinstance(spec, str) or not _DEVICE.fullmatch(spec):
        raise ValueError(f"{name} must be one of {DEVICE_FORMS}; got {spec!r}")


def resolve_device(spec: str = "auto", name: str = "train.device") -> torch.device:
    """The device ``spec`` names: auto is the current CUDA device when one is visible, else the CPU. A CUDA or MPS
    device that is not there is an error saying what to do, not a silent fall-back to the CPU; ``name``: the
    setting the user wrote (``train.device``, ``--device``)."""
    check_device_spec(spec, name if name.startswith("--") else "device")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{_said(name, spec)}: no CUDA device is visible to torch (torch {torch.__version__}, "
                             f"CUDA build {torch.version.cuda or 'none'}); install a CUDA build of torch, or use "
                             f"{_said(name, 'cpu')} (auto picks the CPU when there is no GPU)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{_said(name, spec)}: this machine has {count} CUDA device(s) (cuda:0 to "
                             f"cuda:{count - 1}); pick one of them or set CUDA_VISIBLE_DEVICES")
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{_said(name, spec)}: MPS (Apple GPU) is not available here; use {_said(name, 'cpu')}")
    return device


def bf16_capable(device: torch.device) -> bool:
    """A CUDA device whose matmul units take bf16 (compute capability 8.0+, where torch reports native support)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def autocast_mode(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """``model.autocast`` for weights of ``dtype`` on ``device``: auto is bf16 for fp32 weights on a CUDA card with
    bf16 units (full fine-tuning would otherwise run its matmuls in fp32 on CUDA cores), none elsewhere."""
    if mode != "auto":
        return mode
    return "bf16" if dtype == torch.float32 and bf16_capable(device) else "none"


def weight_dtype(spec: str, device: torch.device, lora: bool, name: str = "model.dtype") -> torch.dtype:
    """The dtype of the model's weights for ``model.dtype``: auto is bf16 for the frozen base under LoRA on a bf16
    GPU (the adapters peft adds stay fp32) and fp32 everywhere else, the CPU included (unchanged); bf16 is refused
    for full fine-tuning: AdamW would step bf16 weights, and updates smaller than bf16's resolution (1/256 of a
    weight) would be lost - model.autocast: bf16 keeps fp32 weights and runs the matmuls in bf16 instead. A model
    nothing trains (rlvr serve, rlvr eval) is asked for with ``lora=True``; ``name``: the setting the user wrote."""
    if spec not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}; got {spec!r}")
    if spec == "auto":
        return torch.bfloat16 if lora and bf16_capable(device) else torch.float32
    if spec == "bf16" and not lora:
        raise ValueError("model.dtype=bf16 needs model.lora=true: full fine-tuning would keep the weights AdamW steps "
                         "in bf16 and lose every update below bf16's resolution; use model.autocast=bf16 (fp32 "
                         "weights, bf16 matmuls) for full fine-tuning")
    return torch.bfloat16 if spec == "bf16" else torch.float32


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def sampling_generator(seed: int, device: torch.device) -> torch.Generator:
    """The generator sampling draws its uniforms from, on ``device``: the CPU's stream on the CPU (unchanged), the
    device's own (Philox) stream on a GPU, so no uniform crosses from the host per decoded token. The same seed gives
    the same samples on one device; CPU and GPU streams differ (torch promises nothing across devices)."""
    return torch.Generator(device=device).manual_seed(seed)


class DeviceMemoryError(RuntimeError):
    """The run's device ran out of memory; the message names the settings to lower."""


def out_of_memory_advice(device: torch.device, settings: dict[str, object], checkpoint: str) -> str:
    """One line for a device out-of-memory error: how much the device held, the knobs that lower the peak with
    their current values, and the checkpoint a resumed run continues from."""
    held = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        held = (f" ({torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated at the peak of "
                f"{total / 2**30:.1f} GiB)")
    knobs = ", ".join(f"{k} (now {v})" for k, v in settings.items())
    return (f"{device} ran out of memory{held}. Lower one of: {knobs}; see `rlvr plan` and docs/concepts/devices.md. "
            f"{checkpoint}")
