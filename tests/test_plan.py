"""The memory planner: its arithmetic against hand-computed cases, and its per-token activation count against
the tensors a real (tiny) Llama saves for backward."""

import pytest
import torch

from rlvr.models import LoraSpec, add_lora
from rlvr.plan import ARCHS, Arch, Run, arch_from_config, plan, ppo_vs_grpo, resolve_arch
from tests.conftest import make_model

TOY = Arch("toy", layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=10)


def test_parameter_counts_match_the_models(tokenizer):
    model = make_model(len(tokenizer))
    arch = arch_from_config(model.config)
    assert arch.params == sum(p.numel() for p in model.parameters())
    lora = add_lora(make_model(len(tokenizer)), LoraSpec(r=4, target_modules=("q_proj", "v_proj", "down_proj")))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert arch.lora_params(4, ("q_proj", "v_proj", "down_proj")) == trainable
    assert resolve_arch("smollm2-135m").params == 134_515_008  # SmolLM2-135M's published count


def _saved_values_per_token_layer(model, n, L, masked):
    """Values saved for backward per token and layer: 2 layers minus 1 layer, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = list(base.model.layers)

    def saved(k):
        seen = {}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in params:
                seen[key] = t.untyped_storage().nbytes()
            return t

        base.model.layers = torch.nn.ModuleList(layers[:k])
        ids = torch.randint(3, 300, (n, L), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(n, L, dtype=torch.long)
        if masked:
            mask[0, :3] = 0  # a shorter, left-padded prompt
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            base.model(input_ids=ids, attention_mask=mask)
        return sum(seen.values()) / 4

    try:
        return (saved(2) - saved(1)) / (n * L)
    finally:
        base.model.layers = torch.nn.ModuleList(layers)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_activation_formula_counts_what_llama_saves(tokenizer, masked, lora):
    model = make_model(len(tokenizer)).train()
    arch = arch_from_config(model.config)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # rlvr's default
    if lora:
        model = add_lora(model, LoraSpec(r=4, target_modules=targets)).train()
    measured = _saved_values_per_token_layer(model, n=3, L=20, masked=masked)
    assert measured == arch.activation_values(20, masked, 4 if lora else 0, len(targets) if lora else 0)


def test_activation_formula_bounds_lora_on_fewer_layers(tokenizer):
    """Frozen linears keep no input for a weight gradient: fewer LoRA targets save less than the formula says."""
    targets = ("q_proj", "v_proj", "gate_proj")
    model = add_lora(make_model(len(tokenizer)), LoraSpec(r=4, target_modules=targets)).train()
    arch = arch_from_config(model.config)
    measured = _saved_values_per_token_layer(model, n=3, L=20, masked=True)
    assert 0.8 * arch.activation_values(20, True, 4, 3) <= measured <= arch.activation_values(20, True, 4, 3)


def test_full_fine_tuning_by_hand():
    P = TOY.params  # 2 * (64*2 + 8*4*2 + 3*8*16 + 16) + 10*8*2 + 8 = 2 * 592 + 168 = 1352
    assert P == 1352
    run = Run(algo="grpo", precision="fp32", beta=0.1, prompts=2, group=2, prompt_len=3, completion_len=4,
              micro_batch=4, lean=False, padded=False)
    p = plan(TOY, run)
    assert p["weights"] == P * 4 and p["reference"] == P * 4 and p["gradients"] == P * 4
    assert p["optimizer"] == P * 8 and p["critic"] == 0
    # plain step, no mask: 4 completions x (3 + 4) tokens x 2 layers x A, A = 8*8 + 2*4 + 4*16 + 2 + 2 = 140
    assert TOY.activation_values(7, False) == 140
    assert p["activations"] == 4 * 7 * 2 * 140 * 4
    assert p["logits"] == 3 * (4 * 4) * 10 * 4  # log-softmax kept + two gradient buffers
    assert p["total"] == sum(v for k, v in p.items() if k != "total")
    no_kl = plan(TOY, Run(**{**run.__dict__, "beta": 0.0}))
    assert no_kl["reference"] == 0


def test_ppo_adds_a_trained_critic_and_grpo_saves_it():
    run = Run(precision="fp32", beta=0.1, prompts=2, group=2, prompt_len=3, completion_len=4, micro_batch=4)
    ppo, grpo, saving = ppo_vs_grpo(TOY, run)
    head = 8 * 4 * 4
    assert ppo["critic"] == TOY.params * (4 + 4 + 8) + head
    assert ppo["total"] - grpo["total"] == ppo["critic"]
    assert saving == pytest.approx(ppo["critic"] / ppo["total"])
    lora = plan(TOY, Run(algo="ppo", lora_rank=2, beta=0.1))
    P_t = TOY.lora_params(2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert lora["critic"] == P_t * (4 + 4 + 8) + head and lora["reference"] == 0


def test_bf16_and_sharding_by_hand():
    P = TOY.params
    run = Run(precision="bf16", optimizer="adamw", beta=0.0, devices=4, zero=1)
    p = plan(TOY, run)
    assert p["weights"] == P * 2 and p["gradients"] == P * 2 and p["optimizer"] == P * 12 / 4  # + fp32 master
    p3 = plan(TOY, Run(precision="bf16", beta=0.1, devices=4, zero=3))
    assert p3["weights"] == P * 2 / 4 and p3["reference"] == P * 2 / 4 and p3["gradients"] == P * 2 / 4
    eight_bit = plan(TOY, Run(precision="fp32", optimizer="adamw_8bit"))
    assert eight_bit["optimizer"] == P * 2


def test_checkpointing_keeps_layer_inputs_only():
    run = Run(prompts=1, group=4, prompt_len=3, completion_len=4, micro_batch=4, lean=False, padded=False)
    full = plan(TOY, run)["activations"]
    ckpt = plan(TOY, Run(**{**run.__dict__, "checkpointing": True}))["activations"]
    tokens = 4 * 7
    assert ckpt == (2 * tokens * 8 + tokens * 140) * 4 and ckpt < full


def test_named_architectures_and_errors():
    assert ARCHS["70b"].params == pytest.approx(70.6e9, rel=0.01)
    assert ARCHS["7b"].params == pytest.approx(7.6e9, rel=0.01)
    with pytest.raises(ValueError, match="neither a named architecture"):
        resolve_arch("13q")
    with pytest.raises(ValueError, match="algo must be grpo or ppo"):
        plan(TOY, Run(algo="a2c"))
