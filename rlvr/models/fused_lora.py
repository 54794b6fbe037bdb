"""A LoRA linear layer as one product and one in-place update: ``y = x W^T + b``, then ``y += s (x A^T) B^T``.

peft computes ``base(x) + lora_B(lora_A(x)) * scaling``: besides the three products, a multiplication and an
addition over the whole output [N, out] in the forward pass and their gradients in the backward, repeated by
activation checkpointing's recompute. Here the adapter's product is accumulated into the base product's output
(``addmm_``, alpha = scaling) and, in the backward, into the input's gradient (``grad W + s (grad B) A``), so no
[N, out] temporaries are made. The frozen base product goes through rlvr.platform.matmul (oneDNN where it measured
faster). What is saved for the backward is what peft saves: the input and the rank-r product ``x A^T``.

Used for the common case only - one active plain LoRA adapter (no DoRA or other variant, no dropout, no adapter
bias), a frozen ``nn.Linear`` base, the input in the weights' dtype, no autocast; anything else is peft's own
forward. Equal to peft's result and gradients to float rounding (tests/test_fused_lora.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from rlvr.platform.matmul import onednn_linear, uses_onednn


def _base_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [N, in] @ W.T (+ b): oneDNN where rlvr.platform.matmul chose it for N rows, else F.linear. W may be a
    transposed view."""
    if x.dtype == torch.float32 and uses_onednn(weight, x.shape[0]):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class LoraLinearFunction(torch.autograd.Function):
    """x [..., in], W [out, in] and b [out] frozen, A [r, in], B [out, r], scale a float -> y [..., out]."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale):  # type: ignore[override]
        flat = x.reshape(-1, x.shape[-1])                                  # [N, in]
        low = flat @ lora_a.t()                                            # [N, r]
        out = _base_product(flat, weight, bias)                           # [N, out]
        out.addmm_(low, lora_b.t(), alpha=scale)
        ctx.save_for_backward(flat, low, weight, lora_a, lora_b)
        ctx.scale, ctx.shape = scale, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        flat, low, weight, lora_a, lora_b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])                               # [N, out]
        g_low = (g @ lora_b).mul_(ctx.scale)                               # [N, r]
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _base_product(g, weight.t(), None)                   # [N, in]
            grad_x.addmm_(g_low, lora_a)
            grad_x = grad_x.view(ctx.shape)
        if ctx.needs_input_grad[3]:
            grad_a = g_low.t() @ flat                                      # [r, in]
        if ctx.needs_input_grad[4]:
            grad_b = (g.t() @ low).mul_(ctx.scale)                         # [out, r]
        return grad_x, None, None, grad_a, grad_b, None


def _fusable(layer, x: torch.Tensor, args: tuple, kwargs: dict) -> str | None:
    """The one active adapter's name when ``layer(x)`` can take the fused path, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
        return None
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if type(base) is not nn.Linear or base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return None
    if not isinstance(layer.lora_dropout[name], nn.Identity) or lora_b.bias is not None or lora_a.bias is not None:
        return None
    dtypes = {x.dtype, base.weight.dtype, lora_a.weight.dtype, lora_b.weight.dtype}
    if len(dtypes) != 1 or torch.is_autocast_enabled(x.device.type):
        return None
    return name


def _forward(layer, peft_forward, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = _fusable(layer, x, args, kwargs)
    if name is None:
        return peft_forward(x, *args, **kwargs)
    base = layer.base_layer
    return LoraLinearFunction.apply(x, base.weight, base.bias, layer.lora_A[name].weight, layer.lora_B[name].weight,
                                    float(layer.scaling[name]))


def fuse_lora_layers(model: nn.Module) -> int:
    """Route every peft LoRA ``Linear`` of ``model`` through the fused path where it applies; the number routed."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if type(module) is LoraLinear and "forward" not in vars(module):
            module.forward = functools.partial(_forward, module, module.forward)
            count += 1
    return count
