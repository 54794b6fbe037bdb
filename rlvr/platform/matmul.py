"""fp32 matrix products on the CPU through oneDNN where it is faster than the BLAS kernel torch calls.

torch's fp32 ``F.linear`` on a CPU is MKL's sgemm, which takes its AVX2 code on AMD CPUs; oneDNN's fp32 kernel
(``torch.ops.mkldnn._linear_pointwise``, the one torch's inductor uses) uses what the CPU has, so on an AVX-512
AMD CPU it runs a decode step's products, the output layer and a training micro-batch's products well ahead of
MKL (figures: docs/experiments/performance.md, "Decoding: folded adapters and precision per machine" and "The
train step and the allocator"). Both are fp32 throughout (products agree to float rounding). Which one runs is
measured once per process and per regime (``onednn_fp32_faster``): a decode step's few rows and a training
micro-batch's thousands can favour different kernels on one CPU (an Intel Xeon: oneDNN ahead at 32 rows, MKL ahead
at 1,024 and more), so each regime keeps the kernel that is faster there.

Used where no weight gradient is needed: sampling (rlvr.rollout.decode_weights) and the frozen base weights under
LoRA (``FrozenLinearFunction``: forward and the input's gradient; rlvr.models.policy patches peft's base layers).
"""

from __future__ import annotations

import functools
import os
import time

import torch
import torch.nn.functional as F

BATCH_ROWS = 256  # from this many rows a product counts as a training micro-batch's, below as a decode step's
PROBES = {"decode": (32, 1024, 2048), "batch": (1024, 1024, 1024)}  # rows, in, out of each regime's timed product


@functools.cache
def onednn_fp32_faster(regime: str = "decode") -> bool:
    """Whether oneDNN's fp32 matmul beats ``F.linear``'s on this CPU by 10 % at ``regime``'s product (``PROBES``;
    timed once per process and regime, on first use, in a fraction of a second);
    ``RLVR_FP32_MATMUL=blas|onednn`` decides instead (tests, A/B measurements)."""
    if os.environ.get("RLVR_FP32_MATMUL") in ("blas", "onednn"):
        return os.environ["RLVR_FP32_MATMUL"] == "onednn"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    rows, d_in, d_out = PROBES[regime]
    x, w = torch.randn(rows, d_in, device="cpu"), torch.randn(d_out, d_in, device="cpu")

    def seconds(f) -> float:
        for _ in range(3):
            f()
        t0 = time.perf_counter()
        for _ in range(10):
            f()
        return time.perf_counter() - t0

    try:
        onednn = seconds(lambda: onednn_linear(x, w, None))
    except RuntimeError:
        return False
    return onednn < 0.9 * seconds(lambda: F.linear(x, w))


def uses_onednn(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of ``rows`` input rows with ``weight`` goes to oneDNN: a plain fp32 CPU tensor, on a CPU
    where oneDNN was faster for products of that many rows."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and \
        type(weight) in (torch.Tensor, torch.nn.Parameter) and \
        onednn_fp32_faster("batch" if rows >= BATCH_ROWS else "decode")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + b`` by oneDNN; x [..., in] fp32, W [out, in] (a transposed view is fine), no autograd."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class FrozenLinearFunction(torch.autograd.Function):
    """``x @ W.T + b`` for a weight (and bias) that is not trained: forward and the input's gradient
    (``grad @ W``) by oneDNN; nothing is saved but the weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return onednn_linear(grad, weight.t(), None), None, None


def frozen_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` for a frozen linear layer: through oneDNN where ``uses_onednn`` says so and the input is fp32,
    else F.linear (a trained weight, another dtype or device, a sharded weight)."""
    weight, bias = layer.weight, layer.bias
    if weight.requires_grad or (bias is not None and bias.requires_grad) or x.dtype != torch.float32 \
            or not uses_onednn(weight, x.numel() // max(x.shape[-1], 1)) or torch.is_autocast_enabled("cpu"):
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled() or not x.requires_grad:
        return onednn_linear(x, weight, bias)
    return FrozenLinearFunction.apply(x, weight, bias)
