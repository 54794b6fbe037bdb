"""The fused LoRA layer (rlvr.models.fused_lora) against peft's own forward: outputs and gradients to 1e-5, on
both fp32 kernels, and peft's path wherever the fused one does not apply."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from torch import nn

from rlvr.models import fused_lora
from rlvr.models.policy import LoraSpec, add_lora
from tests.conftest import make_model


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(24, 40)  # with a bias
        self.down = nn.Linear(40, 24, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _peft_block(dropout: float = 0.0, dora: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=12, target_modules=["up", "down"],
                                               lora_dropout=dropout, use_dora=dora))
    for name, p in model.named_parameters():  # B is zero at init: give it values so the adapter's product counts
        if "lora_B" in name:
            nn.init.normal_(p, std=0.3)
    return model


def _forward_backward(model: nn.Module, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("onednn", [False, True])
def test_fused_layers_give_peft_s_outputs_and_gradients(monkeypatch, onednn):
    monkeypatch.setattr(fused_lora, "uses_onednn", lambda weight, rows: onednn)
    reference = _peft_block()
    fused = copy.deepcopy(reference)
    assert fused_lora.fuse_lora_layers(fused) == 2
    assert fused_lora.fuse_lora_layers(fused) == 0  # routed once
    x = torch.randn(3, 5, 24)  # [batch, tokens, in]
    want, want_dx, want_grads = _forward_backward(reference, x)
    got, got_dx, got_grads = _forward_backward(fused, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_dx, want_dx, atol=1e-5, rtol=1e-5)
    assert set(got_grads) == set(want_grads) == {n for n, p in reference.named_parameters() if p.requires_grad}
    assert len(want_grads) == 4  # A and B of both layers: the base weights are frozen
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-5)


def test_a_disabled_adapter_gives_the_base_layer():
    fused = _peft_block()
    fused_lora.fuse_lora_layers(fused)
    x = torch.randn(4, 24)
    with fused.disable_adapter():
        got = fused(x)
    base = fused.base_model.model
    want = base.down.base_layer(torch.tanh(base.up.base_layer(x)))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["dropout", "dora", "autocast", "bf16 input"])
def test_what_the_fused_path_does_not_cover_takes_peft_s(kind):
    model = _peft_block(dropout=0.1 if kind == "dropout" else 0.0, dora=kind == "dora")
    layer = model.base_model.model.up
    x = torch.randn(4, 24, dtype=torch.bfloat16 if kind == "bf16 input" else torch.float32)
    if kind == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fused_lora._fusable(layer, x, (), {}) is None
    else:
        assert fused_lora._fusable(layer, x, (), {}) is None
    assert fused_lora._fusable(_peft_block().base_model.model.up, torch.randn(4, 24), (), {}) == "default"
    calls = []
    fused_lora.fuse_lora_layers(model)
    real = fused_lora.LoraLinearFunction.apply
    try:
        fused_lora.LoraLinearFunction.apply = lambda *a: calls.append(1) or real(*a)
        model.eval()
        model(torch.randn(4, 24))
    finally:
        fused_lora.LoraLinearFunction.apply = real
    assert calls == ([] if kind in ("dropout", "dora") else [1, 1])


def test_a_decoder_with_rlvr_s_adapter_trains_as_under_peft(monkeypatch):
    """The tiny Llama with rlvr's LoRA (all linear layers): loss and every adapter gradient as peft computes them."""
    torch.manual_seed(1)
    base = make_model(64)
    fused = add_lora(copy.deepcopy(base), LoraSpec(r=4, alpha=8))
    for name, p in fused.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.2)
    plain = copy.deepcopy(fused)
    for module in plain.modules():  # back to peft's own forward
        if type(module) is LoraLinear:
            del module.forward
    routed = [m for m in fused.modules() if type(m) is LoraLinear and "forward" in vars(m)]
    assert len(routed) == 14  # 7 linear layers x 2 decoder layers
    ids = torch.randint(3, 64, (2, 9))
    losses, grads = [], []
    for model in (plain, fused):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    assert set(grads[0]) == set(grads[1]) and len(grads[0]) == 28
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-5)


def test_a_deep_copy_computes_with_its_own_weights():
    """The routed forward is bound to its layer: a copy (a teacher, a replica) must not read the original's adapter."""
    model = _peft_block()
    fused_lora.fuse_lora_layers(model)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 24)
    before = model(x).detach()
    with torch.no_grad():
        twin.base_model.model.up.lora_B["default"].weight.add_(1.0)
    assert torch.equal(model(x), before)
    assert not torch.allclose(twin(x), before)
