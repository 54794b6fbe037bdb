"""Log-probs and entropies of chosen tokens through the output layer, chunk by chunk, never holding [M, V] logits.

    logp, entropy = fused_logprobs(hidden, head, targets)      # [M], [M]; both differentiable

A plain autograd function: the caller computes any loss from ``logp`` (and ``entropy``) and calls backward. For M
tokens the naive path keeps logits [M, V] and the softmax for backward: for SmolLM2 (V = 49,152) 200 MB per 1,000
tokens in fp32. Here forward walks the tokens in chunks and keeps only the log-sum-exp [M]; backward recomputes one
chunk's logits at a time (one more [c, H] x [H, V] product per chunk) and applies

    d logp_t / d logits_t    = (onehot(y_t) - p_t) / temperature
    d entropy_t / d logits_t = -p_t * (log p_t + entropy_t) / temperature
    grad_hidden_t = (g_logp_t * d logp_t/d logits_t + g_entropy_t * d entropy_t/d logits_t) @ W     [c, H]
    grad_W       += (...)^T @ hidden                                                                 [V, H]

Memory: the hidden states [M, H] (+ [V, H] when the output layer trains) instead of [M, V]; within a chunk at most
two [c, V] buffers at once in forward and one in backward (one more each with an entropy gradient or a soft-cap).

The output layer is the model's whole head (rlvr.core.head): a bias, a logit scale and a soft-cap enter the chain
rule as d logits / d z.
"""

from __future__ import annotations

import torch

from rlvr.core.head import OutputLayer, as_output_layer

Temperature = float | torch.Tensor  # one for all tokens, or one per token [M]


def _chunk_temperature(temperature: Temperature, rows: slice) -> float | torch.Tensor | None:
    """The divisor for a chunk's logits [c, V]: a float, a [c, 1] column, or None when it is 1."""
    if isinstance(temperature, torch.Tensor):
        return temperature[rows, None]
    return None if temperature == 1.0 else temperature


def _chunk_logprobs(layer: OutputLayer, h: torch.Tensor, temp, acc: torch.dtype, lse: torch.Tensor | None = None):
    """Log-probabilities [c, V] of a chunk (computed in place over its logits), d logits / d z under a soft-cap
    (else None), and the log-sum-exp [c] (``lse`` when given: backward reuses forward's)."""
    logits = layer.transform(layer.linear(h).to(acc), inplace=True)  # [c, V]
    dz = layer.transform_grad(logits)
    if temp is not None:
        logits.div_(temp)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    return logits.sub_(lse[:, None]), dz, lse


class _FusedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_tokens, scale, softcap):  # type: ignore[override]
        layer = OutputLayer(weight, bias, scale, softcap)
        m = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least; fp64 stays fp64
        logp_out = hidden.new_empty(m, dtype=acc)
        entropy_out = hidden.new_empty(m, dtype=acc)
        lse_out = hidden.new_empty(m, dtype=acc)
        for start in range(0, m, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, m))
            logp_all, _, lse_out[rows] = _chunk_logprobs(layer, hidden[rows], _chunk_temperature(temperature, rows),
                                                         acc)
            logp_out[rows] = logp_all.gather(-1, targets[rows, None]).squeeze(-1)
            probs = logp_all.exp()  # [c, V]: with logp_all, the only two [c, V] buffers of the chunk
            entropy_out[rows] = -torch.bmm(probs[:, None, :], logp_all[:, :, None]).view(-1)  # no [c, V] temporary
            del logp_all, probs
        ctx.save_for_backward(hidden, weight, bias, targets, lse_out, entropy_out,
                              temperature if isinstance(temperature, torch.Tensor) else None)
        ctx.layer = (scale, softcap, chunk_tokens, temperature if not isinstance(temperature, torch.Tensor) else None)
        ctx.set_materialize_grads(False)
        return logp_out, entropy_out

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):  # type: ignore[override]
        hidden, weight, bias, targets, lse, entropy, temp_tensor = ctx.saved_tensors
        scale, softcap, chunk_tokens, temp_float = ctx.layer
        temperature = temp_tensor if temp_tensor is not None else temp_float
        layer = OutputLayer(weight, bias, scale, softcap)
        acc = lse.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
        m = hidden.shape[0]
        if grad_logp is None:
            grad_logp = lse.new_zeros(m)
        for start in range(0, m, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, m))
            h, y, g = hidden[rows], targets[rows], grad_logp[rows].to(acc)
            temp = _chunk_temperature(temperature, rows)
            logp_all, dz, _ = _chunk_logprobs(layer, h, temp, acc, lse[rows])
            if grad_entropy is None:
                probs = logp_all.exp_()  # [c, V], in place: one [c, V] buffer
            else:  # -g_H * p * (log p + H), into the log-prob buffer
                probs = logp_all.exp()
                ent_term = logp_all.add_(entropy[rows, None]).mul_(probs).mul_(-grad_entropy[rows, None].to(acc))
            del logp_all
            dlogits = probs.mul_(-g[:, None])  # reuse the softmax buffer: -p * dL/dlogp
            dlogits[torch.arange(dlogits.shape[0], device=dlogits.device), y] += g
            if grad_entropy is not None:
                dlogits.add_(ent_term)
                del ent_term
            if temp is not None:
                dlogits.div_(temp)
            if dz is not None:
                dlogits.mul_(dz)
            elif scale != 1.0:
                dlogits.mul_(scale)
            del dz
            if grad_hidden is not None:
                grad_hidden[rows] = (dlogits @ weight.to(acc)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(dlogits.T, h.to(acc))
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
            del probs, dlogits
        gw = grad_weight.to(weight.dtype) if grad_weight is not None else None
        gb = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, gw, gb, None, None, None, None, None


def fused_logprobs(
    hidden: torch.Tensor,
    head: OutputLayer | torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    chunk_tokens: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(head(hidden) / temperature)[targets] and the entropy of each distribution, never holding more
    than [chunk_tokens, V] logits.

    Args:
        hidden: [M, H] final hidden states of the M tokens to score (padding already dropped).
        head: the output layer (rlvr.core.head), or a bare weight [V, H] for logits = hidden @ W.T.
        targets: [M] token ids.
        temperature: a float, or one per token [M] (logits are divided by it).
    Returns:
        logp [M] and entropy [M] in at least fp32, both differentiable w.r.t. hidden and the head's weight and bias.
    """
    layer = as_output_layer(head)
    return _FusedLogprobs.apply(hidden, layer.weight, layer.bias, targets, temperature, chunk_tokens, layer.scale,
                                layer.softcap)
