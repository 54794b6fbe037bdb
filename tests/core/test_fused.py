"""The fused output layer (log-probs and entropies, chunked, logits recomputed in backward) equals full logits
through autograd in value and gradients, fp64, under every objective."""

import pytest
import torch

from rlvr.core import OBJECTIVES, LossSettings, TokenBatch, fused_logprobs, policy_loss, token_logprobs
from rlvr.core.head import OutputLayer


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


def _by_hand(hidden, layer, targets, temperature):
    """Log-probs and entropies [n, t] from full logits, both differentiable."""
    log_probs = torch.log_softmax(layer(hidden) / temperature, dim=-1)  # [n, t, V]
    return log_probs.gather(-1, targets[..., None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


def _spread(values, m):
    return values.new_zeros(m.shape).masked_scatter(m, values)


SETTINGS = {  # objectives and the knob combinations the fused path must reproduce
    **{name: {"objective": name} for name in OBJECTIVES},
    "behaviour-ratio": {"ratio_to": "behaviour", "is_level": "none"},
    "decoupled-tis": {"is_level": "token", "is_cap": 1.3, "gap_mask": 0.2},
    "sequence-is": {"is_level": "sequence", "is_mode": "mask", "is_cap": 1.3},
    "luspo": {"objective": "gspo", "aggregation": "sequence_sum"},
}


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "token_sum_constant"])
@pytest.mark.parametrize("temperature, chunk", [(1.0, 2), (0.7, 3), (1.0, 100), ("per-token", 3)])
@pytest.mark.parametrize("knobs", sorted(SETTINGS))
def test_fused_equals_naive(aggregation, temperature, chunk, knobs):
    hidden, weight, targets, mask, old, ref, adv = _inputs()
    if temperature == "per-token":
        temperature = 0.5 + torch.rand(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    settings = LossSettings(**{"beta": 0.1, "eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0,
                               "aggregation": aggregation, "entropy_coef": 0.05, **SETTINGS[knobs]})
    m = mask.bool()

    def loss_of(logp, entropy):
        x = TokenBatch(logp=logp, behaviour_logp=old, adv=adv[:, None], mask=mask.double(), ref_logp=ref,
                       entropy=entropy)
        return policy_loss(x, settings, normaliser=4.0, step_tokens=7.0)[0]

    temp_column = temperature[..., None] if isinstance(temperature, torch.Tensor) else temperature
    naive = loss_of(*_by_hand(hidden, OutputLayer(weight), targets, temp_column))
    naive_grads = torch.autograd.grad(naive, (hidden, weight))

    temp = temperature[m] if isinstance(temperature, torch.Tensor) else temperature
    logp, entropy = fused_logprobs(hidden[m], weight, targets[m], temp, chunk)  # trained tokens only: [M]
    fused = loss_of(_spread(logp, m), _spread(entropy, m))
    fused_grads = torch.autograd.grad(fused, (hidden, weight))

    assert torch.allclose(fused, naive, atol=1e-12, rtol=0)
    for a, b in zip(fused_grads, naive_grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_logprobs_and_entropies_equal_the_chunked_no_gradient_path():
    hidden, weight, targets, *_ = _inputs()
    logp, entropy = token_logprobs(hidden, weight, targets, 0.8, chunk_tokens=4, with_entropy=True)
    f_logp, f_entropy = fused_logprobs(hidden.reshape(-1, 8), weight, targets.reshape(-1), 0.8, 5)
    assert torch.allclose(f_logp, logp.reshape(-1), atol=1e-12) and torch.allclose(f_entropy, entropy.reshape(-1))


def test_frozen_head_gets_no_weight_gradient():
    hidden, weight, targets, *_ = _inputs()
    h = hidden.reshape(-1, hidden.shape[-1])
    logp, _ = fused_logprobs(h, weight.detach(), targets.reshape(-1), 1.0, 4)
    (grad,) = torch.autograd.grad(-logp.sum(), hidden)
    assert grad.shape == hidden.shape and torch.isfinite(grad).all()


@pytest.mark.parametrize("scale, softcap", [(1.0, None), (0.25, None), (4.0, None), (1.0, 2.0), (0.5, 3.0)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_whole_output_layer_equals_the_formula(scale, softcap, with_bias):
    """Bias, logit scale and soft-cap: fused and chunked log-probs equal the formula written out, with gradients of
    a loss of log-probs and entropies for hidden, weight and bias."""
    hidden, weight, targets, mask, *_ = _inputs(seed=2)
    weight = (weight * 3).detach().requires_grad_(True)  # logits of order 10: the cap bites
    bias = torch.randn(weight.shape[0], dtype=torch.float64, requires_grad=True) if with_bias else None
    temperature = 0.7
    z = hidden @ weight.T + (bias if with_bias else 0.0)
    logits = z * scale if softcap is None else softcap * torch.tanh(z * scale / softcap)  # by hand
    log_probs = torch.log_softmax(logits / temperature, -1)
    ref = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    ref_entropy = -(log_probs.exp() * log_probs).sum(-1)
    adv = torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).view_as(ref)
    m = mask.bool()
    naive = -(ref * adv)[m].sum() - 0.3 * ref_entropy[m].sum()
    params = (hidden, weight) + ((bias,) if with_bias else ())
    naive_grads = torch.autograd.grad(naive, params)

    layer = OutputLayer(weight, bias, scale, softcap)
    chunked, _ = token_logprobs(hidden, layer, targets, temperature, chunk_tokens=4)
    assert torch.allclose(chunked, ref, atol=1e-12, rtol=0)
    f_logp, f_entropy = fused_logprobs(hidden[m], layer, targets[m], temperature, 3)
    assert torch.allclose(f_logp, ref.detach()[m], atol=1e-12, rtol=0)
    fused = -(f_logp * adv[m]).sum() - 0.3 * f_entropy.sum()
    assert torch.allclose(fused, naive, atol=1e-10, rtol=0)
    for a, b in zip(torch.autograd.grad(fused, params), naive_grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)


def test_the_output_layer_computes_in_its_weight_s_dtype_under_bf16_autocast():
    """model.autocast=bf16 runs the body's matmuls in bf16; the logits stay the fp32 product (8 significant bits
    would move a logit of 10 by up to 1/16): equal to the product outside autocast, in the learner's token_logprobs
    and in the fused gradient path alike."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 32), torch.randn(50, 32, requires_grad=True)
    layer, ids = OutputLayer(weight), torch.randint(0, 50, (1, 6))
    plain = layer(hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = layer(hidden)
        logp, _ = token_logprobs(hidden[None], layer, ids)
        fused, _ = fused_logprobs(hidden.clone().requires_grad_(), layer, ids[0])
    assert under.dtype == torch.float32 and torch.equal(under, plain)
    want = torch.log_softmax(plain, -1).gather(-1, ids[0, :, None])[:, 0]
    torch.testing.assert_close(logp[0], want, atol=1e-6, rtol=0)
    torch.testing.assert_close(fused, want, atol=1e-6, rtol=0)
