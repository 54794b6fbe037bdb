"""What rlvr must know about a model's architecture, read off the model itself rather than from a list of families.

rlvr samples and trains through a backbone + output-layer split (its own KV cache, its own fused output layer), so
anything a family does after the backbone or inside its cache must be reproduced or refused:
- **the output layer**: ``output_layer`` probes the model once - its own forward on chosen last hidden states - and
  fits ``logits = softcap(scale * (h @ W.T + b))`` (rlvr.core.head) to what it returns; a model whose head is not of
  that form is refused with a clear error instead of being trained as a different function;
- **sliding-window attention**: rlvr's cache keeps every position and the model's own masks apply the window over
  cache columns, which is exact for left-padded rows; a prefix shared by all prompts is laid out with padding in
  the middle, so ``attention_window`` tells the callers to share a prefix only when a sequence fits in the window;
- **layer kinds**: attention-only decoders (full, sliding, chunked); recurrent or linear-attention layers (hybrid
  caches) are refused.
- **LoRA targets**: ``lora_targets`` lists every linear layer of the decoder (peft's "all-linear": not the output
  layer) and the stacked expert weights of MoE layers; routers stay frozen.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rlvr.core.head import OutputLayer

ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
_PROBE_ROWS = 33  # hidden states h = s * d for s log-spaced over 1e-4 .. 1e4: linear, bent and saturated regimes


class UnsupportedArchitecture(ValueError):
    pass


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def output_layer(model: nn.Module) -> OutputLayer:
    """The model's output layer as a function of its last hidden state (derived once per model, then cached)."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    if hasattr(head, "base_layer"):  # a LoRA adapter on the output layer: the fused path would skip its delta
        raise UnsupportedArchitecture("LoRA on the output layer is not supported; leave it out of model.lora_targets.")
    if not isinstance(head, nn.Linear):
        raise UnsupportedArchitecture(f"{type(inner).__name__}: the output layer is {type(head).__name__}, not a "
                                      "linear layer; rlvr's fused output layer cannot reproduce it.")
    fitted = inner.__dict__.get("_rlvr_logit_map")
    if fitted is None:
        fitted = inner.__dict__["_rlvr_logit_map"] = _fit_logit_map(inner, head)
    return OutputLayer(*_fp32_if_frozen_half(inner, head), *fitted)


def _fp32_if_frozen_half(inner: nn.Module, head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's (weight, bias), as an fp32 copy when they are bf16 / fp16 and frozen (a bf16 base under
    LoRA, a server's model): logits in bf16 keep 8 significant bits, so a hidden state that moves by a rounding
    step moves a logit by up to 1/16 at 8-16 (ScaleRL's and MiniMax-M1's fp32 head). The copy (V x H x 4 bytes) is
    made once and kept while the weight is unchanged; sampler and learner both compute through it."""
    weight, bias = head.weight, head.bias
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.requires_grad:
        return weight, bias
    key = (id(weight), weight._version)
    cached = inner.__dict__.get("_rlvr_fp32_head")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = inner.__dict__["_rlvr_fp32_head"] = (key, weight.float(), None if bias is None else bias.float())
    return cached[1], cached[2]


@torch.no_grad()
def _fit_logit_map(inner: nn.Module, head: nn.Linear) -> tuple[float, float | None]:
    """(scale, softcap) such that the model's logits are softcap(scale * head(h)); raises when none fits."""
    z, logits = (t.double().flatten() for t in _probe(inner, head))  # [K * V] each
    tol = 64 * torch.finfo(head.weight.dtype).eps * (1 + logits.abs())

    def fits(scale: float, softcap: float | None) -> bool:
        return bool(((OutputLayer(head.weight, None, scale, softcap).transform(z) - logits).abs() <= tol).all())

    if fits(1.0, None):
        return 1.0, None
    small = z.abs() <= z.abs().quantile(0.01)  # the linear regime of any cap: the slope there is the scale
    scale = float((logits[small] * z[small]).sum() / z[small].square().sum())
    if fits(scale, None):
        return scale, None
    softcap = _fit_softcap(scale * z, logits)
    if softcap is not None and fits(scale, softcap):
        return scale, softcap
    raise UnsupportedArchitecture(
        f"{type(inner).__name__}: its logits are not softcap(scale * lm_head(h)) of the last hidden state; rlvr's "
        "sampler and fused output layer would sample and train a different function than the model computes."
    )


def _fit_softcap(x: torch.Tensor, logits: torch.Tensor) -> float | None:
    """c with logits = c * tanh(x / c), from entries where the cap bends the line (tanh(u) / u = r, solved for u)."""
    ratio = logits / x
    bent = (x.abs() > 1e-6) & (ratio > 0.3) & (ratio < 0.9)
    if not bool(bent.any()):
        return None
    r = ratio[bent]
    lo, hi = torch.full_like(r, 1e-6), torch.full_like(r, 50.0)  # tanh(u)/u falls from 1 to 0 as u grows
    for _ in range(80):
        mid = (lo + hi) / 2
        falls_short = torch.tanh(mid) / mid < r
        hi, lo = torch.where(falls_short, mid, hi), torch.where(falls_short, lo, mid)
    return float((x[bent] / ((lo + hi) / 2)).abs().median())


def _probe(inner: nn.Module, head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model with its backbone's output replaced by chosen hidden states [K, H]; return head(h) and the
    model's logits, both [K, V]."""
    weight = head.weight
    direction = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64,
                            device="cpu")  # the same probe on every device
    direction /= direction.norm()
    scales = torch.logspace(-4, 4, _PROBE_ROWS, dtype=torch.float64, device="cpu")
    hidden = (scales[:, None] * direction * weight.shape[1] ** 0.5).to(weight.dtype).to(weight.device)  # [K, H]

    def replace(_module, _args, output):
        output.last_hidden_state = hidden[None]
        return output

    body = getattr(inner, inner.base_model_prefix)
    handle = body.register_forward_hook(replace)
    was_training = inner.training
    inner.eval()
    try:
        ids = torch.zeros(1, _PROBE_ROWS, dtype=torch.long, device=weight.device)
        logits = inner(input_ids=ids, use_cache=False).logits[0]
    finally:
        handle.remove()
        inner.train(was_training)
    return head(hidden), logits


def attention_window(config) -> int | None:
    """The narrowest window any attention layer sees (sliding or chunked attention); None: the whole sequence."""
    types = set(getattr(config, "layer_types", None) or ())
    windows = []
    if getattr(config, "sliding_window", None) and (not types or "sliding_attention" in types):
        windows.append(int(config.sliding_window))
    if getattr(config, "attention_chunk_size", None):
        windows.append(int(config.attention_chunk_size))
    return min(windows) if windows else None


def share_prefix_within(config, columns: int, share_prefix: int) -> int:
    """``share_prefix`` if a shared prompt prefix is exact for sequences of ``columns`` cache columns, else 0."""
    window = attention_window(config)
    return share_prefix if window is None or columns <= window else 0


def check_layers(config) -> None:
    """Refuse layer kinds rlvr's cache cannot hold (recurrent state, linear attention)."""
    other = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS
    if other:
        raise UnsupportedArchitecture(
            f"{config.model_type} models have {sorted(other)} layers; rlvr samples and trains attention-only "
            "decoders (full, sliding-window or chunked attention)."
        )


def lora_targets(model: nn.Module) -> tuple[list[str], list[str]]:
    """Every linear layer of the decoder by leaf name (not the output layer) and the stacked expert weights of MoE
    layers (3-D parameters, adapted by peft's ``target_parameters``), both sorted."""
    inner = unwrap(model)
    head = inner.get_output_embeddings()
    linear = {name.rsplit(".", 1)[-1] for name, module in inner.named_modules()
              if isinstance(module, nn.Linear) and module is not head}
    stacked = {match[1] for name, p in inner.named_parameters()
               if p.dim() == 3 and (match := re.fullmatch(r".*?\.\d+\.(.+)", name))}  # mlp.experts.gate_up_proj
    return sorted(linear), sorted(stacked)
