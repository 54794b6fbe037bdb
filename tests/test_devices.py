"""Every tensor the train step (reference, proximal and top-entropy passes), PPO's update, the local sampler and the
in-process episode driver create follows the model's device: run under a non-CPU *default* device ("meta"), a tensor
made without an explicit device lands on meta and the first operation that meets the CPU model fails loudly (CPU
bookkeeping says device="cpu"). The results must equal a plain run (the default device changes where factories put
tensors, nothing else). rlvr serve's engine and the remote sampler: tests/test_devices_serve.py. Then what a run on a
device is made of: train.device, model.dtype (a bf16 base with fp32 adapters, trained and sampled here on the CPU),
rollout.fold_lora, the out-of-memory line, the CUDA generator states in checkpoints."""

import copy

import pytest
import torch

from rlvr.core import LossSettings, PPOSettings
from rlvr.learn.batch import StepBatch
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.models.policy import LoraSpec, ReferencePolicy, add_lora
from rlvr.rollout import SamplingParams
from tests.conftest import make_model, sample_tiny

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]


def _setup(tokenizer, lora):
    base = make_model(len(tokenizer))
    groups = sample_tiny(base, tokenizer, PROMPTS, 4, SamplingParams(max_new_tokens=8), 0, eos_every=6)
    model = make_model(len(tokenizer), seed=1)
    if lora:
        model = add_lora(model, LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    adv = torch.randn(8, generator=torch.Generator().manual_seed(0))
    return model, StepBatch.from_groups(groups, adv)


def _grpo(model, reference, batch, knobs, iterations):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return train_step(Learner(model, opt, None, reference), batch, LossSettings(**knobs),
                      StepOptions(num_iterations=iterations, micro_batch_size=3, max_completion_tokens=8))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("knobs, iterations", [
    ({"beta": 0.04}, 1),  # the reference pass
    ({"beta": 0.0, "top_entropy_quantile": 0.5, "entropy_coef": 0.01}, 1),  # the entropy pass, entropy gradients
    ({"beta": 0.04, "objective": "gspo", "is_level": "sequence"}, 2),  # the proximal pass
], ids=["kl", "entropy", "proximal"])
def test_train_step_makes_every_tensor_on_the_models_device(tokenizer, lora, knobs, iterations):
    model, batch = _setup(tokenizer, lora)
    twin = copy.deepcopy(model)
    want = _grpo(twin, ReferencePolicy(twin), batch, knobs, iterations)
    reference = ReferencePolicy(model)  # the run's objects are built before the step, as rlvr train builds them
    with torch.device("meta"):
        got = _grpo(model, reference, batch, knobs, iterations)
    assert got == want
    assert all(p.device.type == "cpu" and torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_ppo_step_makes_every_tensor_on_the_models_device(tokenizer):
    from rlvr.learn.ppo import Critic, ppo_step

    def build(model):
        torch.manual_seed(0)
        critic = Critic(model)
        opt = torch.optim.SGD(critic.trainable_parameters(model), lr=0.1)
        return critic, opt, ReferencePolicy(model)

    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.5])  # from the reward functions, on the CPU

    def run(model, critic, opt, reference, batch):
        return ppo_step(Learner(model, opt, None, reference), critic, batch, rewards, LossSettings(),
                        PPOSettings(kl_coef=0.05), StepOptions(micro_batch_size=3, max_completion_tokens=8))

    model, batch = _setup(tokenizer, lora=True)
    twin = copy.deepcopy(model)
    want = run(twin, *build(twin), batch)
    parts = build(model)
    with torch.device("meta"):
        got = run(model, *parts, batch)
    assert got == want


def _same_groups(a, b):
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behaviour_logp", "truncated",
                 "version", "temperature", "sampled_mask"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.device.type == "cpu" and torch.equal(x, y), name
    assert a.texts == b.texts


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=8), SamplingParams(temperature=0.0, max_new_tokens=8),
                                    SamplingParams(max_new_tokens=8, stop=("1",), top_k=5)],
                         ids=["sampled", "greedy", "stop-top-k"])
def test_the_local_sampler_makes_every_tensor_on_the_models_device(tokenizer, params):
    """LocalSampler (folded LoRA decoding weights, KV cache, a prefix common to the prompts): the groups come back on
    the CPU, the same as without the meta default."""
    from rlvr.rollout import LocalSampler

    model, _ = _setup(tokenizer, lora=True)
    sampler = LocalSampler(model, tokenizer)
    want = sampler.sample(PROMPTS, 4, params, seed=3)
    with torch.device("meta"):
        got = sampler.sample(PROMPTS, 4, params, seed=3)
    _same_groups(got, want)


def test_the_episode_driver_makes_every_tensor_on_the_models_device(tokenizer):
    """Episodes in process: model turns, observation tokens appended, per-episode generators."""
    from rlvr.models.prompts import prompt_token_ids
    from rlvr.rollout import LocalSampler
    from rlvr.rollout.episodes import EpisodeLimits
    from tests.test_episodes import Scripted

    model, _ = _setup(tokenizer, lora=True)
    model.generation_config.eos_token_id = list(range(0, len(tokenizer), 5))  # turns end at varied lengths
    prompt_ids = [prompt_token_ids(tokenizer, p) for p in PROMPTS]

    def run():
        envs = [Scripted(calls=2) for _ in range(4)]
        return LocalSampler(model, tokenizer).sample_episodes(prompt_ids, envs, 2, SamplingParams(max_new_tokens=16),
                                                              0, EpisodeLimits(max_turns=3, max_episode_tokens=80))

    want = run()
    with torch.device("meta"):
        got = run()
    _same_groups(got.groups, want.groups)
    assert got.messages == want.messages


# ----------------------------------------------------------------------------------------------- a run's device
def test_train_device_spellings_and_a_missing_gpu():
    from rlvr.config.schema import TrainConfig
    from rlvr.platform.devices import resolve_device

    for spec in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        TrainConfig(device=spec)
    for spec in ("gpu", "cuda:", "CUDA", "cuda:x", ""):
        with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N or mps"):
            TrainConfig(device=spec)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the missing-GPU errors cannot be seen")
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="no CUDA device is visible.*train.device=cpu"):
            resolve_device(spec)


def test_trl_use_cpu_maps_to_train_device(tmp_path):
    from rlvr.api import GRPOConfig, _run_config

    for use_cpu, device in ((True, "cpu"), (False, "auto")):
        args = GRPOConfig(output_dir=str(tmp_path), use_cpu=use_cpu, report_to=None)
        assert _run_config(args, "m", None, 16, "t.jsonl", "e.jsonl", 4, "numeric_match",
                           [("numeric_match", {}, 1.0)], {}).train.device == device


def test_weight_dtype_choices():
    from rlvr.config.schema import ModelConfig
    from rlvr.platform.devices import weight_dtype

    cpu = torch.device("cpu")
    assert weight_dtype("auto", cpu, lora=True) == torch.float32 == weight_dtype("auto", cpu, lora=False)
    assert weight_dtype("bf16", cpu, lora=True) == torch.bfloat16 and weight_dtype("fp32", cpu, True) == torch.float32
    with pytest.raises(ValueError, match="model.autocast=bf16"):
        ModelConfig(lora=False, dtype="bf16")
    assert ModelConfig().gradient_checkpointing == "auto" and ModelConfig(gradient_checkpointing="false") \
        .gradient_checkpointing is False


def test_the_step_batch_crosses_once(tokenizer):
    _, batch = _setup(tokenizer, lora=False)
    assert batch.to(torch.device("cpu")) is batch  # already there: no copy
    moved = batch.to(torch.device("meta"))
    assert moved is not batch and {t.device.type for t in vars(moved).values() if isinstance(t, torch.Tensor)} \
        == {"meta"} and moved.group_size == batch.group_size


def test_a_bf16_base_with_fp32_adapters_trains_and_samples(tokenizer, tiny_model_dir):
    """model.dtype=bf16 under LoRA (what auto picks on a bf16 GPU), here on the CPU: base weights bf16, adapters and
    optimizer state fp32, log-probs fp32; the sampler decodes in bf16 with fp32 logits and folds into bf16 copies."""
    from rlvr.config.schema import ModelConfig
    from rlvr.rollout import LocalSampler
    from rlvr.rollout.decode_weights import decode_dtype, decoding, folded_bytes
    from rlvr.run.build import build_policy

    model = build_policy(tiny_model_dir, ModelConfig(name=str(tiny_model_dir), lora_r=4, dtype="bf16"))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    assert decode_dtype("auto", model) == torch.bfloat16  # no fp32 copies of a bf16 model
    with torch.no_grad(), decoding(model, decode_dtype("auto", model)) as (backbone, head):
        hidden = backbone(input_ids=torch.tensor([[5, 6, 7]])).last_hidden_state[:, -1]
        assert head(hidden).dtype == torch.float32
    # q/k/v/o, gate/up/down of 2 layers in bf16 (the tied head stays the model's own)
    adapted = sum(m.get_base_layer().weight.numel() for n, m in model.named_modules() if hasattr(m, "lora_A")
                  and hasattr(m, "get_base_layer"))
    assert folded_bytes(model, torch.bfloat16) == adapted * 2
    groups = LocalSampler(model, tokenizer).sample(PROMPTS, 4, SamplingParams(max_new_tokens=8), seed=0)
    assert groups.behaviour_logp.dtype == torch.float32
    batch = StepBatch.from_groups(groups, torch.tensor([1.0, -1.0] * 4))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stats = train_step(Learner(model, opt, None, ReferencePolicy(model)), batch, LossSettings(beta=0.04),
                       StepOptions(micro_batch_size=3, max_completion_tokens=8))
    assert stats["skipped_updates"] == 0 and abs(stats["logp_gap"]) < 0.05  # sampler and trainer: the same bf16 base
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {s.dtype for state in opt.state.values() for s in state.values() if s.dim()} == {torch.float32}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=8),
                                    SamplingParams(max_new_tokens=8)], ids=["greedy", "sampled"])
def test_decoding_without_folding_gives_the_same_samples(tokenizer, params):
    """rollout.fold_lora=false decodes through peft (no weight copies); in fp64 the two agree to the last bit of
    every token choice and to float32 rounding in the recorded log-probs."""
    from rlvr.rollout import LocalSampler

    model = add_lora(make_model(len(tokenizer), dtype=torch.float64), LoraSpec(r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)  # a trained adapter, so folding has something to fold
    folded = LocalSampler(model, tokenizer, fold_lora=True).sample(PROMPTS, 4, params, seed=5)
    unfolded = LocalSampler(model, tokenizer, fold_lora=False).sample(PROMPTS, 4, params, seed=5)
    assert torch.equal(folded.completion_ids, unfolded.completion_ids)
    assert torch.allclose(folded.behaviour_logp, unfolded.behaviour_logp, atol=2e-6, rtol=0)


def test_fold_lora_auto_folds_on_the_cpu_and_counts_the_generation(tokenizer):
    from rlvr.rollout.decode_weights import fold_choice, generation_bytes

    model = add_lora(make_model(len(tokenizer)), LoraSpec(r=4, alpha=8))
    assert fold_choice("auto", model, torch.float32, 3, 10) is True
    assert fold_choice(False, model, torch.float32) is False
    # what auto reserves beside the copies on a GPU: keys and values of 2 layers x 2 KV heads x 8 dims per token in
    # fp32 for 3 rows x 10 tokens, and two steps of fp32 logits [3, V]
    assert generation_bytes(model, 3, 10) == 2 * 2 * 3 * 10 * 2 * 8 * 4 + 2 * 3 * len(tokenizer) * 4


@pytest.mark.long
def test_out_of_memory_is_one_line_naming_the_knobs_and_the_checkpoint(tiny_model_dir, tmp_path):
    from tests.test_resume import _cli, _overrides

    out = tmp_path / "run"
    args = ["examples/demo.yaml", *_overrides(tiny_model_dir, out, True)]
    failed = _cli(args, fault="after_generate@3:oom")
    assert failed.returncode == 2, failed.stderr[-2000:]
    line = failed.stderr.strip().splitlines()[-1]
    assert "Traceback" not in failed.stderr
    for part in ("step 3", "ran out of memory", "train.micro_batch_size (now 3)", "rollout.max_new_tokens (now 6)",
                 "rollout.group_size (now 4)", "rollout.fold_lora (now auto)", "model.gradient_checkpointing (now off)",
                 str(out / "checkpoints" / "step-00000002"), "resume=auto"):
        assert part in line, line
    resumed = _cli([*args, "resume=auto"])
    assert resumed.returncode == 0 and "(step 2)" in resumed.stdout, resumed.stderr[-2000:]


def test_cuda_generator_states_in_a_checkpoint_are_checked_and_kept_for_a_gpu(tmp_path):
    from rlvr.store.checkpoint import _cuda_rng_states

    assert _cuda_rng_states(None) == []
    if not torch.cuda.is_available():  # a checkpoint from a GPU machine resumes here with fresh device streams
        assert _cuda_rng_states(["00ff" * 8]) == []
    for bad in ("00", ["zz"], [1], ["0"], ["00"] * 2000):
        with pytest.raises(ValueError, match="random generator states"):
            _cuda_rng_states(bad)


def test_adamw_is_fused_only_over_cuda_parameters():
    """The fused kernel where every parameter is on CUDA (tensors or param groups); the CPU, the meta device and a
    mix keep the for-each one."""
    from rlvr.config.schema import TrainConfig
    from rlvr.run.build import build_optimizer, fused_adamw

    class OnCuda:  # a parameter's device is all the choice reads (no GPU here)
        device = torch.device("cuda", 0)

    cpu = torch.nn.Parameter(torch.zeros(2, device="cpu"))
    assert fused_adamw([OnCuda(), OnCuda()]) and fused_adamw([{"params": [OnCuda()]}])
    assert not fused_adamw([cpu]) and not fused_adamw([OnCuda(), cpu]) and not fused_adamw([])
    assert not fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    optimizer = build_optimizer(torch.nn.Linear(2, 2), TrainConfig(), [cpu])
    assert not optimizer.defaults["fused"]


@pytest.mark.parametrize("capability, want", [((8, 0), "bf16"), ((7, 5), "none")])
def test_autocast_auto_is_bf16_for_fp32_weights_on_a_bf16_card_only(monkeypatch, capability, want):
    """model.autocast=auto: full fine-tuning (fp32 weights) on a CUDA card with bf16 units runs its matmuls in bf16
    (TRL's default there); a bf16 base, a T4/V100 and the CPU keep what they had; explicit settings pass through.
    (The card is a stand-in: no GPU here.)"""
    from rlvr.platform.devices import autocast_mode

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    assert autocast_mode("auto", cuda, torch.float32) == want
    assert autocast_mode("auto", cuda, torch.bfloat16) == "none"  # a bf16 base (LoRA) computes in bf16 already
    assert autocast_mode("auto", torch.device("cpu"), torch.float32) == "none"
    assert autocast_mode("none", cuda, torch.float32) == "none" and autocast_mode("bf16", torch.device("cpu"),
                                                                                   torch.float32) == "bf16"
