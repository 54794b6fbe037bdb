"""Chunked log-probs equal the naive full-logits computation, in value and gradient."""

import pytest
import torch

from rlvr.core import token_logprobs


def _naive(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T) / temperature  # [N, T, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("chunk", [1, 5, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_values_and_gradients(chunk, temperature):
    torch.manual_seed(0)
    hidden = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (3, 4))
    logp, entropy = token_logprobs(hidden, weight, targets, temperature, chunk_tokens=chunk, with_entropy=True)
    ref_logp, ref_entropy = _naive(hidden, weight, targets, temperature)
    assert logp.dtype == torch.float64
    assert torch.allclose(logp, ref_logp, atol=1e-12)
    assert torch.allclose(entropy, ref_entropy, atol=1e-12)
    g = torch.randn(3, 4, dtype=torch.float64)
    gh, gw = torch.autograd.grad((logp * g).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_logp * g).sum(), (hidden, weight))
    assert torch.allclose(gh, rh, atol=1e-12) and torch.allclose(gw, rw, atol=1e-12)


def test_low_precision_is_scored_in_float32():
    hidden = torch.randn(2, 3, 8).bfloat16()
    logp, _ = token_logprobs(hidden, torch.randn(20, 8).bfloat16(), torch.zeros(2, 3, dtype=torch.long))
    assert logp.dtype == torch.float32


def test_empty_completion():
    empty_targets = torch.zeros(2, 0, dtype=torch.long)
    logp, entropy = token_logprobs(torch.zeros(2, 0, 4), torch.zeros(10, 4), empty_targets, with_entropy=True)
    assert logp.shape == (2, 0) and entropy.shape == (2, 0)
