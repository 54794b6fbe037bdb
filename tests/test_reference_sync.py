"""The reference refresh (TRL's sync_ref_model): theta_ref <- (1 - alpha) theta_ref + alpha theta, for full
fine-tuning and under LoRA (an earlier adapter swapped in for the reference pass)."""

import pytest
import torch

from rlvr.models.policy import LoraSpec, ReferencePolicy, add_lora
from tests.conftest import make_model

IDS = torch.tensor([[5, 9, 3, 7, 2]])


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _lora_model(vocab):
    model = add_lora(make_model(vocab), LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    return model


def _move(model, seed):
    """Change every adapter tensor (as training would)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def test_lora_reference_becomes_an_earlier_adapter(tokenizer):
    model = _lora_model(len(tokenizer))
    reference = ReferencePolicy(model)
    with model.disable_adapter():
        base = _logits(model)
    _move(model, 1)
    at_refresh = _logits(model)
    assert not torch.allclose(at_refresh, base)
    with reference.active() as ref:
        assert torch.equal(_logits(ref), base)  # before any refresh: the base model
    reference.refresh(1.0)  # hard update: the reference is the policy as it is now
    _move(model, 2)
    policy_now = _logits(model)
    with reference.active() as ref:
        assert torch.allclose(_logits(ref), at_refresh, atol=1e-6)
    assert torch.equal(_logits(model), policy_now)  # the policy's own adapter is back after the reference pass
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_lora_mix_is_elementwise_from_the_base_model(tokenizer):
    """First refresh from the base (B = 0, A the policy's): exactly alpha times the policy's weight change; then
    A and B mixed elementwise."""
    model = _lora_model(len(tokenizer))
    reference = ReferencePolicy(model)
    _move(model, 3)
    first = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    reference.refresh(0.25)
    _move(model, 4)
    reference.refresh(0.5)
    now = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    held = reference.state_tensors()
    for n, at_first in first.items():
        start = torch.zeros_like(at_first) if "lora_B" in n else at_first
        expected = 0.5 * (0.75 * start + 0.25 * at_first) + 0.5 * now[n]
        assert torch.allclose(held[n], expected, atol=1e-7), n
    restored = ReferencePolicy(model)
    restored.load_state_tensors(held)
    with reference.active() as a:
        want = _logits(a)
    with restored.active() as b:
        assert torch.equal(_logits(b), want)
    with pytest.raises(ValueError, match="do not fit this model"):
        restored.load_state_tensors({"nope": torch.zeros(1)})


def test_full_finetune_reference_mixes_every_weight(tokenizer):
    model = make_model(len(tokenizer))
    reference = ReferencePolicy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    reference.refresh(0.25)
    with reference.active() as ref:
        for n, p in ref.named_parameters():
            assert torch.allclose(p, before[n] + 0.25, atol=1e-6), n
            assert not p.requires_grad


def test_first_lora_refresh_is_alpha_times_the_weight_change(tokenizer):
    """From the base, the reference's weight change after refresh(alpha) is alpha x the policy's: logits of a model
    whose every B is scaled by alpha."""
    model = _lora_model(len(tokenizer))
    reference = ReferencePolicy(model)
    _move(model, 5)
    reference.refresh(0.3)
    with reference.active() as ref:
        got = _logits(ref)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.3)
    assert torch.allclose(got, _logits(model), atol=1e-6)
