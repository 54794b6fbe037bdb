"""Decoding with LoRA folded into the weights (and bf16 weight copies): the same function as peft's unmerged layers,
always the latest update, and the model left exactly as it was."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlvr.models.policy import LoraSpec, add_lora, backbone_and_head
from rlvr.platform import matmul
from rlvr.rollout import LocalSampler, SamplingParams, encode_prompts, generate_groups
from rlvr.rollout import decode_weights as dw
from rlvr.rollout.decode_weights import DecodeCache, FrozenLinear, FusedLinear, decode_dtype, decoding

DECODING = (FrozenLinear, FusedLinear)
from rlvr.learn.batch import StepBatch
from rlvr.learn.forward import completion_logprobs
from tests.conftest import make_model

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], "What is 7?", [{"role": "user", "content": "12 * 9 ="}]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _lora_model(tokenizer, seed=0, **spec):
    model = add_lora(make_model(len(tokenizer), seed=seed), LoraSpec(**spec))
    torch.manual_seed(seed + 1)
    with torch.no_grad():  # a trained-looking adapter: B != 0, so it changes the function
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model.eval()


def _generate(backbone, head, tokenizer, params, seed=0):
    ids, mask = encode_prompts(tokenizer, PROMPTS)
    return generate_groups(backbone, head, ids, mask, 2, params, [2], tokenizer.pad_token_id,
                           torch.Generator().manual_seed(seed))


def _unmerged(model, tokenizer, params, seed=0):
    with torch.no_grad():
        return _generate(*backbone_and_head(model), tokenizer, params, seed)


def _folded(model, tokenizer, params, seed=0, dtype=torch.float32):
    with torch.no_grad(), decoding(model, dtype) as (backbone, head):
        return _generate(backbone, head, tokenizer, params, seed)


def test_folded_and_unmerged_decoding_agree(tokenizer):
    model = _lora_model(tokenizer)
    for params in (GREEDY, SamplingParams(temperature=1.0, max_new_tokens=12)):
        a, b = _unmerged(model, tokenizer, params), _folded(model, tokenizer, params)
        assert a.ids.tolist() == b.ids.tolist()
        assert a.mask.tolist() == b.mask.tolist()
        assert (a.behaviour_logp - b.behaviour_logp).abs().max() < 1e-5
    # the adapter matters here: without it the greedy tokens differ
    with model.disable_adapter():
        base = _folded(model, tokenizer, GREEDY)
    assert base.ids.tolist() != _folded(model, tokenizer, GREEDY).ids.tolist()


def test_every_lora_layer_is_folded_and_the_model_is_restored(tokenizer):
    model = _lora_model(tokenizer)
    before = {name: m for name, m in model.named_modules()}
    with decoding(model) as (backbone, _):
        frozen = [m for m in backbone.modules() if isinstance(m, DECODING)]
        lora = [m for m in before.values() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
        assert len(frozen) == len(lora) > 0
        fused = [m for m in frozen if isinstance(m, FusedLinear)]  # q, k, v and gate, up of each layer
        assert len(fused) == 5 * len({id(m.group) for m in fused}) // 2 > 0
    assert {name: m for name, m in model.named_modules()} == before
    with pytest.raises(RuntimeError, match="boom"), decoding(model):
        raise RuntimeError("boom")
    assert {name: m for name, m in model.named_modules()} == before


def test_the_folded_copy_holds_the_latest_update(tokenizer):
    """Sample, update the adapter, sample again: the second sample is the updated policy's."""
    model = _lora_model(tokenizer)
    sampler = LocalSampler(model, tokenizer)
    first = sampler.sample(PROMPTS, 2, GREEDY, seed=0)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.SGD(lora, lr=1.0)
    for p in lora:
        p.grad = torch.randn_like(p)
    optimizer.step()
    second = sampler.sample(PROMPTS, 2, GREEDY, seed=0)
    expected = _unmerged(model, tokenizer, GREEDY)
    assert second.completion_ids.tolist() != first.completion_ids.tolist()
    assert second.completion_ids.tolist() == expected.ids.tolist()
    assert (second.behaviour_logp - expected.behaviour_logp).abs().max() < 1e-4  # fp32 rounding of a large update


def test_recorded_logprobs_match_the_trainer(tokenizer):
    model = _lora_model(tokenizer)
    groups = LocalSampler(model, tokenizer).sample(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=12), 0)
    batch = StepBatch.from_groups(groups, torch.zeros(groups.completion_ids.shape[0]))
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, torch.arange(batch.num_completions), 64)
    m = groups.completion_mask.bool()
    assert (logp - groups.behaviour_logp)[m].abs().mean() < 1e-5


def test_layers_that_cannot_be_folded_decode_through_peft(tokenizer):
    """DoRA's magnitude vector is not a plain sum of weights: those layers stay peft's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model(len(tokenizer)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  use_dora=True)).eval()
    with decoding(model) as (backbone, _):
        assert not any(isinstance(m, DECODING) for m in backbone.modules())
    a, b = _unmerged(model, tokenizer, GREEDY), _folded(model, tokenizer, GREEDY)
    assert a.ids.tolist() == b.ids.tolist()


def test_full_fine_tuning_in_fp32_decodes_with_the_weights_themselves(tokenizer):
    model = make_model(len(tokenizer)).eval()
    with decoding(model) as (backbone, head):
        assert not any(isinstance(m, DECODING) for m in backbone.modules())
        assert head.weight is model.lm_head.weight


def test_bf16_linear_is_a_bf16_matmul_with_fp32_activations():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    (w, b) = dw._frozen_weights(layer, torch.bfloat16)
    y = FrozenLinear(w, b)(x)
    assert y.dtype == torch.float32 and w.dtype == torch.bfloat16
    naive = x.bfloat16().double() @ layer.weight.bfloat16().double().T + layer.bias.bfloat16().double()
    assert (y.double() - naive).abs().max() < 0.05  # bf16 output rounding only
    assert (y - layer(x)).abs().max() > 1e-6  # and it is not the fp32 layer


def test_bf16_decoding_records_the_logprobs_of_the_weights_it_used(tokenizer):
    """bf16 samples stay close to the fp32 trainer's log-probs (the importance weight corrects the rest), and are
    exactly what a bf16-weight forward of the same tokens gives."""
    model = _lora_model(tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    groups = LocalSampler(model, tokenizer, precision="bf16").sample(PROMPTS, 4, params, 0)
    batch = StepBatch.from_groups(groups, torch.zeros(groups.completion_ids.shape[0]))
    rows, m = torch.arange(batch.num_completions), groups.completion_mask.bool()
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, batch, rows, 64)
        with decoding(model, torch.bfloat16) as _:  # the same swapped layers, run by the trainer's forward
            bf16, _ = completion_logprobs(model, batch, rows, 64)
    gap = (fp32 - groups.behaviour_logp)[m].abs()
    assert 1e-5 < gap.mean() < 0.1
    assert (bf16 - groups.behaviour_logp)[m].abs().max() < 2e-2  # head and prefix differ only in kernel order


def test_a_cache_keeps_folded_layers_until_their_tensors_change(tokenizer):
    model = _lora_model(tokenizer)
    cache = DecodeCache()
    with decoding(model, cache=cache) as (backbone, _):
        first = [m for m in backbone.modules() if isinstance(m, DECODING)]
    with decoding(model, cache=cache) as (backbone, _):
        again = [m for m in backbone.modules() if isinstance(m, DECODING)]
    assert all(a is b for a, b in zip(first, again))
    q = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj"))
    with torch.no_grad():
        q.lora_B["default"].weight.add_(1.0)
    with decoding(model, cache=cache) as (backbone, _):
        changed = [m for m in backbone.modules() if isinstance(m, DECODING)]
    assert sum(a is not b for a, b in zip(first, changed)) == 3  # q_proj's group: q, k, v
    a, b = _unmerged(model, tokenizer, GREEDY), None
    with torch.no_grad(), decoding(model, cache=cache) as (backbone, head):
        b = _generate(backbone, head, tokenizer, GREEDY)
    assert a.ids.tolist() == b.ids.tolist()


def test_decode_dtype_choice(tokenizer, monkeypatch):
    model = make_model(len(tokenizer))
    assert decode_dtype("fp32", model) == torch.float32 and decode_dtype("bf16", model) == torch.bfloat16
    with pytest.raises(ValueError, match="fp32, bf16"):
        decode_dtype("fp16", model)
    monkeypatch.setattr(dw, "bf16_matmul_hardware", lambda device="cpu": True)
    assert decode_dtype("auto", model) == torch.float32  # too small to gain
    monkeypatch.setattr(dw, "AUTO_BF16_MIN_PARAMETERS", 1)
    assert decode_dtype("auto", model) == torch.bfloat16
    assert decode_dtype("auto", model.double()) == torch.float32  # only fp32 models get bf16 copies
    monkeypatch.setattr(dw, "bf16_matmul_hardware", lambda device="cpu": False)
    assert decode_dtype("auto", model.float()) == torch.float32


def test_fused_siblings_compute_each_input_once_and_any_input_correctly():
    from rlvr.rollout.decode_weights import _Fused

    torch.manual_seed(0)
    w = [torch.randn(3, 4), torch.randn(5, 4)]
    group = _Fused(w, [None, torch.ones(5)])
    a, b = FusedLinear(group, 0), FusedLinear(group, 1)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.allclose(a(x), x @ w[0].T) and torch.allclose(b(x), x @ w[1].T + 1)
    assert group.x is x
    assert torch.allclose(b(y), y @ w[1].T + 1)  # another input: recomputed, not the cached output
    y.mul_(2)  # the same tensor changed in place: recomputed too
    assert torch.allclose(a(y), y @ w[0].T)
    first = a(x)
    first.zero_()  # a reader changes its output in place; asking again recomputes it
    assert torch.allclose(a(x), x @ w[0].T)


@pytest.mark.parametrize("kernel", ["blas", "onednn"])
def test_fp32_decoding_with_either_matmul_kernel_samples_what_peft_samples(tokenizer, monkeypatch, kernel):
    """fp32 decode matmuls go to oneDNN where it was measured faster (matmul.onednn_fp32_faster): both kernels
    sample the tokens peft's unmerged layers sample, with log-probs to fp32 rounding; with a gradient the kernel is
    always F.linear."""
    monkeypatch.setenv("RLVR_FP32_MATMUL", kernel)
    matmul.onednn_fp32_faster.cache_clear()
    try:
        model = _lora_model(tokenizer)
        params = SamplingParams(temperature=1.0, max_new_tokens=10)
        ref = _unmerged(model, tokenizer, params)
        with torch.no_grad(), decoding(model, torch.float32) as (backbone, head):
            got = _generate(backbone, head, tokenizer, params)
        assert torch.equal(got.ids, ref.ids)
        torch.testing.assert_close(got.behaviour_logp, ref.behaviour_logp, atol=1e-5, rtol=0)
        x, w = torch.randn(3, 8, requires_grad=True), torch.randn(5, 8)
        assert dw.decode_linear(x, w, None).requires_grad  # training never meets the sampling-only kernel
    finally:
        matmul.onednn_fp32_faster.cache_clear()


def test_a_frozen_linear_through_onednn_has_f_linears_value_and_input_gradient(monkeypatch):
    """rlvr.platform.matmul.frozen_linear: the LoRA base layers' forward and input gradient (by hand: grad @ W), against
    F.linear's autograd; a trained weight, or bf16, stays on F.linear."""
    monkeypatch.setenv("RLVR_FP32_MATMUL", "onednn")
    matmul.onednn_fp32_faster.cache_clear()
    try:
        layer = nn.Linear(8, 5)
        layer.requires_grad_(False)
        x = torch.randn(2, 3, 8, requires_grad=True)
        g = torch.randn(2, 3, 5)
        y = matmul.frozen_linear(layer, x)
        y.backward(g)
        assert y.grad_fn.name().endswith("FrozenLinearFunctionBackward")
        torch.testing.assert_close(y, x @ layer.weight.T + layer.bias, atol=1e-5, rtol=0)
        torch.testing.assert_close(x.grad, g @ layer.weight, atol=1e-5, rtol=0)
        layer.weight.requires_grad_(True)
        assert "FrozenLinear" not in matmul.frozen_linear(layer, x).grad_fn.name()
    finally:
        matmul.onednn_fp32_faster.cache_clear()


def test_the_fp32_kernel_is_chosen_per_regime_by_the_product_s_rows(monkeypatch):
    """A decode step's few rows and a training micro-batch's many are timed apart (a CPU can favour oneDNN at one and
    MKL at the other): with oneDNN faster only for decode-sized products, frozen_linear sends 3 rows to oneDNN and
    a [4, 128, in] micro-batch (512 rows) to F.linear."""
    monkeypatch.delenv("RLVR_FP32_MATMUL", raising=False)
    monkeypatch.setattr(matmul, "onednn_fp32_faster", lambda regime="decode": regime == "decode")
    w = torch.randn(5, 8)
    assert matmul.uses_onednn(w, 3) and matmul.uses_onednn(w, matmul.BATCH_ROWS - 1)
    assert not matmul.uses_onednn(w, matmul.BATCH_ROWS)
    assert not matmul.uses_onednn(w.to(torch.bfloat16), 3)  # fp32 only
    layer = nn.Linear(8, 5).requires_grad_(False)
    calls = []
    monkeypatch.setattr(matmul, "onednn_linear", lambda x, w, b: calls.append(x.shape) or F.linear(x, w, b))
    small, large = torch.randn(3, 8), torch.randn(4, 128, 8)
    with torch.no_grad():
        torch.testing.assert_close(matmul.frozen_linear(layer, small), F.linear(small, layer.weight, layer.bias))
        torch.testing.assert_close(matmul.frozen_linear(layer, large), F.linear(large, layer.weight, layer.bias))
    assert calls == [torch.Size([3, 8])]


def test_each_regime_is_timed_once_and_an_override_decides_both(monkeypatch):
    monkeypatch.setenv("RLVR_FP32_MATMUL", "blas")
    matmul.onednn_fp32_faster.cache_clear()
    try:
        assert not matmul.onednn_fp32_faster("decode") and not matmul.onednn_fp32_faster("batch")
        monkeypatch.setenv("RLVR_FP32_MATMUL", "onednn")
        matmul.onednn_fp32_faster.cache_clear()
        assert matmul.onednn_fp32_faster("decode") and matmul.onednn_fp32_faster("batch")
        assert set(matmul.PROBES) == {"decode", "batch"} and matmul.PROBES["batch"][0] >= matmul.BATCH_ROWS
    finally:
        matmul.onednn_fp32_faster.cache_clear()


@pytest.mark.parametrize("capability, bf16", [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_auto_decodes_in_bf16_only_on_cards_with_bf16_units(monkeypatch, capability, bf16):
    """A T4 (7.5) or V100 (7.0) emulates bf16 - torch's is_bf16_supported() says yes there - so auto keeps fp32
    on them, as the learner does (platform.devices.bf16_capable); the card's capability is the one asked (here a
    stand-in, no GPU being available)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    dw.bf16_matmul_hardware.cache_clear()
    try:
        assert dw.bf16_matmul_hardware("cuda") is bf16
    finally:
        dw.bf16_matmul_hardware.cache_clear()
