"""The weights a generation decodes with: LoRA folded into the base weights, in the precision chosen for sampling.

peft computes a LoRA layer as ``base(x) + scale * B(A(x))``: three matmuls, an add and the adapter's bookkeeping per
layer and token. Nothing trains while sampling, so the adapter can be folded into a copy of the weight,
``W + scale * B @ A``, and a decode step pays one matmul per layer. The copy is made when a generation starts and
dropped when it ends (one rank-r product per layer: tens of milliseconds at 135M), so it always holds the latest
update and costs no memory during the train step; a server, which decodes batch after batch with the same adapter,
keeps it (``DecodeCache``) until the adapter's tensors change.

bf16: a decode step at a few dozen rows reads every weight once and does little with it, so on CPUs it is bound by
memory bandwidth as much as by FLOPs; bf16 copies of the weights halve what it reads and run on bf16 units where
the CPU has them (AMX, AVX512-BF16). Only the matmuls run in bf16; activations, norms, attention and the sampled
distribution stay fp32. The behaviour log-probs are those of the weights actually used, so the trainer's importance
weight pi / pi_behav corrects the difference (benchmarks/decoding.py reports its size).

Layers left as they are (decoded through peft, in the model's dtype): LoRA variants (DoRA), adapters with a bias,
adapters on stacked expert parameters, and layers whose adapters are disabled (the reference policy).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rlvr.core.head import OutputLayer
from rlvr.models.architecture import unwrap
from rlvr.models.policy import backbone_and_head
from rlvr.platform.devices import bf16_capable
from rlvr.platform.matmul import onednn_linear, uses_onednn

PRECISIONS = ("auto", "fp32", "bf16")


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` in W's dtype, for sampling (no gradient): fp32 on a CPU goes to oneDNN's kernel where it was
    measured faster (rlvr.platform.matmul); both are fp32 throughout (log-probs agree to ~1e-6)."""
    x = x.to(weight.dtype)
    if not torch.is_grad_enabled() and uses_onednn(weight, x.numel() // max(x.shape[-1], 1)):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class FrozenLinear(nn.Module):
    """``x @ W.T + b`` with W [out, in] held in the decoding dtype; inputs and outputs keep their own dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias  # plain tensors: nothing here is a parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decode_linear(x, self.weight, self.bias).to(x.dtype)


@dataclass(frozen=True)
class DecodeHead:
    """The output layer with its weight in the decoding dtype; logits [A, V] come back in fp32."""

    layer: OutputLayer

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        z = decode_linear(hidden, self.layer.weight, self.layer.bias).float()
        return self.layer.transform(z, inplace=True)


def _lora_linear_class():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # peft missing: no LoRA layers to fold
        return None
    return Linear


def _foldable(module: nn.Module) -> list[str] | None:
    """The active adapters of a peft LoRA linear layer that can be folded into its weight; None: leave it as it is."""
    lora_linear = _lora_linear_class()
    if lora_linear is None or not isinstance(module, lora_linear) or module.merged:
        return None
    if module.disable_adapters:
        return []  # the base layer alone
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    for a in adapters:
        if module.lora_variant.get(a) is not None or module.lora_bias.get(a, False):
            return None
        if not isinstance(module.base_layer, nn.Linear):
            return None
    return adapters


@torch.no_grad()
def _frozen_weights(module: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in], bias) of ``module`` as it computes while decoding, in ``dtype``; None: keep the module."""
    adapters = _foldable(module)
    if adapters is not None:
        base = module.base_layer
        weight = base.weight.detach()
        for i, a in enumerate(adapters):
            lora_b, lora_a = module.lora_B[a].weight, module.lora_A[a].weight  # [out, r], [r, in]
            if module.fan_in_fan_out or lora_a.dtype != weight.dtype:
                weight = weight + module.get_delta_weight(a).to(weight.dtype)
            elif i == 0:  # one pass: W + scale * B @ A into a new tensor
                weight = torch.addmm(weight, lora_b, lora_a, alpha=module.scaling[a])
            else:
                weight.addmm_(lora_b, lora_a, alpha=module.scaling[a])
        bias = None if base.bias is None else base.bias.detach()
    elif type(module) is nn.Linear and dtype != module.weight.dtype:
        weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    else:
        return None
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _key(module: nn.Module) -> tuple:
    """What a folded weight depends on: its source tensors, by identity and in-place version."""
    tensors = [t for t in module.parameters()]
    return tuple((id(t), t._version) for t in tensors) + (getattr(module, "disable_adapters", None),
                                                         tuple(getattr(module, "active_adapters", ()) or ()))


SHARED_INPUT = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"})
"""Sibling projections that read the same input in the common decoder families: folded into one weight, they run as
one matmul (``FusedLinear``)."""


class _Fused:
    """Weights [sum of outputs, in] of sibling projections, and the last input's output (read by each sibling)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
        self.weight = torch.cat(weights)
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        self.sizes = [w.shape[0] for w in weights]
        self.forget()

    def forget(self) -> None:
        self.x, self.version, self.outputs, self.taken = None, -1, (), set()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Sibling ``index``'s output for ``x``; each computed output is handed out once (a second call recomputes,
        so an output changed in place by its reader is never handed out again)."""
        if self.x is not x or self.version != x._version or index in self.taken:
            y = decode_linear(x, self.weight, self.bias).to(x.dtype)  # [..., sum of outputs]
            self.x, self.version, self.outputs, self.taken = x, x._version, y.split(self.sizes, dim=-1), set()
        self.taken.add(index)
        return self.outputs[index]


class FusedLinear(nn.Module):
    """One projection of a ``_Fused`` group: the first sibling called with an input computes every sibling's output
    in one matmul; the others read theirs. A sibling called with another input recomputes (always correct)."""

    def __init__(self, group: _Fused, index: int):
        super().__init__()
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


class DecodeCache:
    """Folded weights kept between generations (a server's), rebuilt per group when its tensors change."""

    def __init__(self):
        self.groups: dict[tuple[tuple[str, ...], torch.dtype], tuple[tuple, list[nn.Module]]] = {}
        self.head: tuple[tuple, DecodeHead] | None = None

    def clear(self) -> None:
        self.groups.clear()
        self.head = None


def _groups(backbone: nn.Module, dtype: torch.dtype) -> list[tuple[str, ...]]:
    """The layers decoding replaces, by name, siblings that share their input together."""
    names, skip = [], None
    for name, module in backbone.named_modules():
        if not name or (skip and name.startswith(skip)):
            continue
        if _foldable(module) is not None or (type(module) is nn.Linear and dtype != module.weight.dtype):
            names.append(name)
            skip = name + "."
    by_parent: dict[tuple, list[str]] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        kind = next((i for i, siblings in enumerate(SHARED_INPUT) if child in siblings), None)
        by_parent.setdefault((parent, kind) if kind is not None else (name,), []).append(name)
    return [tuple(group) for group in by_parent.values()]


def _build(backbone: nn.Module, group: tuple[str, ...], dtype: torch.dtype) -> list[nn.Module] | None:
    frozen = [_frozen_weights(backbone.get_submodule(name), dtype) for name in group]
    if any(f is None for f in frozen):
        return None
    if len(group) == 1:
        return [FrozenLinear(*frozen[0])]
    if len({w.shape[1] for w, _ in frozen}) != 1:
        return [FrozenLinear(*f) for f in frozen]
    fused = _Fused([w for w, _ in frozen], [b for _, b in frozen])
    return [FusedLinear(fused, i) for i in range(len(group))]


def _replacements(backbone: nn.Module, dtype: torch.dtype, cache: DecodeCache | None) -> list[tuple[str, nn.Module]]:
    out = []
    for group in _groups(backbone, dtype):
        key = tuple(_key(backbone.get_submodule(name)) for name in group) if cache is not None else None
        cached = cache.groups.get((group, dtype)) if cache is not None else None
        if cached is not None and cached[0] == key:
            layers = cached[1]
        else:
            layers = _build(backbone, group, dtype)
            if layers is None:
                continue
            if cache is not None:
                cache.groups[(group, dtype)] = (key, layers)
        out += list(zip(group, layers))
    return out


def _swap(root: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent, _, child = name.rpartition(".")
    holder = root.get_submodule(parent) if parent else root
    old = getattr(holder, child)
    setattr(holder, child, module)
    return old


@contextlib.contextmanager
def decoding(model: nn.Module, dtype: torch.dtype = torch.float32, cache: DecodeCache | None = None,
             fold: bool = True) -> Iterator[tuple[nn.Module, object]]:
    """(backbone, head) to decode with: the model's own body with its LoRA layers folded (and, for bf16, every
    linear layer cast), and its output layer, whose logits are fp32. ``fold=False`` copies no weight: the body
    decodes through peft in the model's own dtype (``dtype`` is then ignored). The model is restored on exit; do
    not train it meanwhile."""
    backbone, head = backbone_and_head(model)
    own = unwrap(model).get_output_embeddings().weight
    if not fold:
        dtype = own.dtype
    swaps = _replacements(backbone, dtype, cache) if fold else []
    if head.weight is not own:  # the fp32 copy of a frozen bf16 head: decoded in fp32 as the learner computes it
        dtype = head.weight.dtype
    if dtype != head.weight.dtype or head.weight.dtype in (torch.bfloat16, torch.float16):  # fp32 logits always
        key = (id(head.weight), head.weight._version, dtype)
        if cache is not None and cache.head is not None and cache.head[0] == key:
            head = cache.head[1]
        else:
            head = DecodeHead(replace(head, weight=head.weight.detach().to(dtype),
                                      bias=None if head.bias is None else head.bias.detach().to(dtype)))
            if cache is not None:
                cache.head = (key, head)
    originals = [(name, _swap(backbone, name, layer)) for name, layer in swaps]
    try:
        yield backbone, head
    finally:
        for name, module in reversed(originals):
            _swap(backbone, name, module)
        for _, layer in swaps:  # the last inputs and outputs are not kept
            if isinstance(layer, FusedLinear):
                layer.group.forget()


# ----------------------------------------------------------------------------------------------- precision
@functools.cache
def bf16_matmul_hardware(device: str = "cpu") -> bool:
    """Whether ``device`` has bf16 matmul units: a CUDA card of compute capability 8.0+ (the learner's own rule,
    rlvr.platform.devices.bf16_capable: torch's ``is_bf16_supported`` also says yes on a T4 or V100, where bf16 is
    emulated), or a CPU with AMX-BF16 or AVX512-BF16 (without them bf16 is emulated, far slower than fp32:
    docs/experiments/performance.md, "Decoding: folded adapters and precision per machine")."""
    if device.startswith("cuda"):
        return bool(torch.cuda.is_available()) and bf16_capable(torch.device(device))
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: do not guess
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


AUTO_BF16_MIN_PARAMETERS = 50_000_000
"""auto picks bf16 only from this size on: below it the weights sit in the CPU's caches, a decode step is bound by
per-kernel overhead, and bf16 only adds casts."""


def decode_dtype(precision: str, model: nn.Module | None = None) -> torch.dtype:
    """The dtype decoding matmuls run in: fp32, bf16, or auto: the model's own dtype when it is bf16 (or fp16);
    bf16 for an fp32 model of at least AUTO_BF16_MIN_PARAMETERS on hardware with bf16 matmul units; else fp32.
    Without a model, auto means fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"decode precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    if model is None:
        return torch.float32
    weight = next(model.parameters())
    if weight.dtype in (torch.bfloat16, torch.float16):  # a bf16 model (model.dtype) decodes in it: no fp32 copies
        return weight.dtype
    big = sum(p.numel() for p in model.parameters()) >= AUTO_BF16_MIN_PARAMETERS
    bf16 = weight.dtype == torch.float32 and big and bf16_matmul_hardware(weight.device.type)
    return torch.bfloat16 if bf16 else torch.float32


def folded_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the folded copies of a generation take: every layer ``decoding`` replaces, in ``dtype``, and the output
    layer when it is cast."""
    backbone, head = backbone_and_head(model)
    layers = [backbone.get_submodule(name) for group in _groups(backbone, dtype) for name in group]
    total = sum((m.get_base_layer() if hasattr(m, "get_base_layer") else m).weight.numel() for m in layers)
    own = unwrap(model).get_output_embeddings().weight  # not cast when the head computes through an fp32 copy
    return (total + (head.weight.numel() if head.weight is own and dtype != own.dtype else 0)) * dtype.itemsize


FOLD_HEADROOM = 0.25
"""auto folds on a GPU only while the device keeps this share of its memory free after the copies and the
generation's own tensors."""


def generation_bytes(model: nn.Module, rows: int, tokens: int) -> int:
    """What a generation of ``rows`` sequences of up to ``tokens`` tokens allocates besides the weights: the KV cache
    (keys and values of every layer, in the model's dtype) and two steps' fp32 logits [rows, V]."""
    config = unwrap(model).config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    size = next(model.parameters()).element_size()
    vocab = unwrap(model).get_output_embeddings().weight.shape[0]
    return 2 * layers * rows * tokens * kv_heads * head_dim * size + 2 * rows * vocab * 4


def fold_fits(model: nn.Module, dtype: torch.dtype, reserve: int = 0) -> bool:
    """rollout.fold_lora=auto: on a CUDA device, whether the folded copies and ``reserve`` (the generation's own
    tensors: ``generation_bytes``) leave FOLD_HEADROOM of the device free (free memory counts what torch's
    allocator caches but no tensor holds); elsewhere always."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return True
    free, total = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free - folded_bytes(model, dtype) - reserve >= FOLD_HEADROOM * total


def fold_choice(fold_lora: bool | str, model: nn.Module, dtype: torch.dtype, rows: int = 0, tokens: int = 0) -> bool:
    """rollout.fold_lora resolved for one generation of ``rows`` sequences of up to ``tokens`` tokens: true, false,
    or auto (``fold_fits``)."""
    if fold_lora != "auto":
        return bool(fold_lora)
    on_gpu = next(model.parameters()).device.type == "cuda"  # elsewhere auto always folds: nothing to count
    return fold_fits(model, dtype, generation_bytes(model, rows, tokens) if rows and on_gpu else 0)
