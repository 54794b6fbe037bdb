"""The memory planner: its arithmetic against hand-computed cases, and its per-token activation count against
the tensors a real (tiny) Llama saves for backward."""

from dataclasses import replace

import pytest
import torch

from rlvr.config.plan import (
    ARCHS,
    Arch,
    PlannedRun,
    arch_from_config,
    auto_folds,
    decode_bytes,
    fold_threshold,
    folded_copies,
    plan,
    ppo_vs_grpo,
    report,
    resolve_arch,
    sampling,
)
from rlvr.config.schema import RunConfig
from rlvr.models.policy import LoraSpec, add_lora
from rlvr.rollout.decode_weights import folded_bytes
from rlvr.rollout.kv_cache import preallocated_cache
from tests.conftest import make_model

TOY = Arch("toy", layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, vocab=10)


def Run(**settings) -> PlannedRun:
    """A planned run with the settings these hand-derived cases were written for (fp32 full fine-tuning, no KL, no
    checkpointing, micro-batch 16, 64 + 256 tokens), changed by ``settings``."""
    fixed = {"dtype": "fp32", "lora_rank": 0, "beta": 0.0, "checkpointing": False, "micro_batch": 16,
             "prompt_len": 64, "completion_len": 256, "decode_precision": "auto"}
    return PlannedRun(**{**fixed, **settings})


def test_the_plan_defaults_are_the_configs():
    """rlvr plan with no flags plans the run config's defaults, auto settings resolved as on a CUDA device."""
    cfg, run = RunConfig(), PlannedRun()
    assert (run.algo, run.beta, run.prompts, run.group) == (cfg.algo.name, cfg.algo.beta, cfg.train.prompts_per_step,
                                                            cfg.rollout.group_size)
    assert (run.completion_len, run.micro_batch, run.chunk) == (cfg.rollout.max_new_tokens, cfg.train.micro_batch_size,
                                                                cfg.train.logprob_chunk)
    assert run.lora_rank == cfg.model.lora_r and cfg.model.lora and cfg.model.dtype == "auto"
    assert run.dtype == "bf16" and run.checkpointing is True  # dtype auto under LoRA, checkpointing auto on CUDA
    assert PlannedRun(lora_rank=0).dtype == "fp32"  # full fine-tuning: fp32 weights, as model.dtype=auto gives
    assert run.decode_precision == cfg.rollout.precision



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
    run = Run(algo="grpo", dtype="fp32", beta=0.1, prompts=2, group=2, prompt_len=3, completion_len=4,
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
    run = Run(dtype="fp32", beta=0.1, prompts=2, group=2, prompt_len=3, completion_len=4, micro_batch=4)
    ppo, grpo, saving = ppo_vs_grpo(TOY, run)
    head = 8 * 4 * 4
    assert ppo["critic"] == TOY.params * (4 + 4 + 8) + head
    assert ppo["total"] - grpo["total"] == ppo["critic"]
    assert saving == pytest.approx(ppo["critic"] / ppo["total"])
    lora = plan(TOY, Run(algo="ppo", lora_rank=2, beta=0.1))
    P_t = TOY.lora_params(2, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert lora["critic"] == P_t * (4 + 4 + 8) + head and lora["reference"] == 0
    bf16 = plan(TOY, Run(algo="ppo", lora_rank=2, beta=0.1, dtype="bf16"))  # + the head's fp32 copy, V x H x 4
    assert bf16["weights"] == TOY.params * 2 + P_t * 4 + TOY.vocab * 8 * 4


def test_bf16_and_sharding_by_hand():
    P = TOY.params
    run = Run(dtype="bf16", optimizer="adamw", beta=0.0, devices=4, zero=1)
    p = plan(TOY, run)
    assert p["weights"] == P * 2 and p["gradients"] == P * 2 and p["optimizer"] == P * 12 / 4  # + fp32 master
    p3 = plan(TOY, Run(dtype="bf16", beta=0.1, devices=4, zero=3))
    assert p3["weights"] == P * 2 / 4 and p3["reference"] == P * 2 / 4 and p3["gradients"] == P * 2 / 4
    eight_bit = plan(TOY, Run(dtype="fp32", optimizer="adamw_8bit"))
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


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_folded_copies_by_hand_for_the_issues_models():
    """SmolLM2-135M, LoRA on all linear layers: per layer q, o 576*576, k, v 576*192 (3 KV heads of 64), gate, up,
    down 576*1536; 30 layers. An fp32 model decoding in bf16 (auto: 50M+ parameters) also casts the tied output
    layer, 49152*576: the 269 MB of rollout.fold_lora's description."""
    linears = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert linears == 106_168_320
    smol = ARCHS["smollm2-135m"]
    fp32 = Run(dtype="fp32", lora_rank=16)
    assert decode_bytes(smol, fp32) == 2
    assert folded_copies(smol, fp32) == (linears + 49152 * 576) * 2 == 268_959_744
    # a bf16 model decodes in its own dtype: the output layer is not cast
    assert folded_copies(smol, Run(dtype="bf16", lora_rank=16)) == linears * 2
    # Qwen2.5-7B in bf16: q, o 3584*3584, k, v 3584*512 (4 KV heads of 128), MLP 3 * 3584*18944, 28 layers: ~13 GB
    seven = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) * 2
    assert folded_copies(ARCHS["7b"], Run(dtype="bf16", lora_rank=64)) == seven == 13_050_576_896
    assert folded_copies(smol, Run(dtype="fp32", lora_rank=16, decode_precision="fp32")) == linears * 4
    assert folded_copies(smol, Run(dtype="fp32", lora_rank=0, decode_precision="fp32")) == 0  # nothing to fold


@pytest.mark.parametrize("model_dtype, decode, targets, expected_linears, head_cast", [
    # the tiny Llama: 2 layers of q, o 32*32, k, v 32*16 (2 KV heads of 8), gate, up, down 32*64 = 9216 values
    (torch.float32, torch.float32, ALL, 2 * 9216, False),
    (torch.float32, torch.bfloat16, ALL, 2 * 9216, True),  # cast: every linear and the output layer
    (torch.bfloat16, torch.bfloat16, ALL, 2 * 9216, False),
    (torch.float32, torch.float32, ("q_proj", "v_proj", "down_proj"), 2 * (1024 + 512 + 2048), False),
    (torch.float32, torch.bfloat16, ("q_proj", "v_proj", "down_proj"), 2 * 9216, True),
    (torch.float32, torch.float32, (), 0, False),  # full fine-tuning, no cast: no copy
    (torch.float32, torch.bfloat16, (), 2 * 9216, True),
])
def test_folded_copies_match_what_decoding_copies(tokenizer, model_dtype, decode, targets, expected_linears,
                                                  head_cast):
    model = make_model(len(tokenizer), dtype=model_dtype)
    arch = arch_from_config(model.config)
    assert (arch.layers, arch.hidden, arch.intermediate, arch.kv_width) == (2, 32, 64, 16)
    if targets:
        model = add_lora(model, LoraSpec(r=4, target_modules=targets))
    expected = (expected_linears + (len(tokenizer) * 32 if head_cast else 0)) * decode.itemsize
    assert folded_bytes(model, decode) == expected
    run = Run(dtype="bf16" if model_dtype == torch.bfloat16 else "fp32", lora_rank=4 if targets else 0,
              lora_targets=targets or ALL, decode_precision="bf16" if decode == torch.bfloat16 else "fp32")
    assert folded_copies(arch, run) == expected


def test_kv_cache_matches_the_preallocated_cache(tokenizer):
    """2 prompts of 3 tokens prefilled, repeated for G = 3, with room for 4 new tokens: 6 rows of 7 positions."""
    model = make_model(len(tokenizer))
    cache = preallocated_cache(3 + 4)
    with torch.no_grad():
        model.model(input_ids=torch.randint(3, 300, (2, 3)), cache=cache, use_cache=True)
    cache.batch_repeat_interleave(3)
    held = sum(layer.key_buffer.nbytes + layer.value_buffer.nbytes for layer in cache.layers)
    assert held == 2 * 2 * 6 * 2 * 7 * 8 * 4  # layers x (keys, values) x [6 rows, 2 KV heads, 7, 8] fp32
    run = Run(prompts=2, group=3, prompt_len=3, completion_len=4)
    assert sampling(arch_from_config(model.config), run)["kv_cache"] == held


def test_sampling_by_hand():
    # TOY: 2 layers, H 8, I 16, 1 KV head of 4, V 10; 2 prompts x G 3 = 6 rows of 3 + 4 tokens
    run = Run(dtype="fp32", lora_rank=2, beta=0.1, prompts=2, group=3, prompt_len=3, completion_len=4,
              micro_batch=6, decode_precision="bf16")
    train = plan(TOY, run)
    resident = train["weights"] + train["gradients"] + train["optimizer"]  # no reference under LoRA, no critic
    folded, unfolded = sampling(TOY, run), sampling(TOY, run, fold=False)
    copies = (2 * (64 + 32 + 32 + 64 + 3 * 128) + 10 * 8) * 2  # bf16 copies of every linear and the output layer
    assert folded["folded"] == copies == 2464 and unfolded["folded"] == 0
    assert folded["kv_cache"] == unfolded["kv_cache"] == 2 * 2 * 6 * 7 * 4 * 4  # fp32, as the weights
    assert folded["logits"] == 6 * 10 * (4 + 4 + 2)  # two fp32 [6, 10] and the bf16 product
    assert unfolded["logits"] == 6 * 10 * (4 + 4)  # not folded: the output layer decodes in fp32
    assert folded["total"] == resident + 2464 + 2688 + 600
    assert unfolded["total"] == resident + 2688 + 480
    assert sampling(TOY, replace(run, decode_precision="fp32"))["folded"] == 2 * 576 * 4  # the adapted only
    halves = sampling(TOY, replace(run, devices=2))
    assert halves["kv_cache"] == 2688 / 2 and halves["logits"] == 300  # 3 rows a device
    ppo = sampling(TOY, replace(run, algo="ppo"))
    assert ppo["critic"] == plan(TOY, replace(run, algo="ppo"))["critic"] > 0
    assert ppo["total"] - folded["total"] == ppo["critic"]


def test_auto_folds_while_a_quarter_stays_free():
    run = Run(dtype="fp32", lora_rank=2, prompts=2, group=3, prompt_len=3, completion_len=4,
              decode_precision="bf16")
    s = sampling(TOY, run)
    threshold = (s["weights"] + s["gradients"] + s["optimizer"] + 2464 + s["kv_cache"] + s["logits"]) / 0.75
    assert fold_threshold(TOY, run) == pytest.approx(threshold)
    assert auto_folds(TOY, run, threshold * 1.001) and not auto_folds(TOY, run, threshold * 0.999)
    seven = Run(dtype="bf16", lora_rank=64, prompts=8, group=8, prompt_len=256, completion_len=1024)
    assert auto_folds(ARCHS["7b"], seven, 80e9) and not auto_folds(ARCHS["7b"], seven, 24e9)


def test_report_shows_the_sampling_phase():
    text = report(ARCHS["smollm2-135m"], Run(dtype="fp32", lora_rank=16))
    assert "| folded copies | 0.27 | 0.27 |" in text
    assert "total, not folded" in text and "rollout.fold_lora=auto folds on a GPU" in text
    with pytest.raises(ValueError, match="decode_precision"):
        sampling(TOY, Run(decode_precision="fp16"))
