"""The output layer as a function: what a causal LM applies between its last hidden state and its logits.

Llama's logits are ``hidden @ W.T``. Other families do more, and a trainer that skips it samples and trains a
different function than the one users deploy: Granite divides by ``logits_scaling``, Cohere multiplies by
``logit_scale``, Gemma 2 soft-caps (``c * tanh(x / c)``), Phi-2 adds a bias. One form covers them all:

    logits = softcap(scale * (hidden @ W.T + bias)),   softcap(x) = c * tanh(x / c)   (none: identity)

The scale and cap are read off the model itself (rlvr.models.policy.output_layer probes it); this module only computes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AUTOCAST_DEVICES = ("cpu", "cuda")  # where model.autocast runs (rlvr.models.policy.autocast)


@dataclass(frozen=True)
class OutputLayer:
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None = None  # [V]
    scale: float = 1.0
    softcap: float | None = None

    def linear(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> hidden @ W.T + bias [..., V], in the weight's dtype (bf16 hidden states of a model whose
        frozen head is kept in fp32 are upcast first; rlvr.models.architecture.output_layer), autocast or not:
        under bf16 autocast (model.autocast) the logits would otherwise keep 8 significant bits."""
        kind = hidden.device.type
        autocasting = kind in AUTOCAST_DEVICES and torch.is_autocast_enabled(kind)
        with torch.autocast(kind, enabled=False) if autocasting else contextlib.nullcontext():
            return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)

    def transform(self, z: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """Scale and soft-cap the linear output z [..., V] (in place when ``inplace``, else z is untouched)."""
        if self.scale != 1.0:
            z = z.mul_(self.scale) if inplace else z * self.scale
            inplace = True  # z is now a tensor of our own
        if self.softcap is not None:
            z = (z.div_(self.softcap) if inplace else z / self.softcap).tanh_().mul_(self.softcap)
        return z

    def transform_grad(self, logits: torch.Tensor) -> torch.Tensor | None:
        """d logits / d z for already transformed ``logits`` [..., V]; None when it is the constant ``scale``."""
        if self.softcap is None:
            return None
        return (1.0 - (logits / self.softcap).square()).mul_(self.scale)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of hidden states [..., H]."""
        return self.transform(self.linear(hidden))


def as_output_layer(head: OutputLayer | torch.Tensor) -> OutputLayer:
    """A bare weight [V, H] is the plain Llama head."""
    return head if isinstance(head, OutputLayer) else OutputLayer(head)
