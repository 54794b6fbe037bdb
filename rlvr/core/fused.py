"""Output layer + log-softmax + per-token loss, fused, with the gradient computed in the forward pass.

For M completion tokens the naive path materialises logits [M, V] and keeps them (and the softmax) for
backward: for SmolLM2 (V = 49,152) that is 200 MB per 1,000 tokens in fp32. Here the tokens are walked in
chunks; for each chunk the logits exist only inside the loop, the per-token loss and its derivative
with respect to the log-prob are taken right away, and the gradients with respect to the hidden states
and the output weight are accumulated on the spot:

    d logp_t / d logits_t = (onehot(y_t) - softmax(logits_t)) / temperature
    grad_hidden_t        = dL/dlogp_t * d logp_t/d logits_t @ W         [c, H]
    grad_W              += (dL/dlogp * d logp/d logits)^T @ hidden       [V, H]

Backward then only scales the stored gradients by the incoming scalar. Memory: [M, H] (+ [V, H] when the
output layer trains) instead of [M, V]; within a chunk at most two [c, V] buffers are kept at once (the
log-probabilities, computed in place over the logits, and the softmax, reused for the logit gradients).
The loss must be a sum of per-token terms, each a function of that token's log-prob only - true of the
clipped surrogate, the KL estimators and every aggregation here.

The output layer is the model's whole head (rlvr.core.head): a bias, a logit scale and a soft-cap enter the chain
rule as d logits / d z; a soft-cap costs a third [c, V] buffer (its derivative), a plain scale none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlvr.core.head import OutputLayer, as_output_layer

TokenLoss = Callable[[torch.Tensor, slice], torch.Tensor]  # (logp [c], token slice) -> weighted loss [c]
Temperature = float | torch.Tensor  # one for all tokens, or one per token [M]


def _chunk_temperature(temperature: Temperature, rows: slice) -> float | torch.Tensor | None:
    """The divisor for a chunk's logits [c, V]: a float, a [c, 1] column, or None when it is 1."""
    if isinstance(temperature, torch.Tensor):
        return temperature[rows, None]
    return None if temperature == 1.0 else temperature


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, token_loss, temperature, chunk_tokens, scale,  # type: ignore[override]
                softcap):
        layer = OutputLayer(weight, bias, scale, softcap)
        m = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 at least; fp64 stays fp64
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
        total = hidden.new_zeros((), dtype=acc)
        logp_out = hidden.new_empty(m, dtype=acc)
        entropy_out = hidden.new_empty(m, dtype=acc)
        for start in range(0, m, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, m))
            h, y = hidden[rows], targets[rows]
            logits = layer.transform(layer.linear(h).to(acc), inplace=True)  # [c, V]
            dz = layer.transform_grad(logits)  # [c, V] d logits / d z under a soft-cap, else None
            temp = _chunk_temperature(temperature, rows)
            if temp is not None:
                logits.div_(temp)
            logp_all = logits.sub_(torch.logsumexp(logits, dim=-1)[:, None])  # [c, V] log-probs, in place
            logp = logp_all.gather(-1, y[:, None]).squeeze(-1)
            probs = logp_all.exp()  # [c, V]: with logp_all, the only two [c, V] buffers of the chunk
            entropy_out[rows] = -torch.bmm(probs[:, None, :], logp_all[:, :, None]).view(-1)  # no [c, V] temporary
            del logits, logp_all
            logp_out[rows] = logp
            with torch.enable_grad():
                lp = logp.detach().requires_grad_(True)
                loss = token_loss(lp, rows)
                (dloss,) = torch.autograd.grad(loss.sum(), lp)
            total += loss.detach().sum()
            dlogits = probs.mul_(-dloss[:, None])  # reuse the softmax buffer: -p * dL/dlogp
            dlogits[torch.arange(dlogits.shape[0]), y] += dloss
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
        ctx.save_for_backward(
            grad_hidden if grad_hidden is not None else hidden.new_empty(0),
            grad_weight.to(weight.dtype) if grad_weight is not None else weight.new_empty(0),
            grad_bias.to(bias.dtype) if grad_bias is not None else weight.new_empty(0),
        )
        ctx.mark_non_differentiable(logp_out, entropy_out)
        return total, logp_out, entropy_out

    @staticmethod
    def backward(ctx, grad_total, _grad_logp, _grad_entropy):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        gh = grad_hidden * grad_total if ctx.needs_input_grad[0] else None
        gw = grad_weight * grad_total if ctx.needs_input_grad[1] else None
        gb = grad_bias * grad_total if ctx.needs_input_grad[2] else None
        return gh, gw, gb, None, None, None, None, None, None


def fused_head_loss(
    hidden: torch.Tensor,
    head: OutputLayer | torch.Tensor,
    targets: torch.Tensor,
    token_loss: TokenLoss,
    temperature: Temperature = 1.0,
    chunk_tokens: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum over tokens of ``token_loss(logp)``, never holding more than [chunk_tokens, V] logits.

    Args:
        hidden: [M, H] final hidden states of the M tokens to score (padding already dropped).
        head: the output layer (rlvr.core.head), or a bare weight [V, H] for logits = hidden @ W.T.
        targets: [M] token ids.
        token_loss: maps a chunk's log-probs [c] (and its slice of the M tokens) to per-token losses [c],
            already weighted so that their sum is this micro-batch's share of the step's loss.
        temperature: a float, or one per token [M] (logits are divided by it).
    Returns:
        the scalar loss (differentiable w.r.t. hidden and the head's weight and bias), log-probs [M] and entropies [M]
        (both detached, for statistics).
    """
    layer = as_output_layer(head)
    return _FusedHeadLoss.apply(hidden, layer.weight, layer.bias, targets, token_loss, temperature, chunk_tokens,
                                layer.scale, layer.softcap)
