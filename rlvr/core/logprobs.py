"""Log-probabilities of chosen tokens from final hidden states, a chunk of tokens at a time.

Only completion positions are passed in, so the prompt's logits are never computed, and the
[tokens, vocab] logits exist one chunk at a time in the forward pass.
"""

from __future__ import annotations

import torch

from rlvr.core.head import OutputLayer, as_output_layer


def token_logprobs(
    hidden: torch.Tensor,
    head: OutputLayer | torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    chunk_tokens: int = 512,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature)[targets], chunked over tokens.

    Args:
        hidden: [N, T, H] final hidden states at the positions that predict ``targets``.
        head: the output layer (rlvr.core.head), or a bare weight [V, H] for logits = hidden @ W.T.
        targets: [N, T] token ids.
        temperature: the sampling temperature, one float or one per token [N, T]; the trainer must score
            with the one each token was sampled at.
        chunk_tokens: tokens per chunk; bounds the live logits to [chunk_tokens, V].
        with_entropy: also return the entropy of each position's distribution (no gradient).
    Returns:
        logp [N, T] in at least float32 (carries gradient), entropy [N, T] or None.
    """
    layer = as_output_layer(head)
    n, t, h = hidden.shape
    flat_h = hidden.reshape(n * t, h)
    flat_y = targets.reshape(n * t)
    flat_temp = temperature.reshape(n * t, 1) if isinstance(temperature, torch.Tensor) else None
    logps, entropies = [], []
    for start in range(0, n * t, chunk_tokens):
        logits = layer.linear(flat_h[start : start + chunk_tokens])  # [c, V]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logits = layer.transform(logits)
        if flat_temp is not None:
            logits = logits / flat_temp[start : start + chunk_tokens]
        elif temperature != 1.0:
            logits = logits / temperature
        lse = torch.logsumexp(logits, dim=-1)  # [c]
        logps.append(logits.gather(-1, flat_y[start : start + chunk_tokens, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1)
                entropies.append(lse - (probs * logits).sum(dim=-1))
    logp = torch.cat(logps).view(n, t) if logps else hidden.new_zeros(n, t)
    entropy = None
    if with_entropy:
        entropy = torch.cat(entropies).view(n, t) if entropies else logp.detach().new_zeros(n, t)
    return logp, entropy
