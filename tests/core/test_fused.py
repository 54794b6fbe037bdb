"""The fused output-layer loss equals the naive one (full logits, autograd) in value and gradients, fp64."""

import pytest
import torch

from rlvr.core import (
    LossSettings,
    TokenInputs,
    aggregate,
    fused_head_loss,
    token_logprobs,
    token_objective,
    token_weights,
)


def _inputs(seed=0, n=3, t=5, h=8, v=40):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, t, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    with torch.no_grad():  # old/ref policies near the current one, as in training (ratios around 1)
        logp = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    old = logp + torch.randn(n, t, dtype=torch.float64, generator=g) * 0.3
    ref = logp + torch.randn(n, t, dtype=torch.float64, generator=g) * 0.3
    adv = torch.randn(n, dtype=torch.float64, generator=g)
    return hidden, weight, targets, mask, old, ref, adv


OFF_POLICY = {  # the knob combinations the fused path must reproduce
    "behaviour-ratio": {"ratio_to": "behaviour", "is_level": "none"},
    "decoupled-tis": {"is_level": "token", "is_cap": 1.3, "gap_mask": 0.2},
    "masked-is": {"is_level": "token", "is_mode": "mask", "is_cap": 1.3},
}


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "token_sum_constant"])
@pytest.mark.parametrize("temperature, chunk", [(1.0, 2), (0.7, 3), (1.0, 100), ("per-token", 3)])
@pytest.mark.parametrize("off_policy", sorted(OFF_POLICY))
def test_fused_equals_naive(aggregation, temperature, chunk, off_policy):
    hidden, weight, targets, mask, old, ref, adv = _inputs()
    if temperature == "per-token":
        temperature = 0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    settings = LossSettings(beta=0.1, eps_low=0.2, eps_high=0.28, dual_clip=3.0, aggregation=aggregation,
                            **OFF_POLICY[off_policy])
    normaliser = 4.0

    # naive: full logits through autograd
    logp, entropy = token_logprobs(hidden, weight, targets, temperature, chunk_tokens=10**6, with_entropy=True)
    per_token, _ = token_objective(TokenInputs(logp, old, adv[:, None], ref_logp=ref), settings)
    naive = aggregate(per_token, mask, aggregation, normaliser)
    naive_grads = torch.autograd.grad(naive, (hidden, weight))

    # fused: only real tokens, gradient computed in the forward pass
    m = mask.bool()
    w = token_weights(mask.double(), aggregation, normaliser)[m]
    adv_tok = adv[:, None].expand_as(old)[m]

    def token_loss(lp, rows):
        loss, _ = token_objective(TokenInputs(lp, old[m][rows], adv_tok[rows], ref_logp=ref[m][rows]), settings)
        return loss * w[rows]

    temp = temperature[m] if isinstance(temperature, torch.Tensor) else temperature
    fused, f_logp, f_entropy = fused_head_loss(hidden[m], weight, targets[m], token_loss, temp, chunk)
    fused_grads = torch.autograd.grad(fused, (hidden, weight))

    assert torch.allclose(fused, naive, atol=1e-12, rtol=0)
    assert torch.allclose(f_logp, logp.detach()[m], atol=1e-12) and torch.allclose(f_entropy, entropy[m], atol=1e-12)
    for a, b in zip(fused_grads, naive_grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_frozen_head_gets_no_weight_gradient():
    hidden, weight, targets, *_ = _inputs()
    weight = weight.detach()
    h = hidden.reshape(-1, hidden.shape[-1])
    loss, _, _ = fused_head_loss(h, weight, targets.reshape(-1), lambda lp, rows: -lp, 1.0, 4)
    (grad,) = torch.autograd.grad(loss, hidden)
    assert grad.shape == hidden.shape and torch.isfinite(grad).all()


@pytest.mark.parametrize("scale, softcap", [(1.0, None), (0.25, None), (4.0, None), (1.0, 2.0), (0.5, 3.0)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_whole_output_layer_equals_the_formula(scale, softcap, with_bias):
    """Bias, logit scale and soft-cap: fused and chunked log-probs equal the formula written out, with gradients
    for hidden, weight and bias."""
    from rlvr.core.head import OutputLayer

    hidden, weight, targets, mask, *_ = _inputs(seed=2)
    weight = (weight * 3).detach().requires_grad_(True)  # logits of order 10: the cap bites
    bias = torch.randn(weight.shape[0], dtype=torch.float64, requires_grad=True) if with_bias else None
    temperature = 0.7
    z = hidden @ weight.T + (bias if with_bias else 0.0)
    logits = z * scale if softcap is None else softcap * torch.tanh(z * scale / softcap)  # by hand
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    adv = torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).view_as(ref)
    m = mask.bool()
    naive = -(ref * adv)[m].sum()
    params = (hidden, weight) + ((bias,) if with_bias else ())
    naive_grads = torch.autograd.grad(naive, params)

    layer = OutputLayer(weight, bias, scale, softcap)
    chunked, _ = token_logprobs(hidden, layer, targets, temperature, chunk_tokens=4)
    assert torch.allclose(chunked, ref, atol=1e-12, rtol=0)
    fused, f_logp, _ = fused_head_loss(hidden[m], layer, targets[m], lambda lp, rows: -lp * adv[m][rows],
                                       temperature, 3)
    assert torch.allclose(f_logp, ref.detach()[m], atol=1e-12, rtol=0)
    assert torch.allclose(fused, naive, atol=1e-10, rtol=0)
    for a, b in zip(torch.autograd.grad(fused, params), naive_grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
