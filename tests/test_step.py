"""The train step: micro-batching does not change the update; reference and old-policy handling."""

import copy

import pytest
import torch

from rlvr.core import LossSettings
from rlvr.learn.batch import StepBatch
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.models.policy import LoraSpec, ReferencePolicy, add_lora
from rlvr.rollout import Groups, SamplingParams
from tests.conftest import make_model, sample_tiny
from tests.reference import naive_update

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]
SYSTEM = {"role": "system", "content": "You are a careful assistant. Reply with one number and nothing else."}
SHARED_PREFIX = [[SYSTEM, {"role": "user", "content": "3 + 4 ="}], [SYSTEM, {"role": "user", "content": "12 * 9 = ?"}]]


def _batch(model, tokenizer, G=4, seed=0, temperature=1.0, prompts=PROMPTS) -> StepBatch:
    groups = sample_tiny(model, tokenizer, prompts, G, SamplingParams(temperature=temperature, max_new_tokens=8),
                         seed, eos_every=6)
    torch.manual_seed(seed)
    return StepBatch.from_groups(groups, torch.randn(groups.completion_ids.shape[0], dtype=torch.float64))


def _run(model, batch, settings, micro, iterations=1, reference=None, lr=1.0):
    """One train_step with SGD; prompts not shared, so every micro-batch split runs identical arithmetic."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return train_step(Learner(model, opt, None, reference), batch, settings,
                      StepOptions(num_iterations=iterations, micro_batch_size=micro, max_completion_tokens=8,
                                  max_grad_norm=0.0, share_prompt=False))


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "token_sum_constant"])
def test_one_by_eight_equals_eight_by_one(tokenizer, aggregation):
    """Same batch of 8 completions as 1 micro-batch of 8 and as 8 of 1: same update (fp64, atol 1e-10)."""
    base = make_model(len(tokenizer))
    batch = _batch(base, tokenizer)
    base = base.double()
    assert batch.completion_ids.shape[0] == 8
    settings = LossSettings(beta=0.1, aggregation=aggregation, is_level="sequence")
    updated = []
    for micro in (8, 1):
        model = copy.deepcopy(base)
        reference = ReferencePolicy(model)
        _run(model, batch, settings, micro, reference=reference)
        updated.append(dict(model.named_parameters()))
    deltas = 0.0
    for name, p in updated[0].items():
        assert torch.allclose(p, updated[1][name], atol=1e-10, rtol=0), name
        deltas += float((p - dict(base.named_parameters())[name]).abs().sum().detach())
    assert deltas > 0  # the update did something


def test_lora_reference_is_the_base_model(tokenizer):
    torch.manual_seed(0)
    model = add_lora(make_model(len(tokenizer)), LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    batch = _batch(model.get_base_model(), tokenizer)
    reference = ReferencePolicy(model)
    settings = LossSettings(beta=0.5, kl_estimator="k3")
    first = _run(model, batch, settings, micro=8, reference=reference, lr=0.5)
    assert first["kl"] == 0.0  # LoRA starts as the identity (B = 0): policy == reference
    second = _run(model, batch, settings, micro=8, reference=reference, lr=0.5)
    assert second["kl"] > 0.0
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in frozen)


def test_full_finetune_reference_stays_frozen(tokenizer):
    model = make_model(len(tokenizer))
    batch = _batch(model, tokenizer)
    reference = ReferencePolicy(model)
    with reference.active() as ref:
        before = {n: p.clone() for n, p in ref.named_parameters()}
    _run(model, batch, LossSettings(beta=0.1), micro=4, reference=reference, lr=0.1)
    with reference.active() as ref:
        assert all(torch.equal(before[n], p) for n, p in ref.named_parameters())
        assert ref is not model


def test_without_beta_no_reference_is_needed(tokenizer):
    model = make_model(len(tokenizer))
    metrics = _run(model, _batch(model, tokenizer), LossSettings(beta=0.0), micro=4, reference=None, lr=0.1)
    assert "kl" not in metrics
    with pytest.raises(ValueError, match="needs a reference"):
        _run(model, _batch(model, tokenizer), LossSettings(beta=0.1), micro=4, reference=None)


def test_multiple_iterations_reuse_old_logprobs(tokenizer):
    """mu = 2: the second pass sees ratios away from 1, so clipping can engage; mu = 1 never clips."""
    model = make_model(len(tokenizer))
    batch = _batch(model, tokenizer)
    once = _run(copy.deepcopy(model), batch, LossSettings(eps_low=1e-4, eps_high=1e-4), micro=4, lr=1.0)
    assert once["clip_low"] == 0.0 and once["clip_high"] == 0.0
    twice = _run(model, batch, LossSettings(eps_low=1e-4, eps_high=1e-4), micro=4, iterations=2, lr=1.0)
    assert twice["clip_low"] + twice["clip_high"] > 0.0


def test_excluded_rows_do_not_move_the_model(tokenizer):
    model = make_model(len(tokenizer))
    batch = _batch(model, tokenizer)
    batch.loss_mask = torch.zeros_like(batch.loss_mask)
    before = [p.clone() for p in model.parameters()]
    _run(model, batch, LossSettings(), micro=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("prompts", [PROMPTS, SHARED_PREFIX], ids=["own", "system-prefix"])
@pytest.mark.parametrize("rows", [list(range(8)), [1, 2, 5], [3]])
def test_shared_prompt_forward_equals_unshared(tokenizer, rows, prompts):
    """Prompt once per group (and a prefix common to all prompts once) vs the prompt once per completion: same
    log-probs and same gradients (fp64)."""
    from rlvr.learn.forward import completion_logprobs
    from rlvr.rollout import encode_prompts
    from rlvr.rollout.engine import common_prefix_length

    assert (common_prefix_length(*encode_prompts(tokenizer, prompts)) >= 16) == (prompts is SHARED_PREFIX)
    model = make_model(len(tokenizer))
    batch = _batch(model, tokenizer, prompts=prompts)
    model = model.double()
    rows = torch.tensor(rows)
    results = []
    for share in (False, True):
        model.zero_grad()
        batch.temperature = torch.full_like(batch.temperature, 0.9)
        logp, entropy = completion_logprobs(model, batch, rows, 5, with_entropy=True, share_prompt=share)
        (logp * batch.completion_mask[rows]).sum().backward()
        results.append((logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]))
    (a, ea, ga), (b, eb, gb) = results
    m = batch.completion_mask[rows].bool()
    assert torch.allclose(a[m], b[m], atol=1e-10) and torch.allclose(ea[m], eb[m], atol=1e-10)
    # HF's Llama runs RMSNorm in float32 even in a float64 model, so gradients (summed over the group in a
    # different order) agree to float32 precision: 1e-6 of each tensor's largest entry.
    assert all(torch.allclose(x, y, rtol=0, atol=1e-6 * float(y.abs().max())) for x, y in zip(ga, gb))


def _mixed_temperature_batch(model, tokenizer) -> StepBatch:
    """Two groups sampled at temperatures 0.7 and 1.3, concatenated: the trainer must score each at its own."""
    parts = [sample_tiny(model, tokenizer, [prompt], 4, SamplingParams(temperature=t, max_new_tokens=8), 3, eos_every=6)
             for prompt, t in zip(PROMPTS, (0.7, 1.3))]
    adv = torch.randn(8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return StepBatch.from_groups(Groups.concat(parts), adv)


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
@pytest.mark.parametrize("share_prompt", [False, True])
@pytest.mark.parametrize("temperatures", ["uniform", "mixed", "uniform-system-prefix"])
def test_step_equals_naive_reference(tokenizer, aggregation, share_prompt, temperatures):
    """The fused, chunked, prompt-shared step vs full logits through autograd (tests/reference.py): same loss,
    statistics and update, with every completion scored at its own sampling temperature."""
    base = make_model(len(tokenizer))
    if temperatures == "uniform-system-prefix":
        batch = _batch(base, tokenizer, temperature=0.8, prompts=SHARED_PREFIX)
    elif temperatures == "mixed":
        batch = _mixed_temperature_batch(base, tokenizer)
        assert batch.temperature[:, 0].tolist() == pytest.approx([0.7] * 4 + [1.3] * 4)
    else:
        batch = _batch(base, tokenizer, temperature=0.8)
    base = base.double()
    settings = LossSettings(beta=0.1, aggregation=aggregation, eps_low=0.05, eps_high=0.05)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = train_step(Learner(model, opt, None, ReferencePolicy(model)), batch, settings,
                         StepOptions(micro_batch_size=3, max_completion_tokens=8, max_grad_norm=0.0,
                                     share_prompt=share_prompt, chunk_tokens=5))
    naive = copy.deepcopy(base)
    with torch.no_grad():
        from tests.reference import naive_logprobs

        ref_logp = naive_logprobs(base, batch)
    loss, sums = naive_update(naive, batch, settings, lr=0.5, ref_logp=ref_logp)
    tokens = sums["tokens"]
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-9)
    assert metrics["kl"] == pytest.approx(sums["kl"] / tokens, rel=1e-6, abs=1e-9)
    assert metrics["is_weight_mean"] == pytest.approx(sums["is_weight_mean"] / tokens, rel=1e-6)
    for name, p in dict(naive.named_parameters()).items():
        q = dict(model.named_parameters())[name]
        assert torch.allclose(p, q, rtol=0, atol=1e-6 * float(p.detach().abs().max())), name  # see shared-prompt test


def test_checkpointing_with_shared_prompt_equals_plain(tokenizer):
    from rlvr.learn.forward import completion_logprobs

    model = make_model(len(tokenizer)).double()
    batch = _batch(make_model(len(tokenizer)), tokenizer)
    rows = torch.arange(8)
    grads = []
    for checkpointing in (False, True):
        m = copy.deepcopy(model).train()
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logp, _ = completion_logprobs(m, batch, rows, 7, share_prompt=True)
        (logp * batch.completion_mask).sum().backward()
        grads.append((logp.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-10)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6 * float(b.abs().max())) for a, b in zip(grads[0][1], grads[1][1]))


def test_per_token_advantages(tokenizer):
    """adv [N, T] equal to [N] broadcast over tokens gives the same update; varying per token it matches the
    naive reference (the form GAE advantages take)."""
    base = make_model(len(tokenizer)).double()
    batch = _batch(make_model(len(tokenizer)), tokenizer)
    settings = LossSettings(aggregation="token_mean")
    per_row = copy.deepcopy(base)
    _run(per_row, batch, settings, micro=3, lr=0.5)
    expanded = copy.deepcopy(base)
    _run(expanded, StepBatch(**{**batch.__dict__, "adv": batch.adv[:, None].expand_as(batch.behaviour_logp)}),
         settings, micro=3, lr=0.5)
    for p, q in zip(per_row.parameters(), expanded.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
    varying = StepBatch(**{**batch.__dict__, "adv": torch.randn(batch.behaviour_logp.shape, dtype=torch.float64)})
    model, naive = copy.deepcopy(base), copy.deepcopy(base)
    _run(model, varying, settings, micro=3, lr=0.5)
    naive_update(naive, varying, settings, lr=0.5)
    for p, q in zip(naive.parameters(), model.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6 * float(p.detach().abs().max()))


def _assert_same_update(naive, model, base):
    """The step's weights equal the naive reference's (to float32 precision, see the shared-prompt test), and moved."""
    moved = 0.0
    for name, p in dict(naive.named_parameters()).items():
        q = dict(model.named_parameters())[name]
        assert torch.allclose(p, q, rtol=0, atol=1e-6 * float(p.detach().abs().max())), name
        moved += float((q - dict(base.named_parameters())[name]).abs().sum().detach())
    assert moved > 0


def _hand_batch(lengths: list[int], adv: list[float], group_size: int, trained: list[bool] | None = None) -> StepBatch:
    """A batch with no model behind it: completion i attends to its first lengths[i] tokens (T = 6)."""
    n, t = len(lengths), 6
    mask = (torch.arange(t)[None] < torch.tensor(lengths)[:, None]).long()  # [N, T]
    loss_mask = mask * torch.tensor(trained or [True] * n)[:, None].long()
    return StepBatch(prompt_ids=torch.ones(n // group_size, 2, dtype=torch.long),
                     prompt_mask=torch.ones(n // group_size, 2, dtype=torch.long),
                     completion_ids=torch.ones(n, t, dtype=torch.long), completion_mask=mask, loss_mask=loss_mask,
                     behaviour_logp=torch.zeros(n, t), temperature=torch.ones(n, t), adv=torch.tensor(adv),
                     group_size=group_size)


def test_micro_batches_by_hand():
    from rlvr.learn.step import micro_batches, row_width

    # groups (rows 0-1), (2-3), (4-5) with longest completions 3, 6, 5; row 5 is not trained on
    batch = _hand_batch([2, 3, 6, 1, 5, 4], [0.5, -0.5, 0.0, 1.0, 0.0, 0.0], 2, trained=[1, 1, 1, 1, 1, 0])
    # longest group first, longest row first within it; row 5 (nothing trained) always left out
    assert [r.tolist() for r in micro_batches(batch, 2, skip_zero_advantage=False)] == [[2, 3], [4, 1], [0]]
    # without a KL term rows 2 and 4 (advantage 0) carry no gradient either
    assert [r.tolist() for r in micro_batches(batch, 2, skip_zero_advantage=True)] == [[3, 1], [0]]
    assert row_width(batch, torch.tensor([3, 1])) == 3 and row_width(batch, torch.tensor([2])) == 6
    assert micro_batches(_hand_batch([2, 2], [0.0, 0.0], 2), 4, skip_zero_advantage=True) == []


@pytest.mark.parametrize("share_prompt", [False, True])
@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_rows_without_gradient_are_skipped_with_the_same_update(tokenizer, share_prompt, aggregation):
    """beta = 0 and half the advantages 0 (as negative_scale = 0 leaves them): the step leaves those rows out and
    cuts micro-batches to their longest row, yet its loss and update equal the naive whole-batch reference."""
    base = make_model(len(tokenizer))
    batch = _batch(base, tokenizer, temperature=0.8, prompts=SHARED_PREFIX)
    lengths = batch.completion_mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 1  # rows of different lengths: the cut to the longest row matters
    batch.adv = torch.where(torch.arange(8) % 2 == 0, batch.adv, torch.zeros_like(batch.adv))
    base = base.double()
    settings = LossSettings(beta=0.0, aggregation=aggregation, eps_low=0.05, eps_high=0.05)
    model, naive = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    metrics = train_step(Learner(model, opt), batch, settings,
                         StepOptions(micro_batch_size=3, max_completion_tokens=8, max_grad_norm=0.0,
                                     share_prompt=share_prompt, chunk_tokens=5))
    loss, _ = naive_update(naive, batch, settings, lr=0.5)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-9)
    _assert_same_update(naive, model, base)


def test_mask_truncated_leaves_cut_completions_untrained(tokenizer):
    """DAPO's overlong filtering: a completion cut at max_new_tokens keeps its tokens but none is trained on."""
    groups = sample_tiny(make_model(len(tokenizer)), tokenizer, PROMPTS, 4, SamplingParams(max_new_tokens=8), 1,
                         eos_every=6)
    cut = groups.truncated
    assert 0 < int(cut.sum()) < 8  # some cut, some ended by themselves
    batch = StepBatch.from_groups(groups, torch.ones(8), mask_truncated=True)
    assert torch.equal(batch.loss_mask.any(dim=1), ~cut)
    assert torch.equal(batch.loss_mask[~cut], batch.completion_mask[~cut])
    assert torch.equal(batch.completion_mask, StepBatch.from_groups(groups, torch.ones(8)).loss_mask)  # off: all
    no_reward = torch.tensor([True, False] * 4)
    both = StepBatch.from_groups(groups, torch.ones(8), no_reward, mask_truncated=True)
    assert torch.equal(both.loss_mask.any(dim=1), no_reward & ~cut)


def test_chunks_shrink_for_large_vocabularies():
    from rlvr.learn.step import chunk_for_vocab

    assert chunk_for_vocab(512, 49_152) == 512  # SmolLM2: 2**25 // 49152 = 682 > 512
    assert chunk_for_vocab(512, 262_144) == 128  # Gemma 3: 2**25 // 262144
    assert chunk_for_vocab(64, 262_144) == 64
    assert chunk_for_vocab(512, 10**9) == 1


OBJECTIVE_KNOBS = {  # each objective and loss term through the whole step
    "gspo": {"objective": "gspo", "eps_low": 3e-4, "eps_high": 4e-4},
    "gspo_token": {"objective": "gspo_token"},
    "cispo": {"objective": "cispo", "eps_low": 1.0, "eps_high": 0.05, "aggregation": "token_mean"},
    "sapo": {"objective": "sapo", "beta": 0.1},
    "luspo": {"objective": "gspo", "aggregation": "sequence_sum"},
    "entropy_bonus": {"entropy_coef": 0.05, "aggregation": "token_sum_constant"},
    "entropy_bonus_rows_without_advantage": {"entropy_coef": 0.05},  # beta 0: zero-advantage rows still get the bonus
    "top_entropy": {"top_entropy_quantile": 0.5, "beta": 0.1},
    "top_entropy_rows_without_gradient": {"top_entropy_quantile": 0.5},
    "untrained_rows_counted": {"count_untrained_rows": True},  # TRL's count: rows 1 and 5 (untrained) divide too
}


@pytest.mark.parametrize("knobs", sorted(OBJECTIVE_KNOBS))
def test_each_objective_step_equals_naive_reference(tokenizer, knobs):
    """The fused, micro-batched, prompt-shared step vs the naive whole-batch specification for every objective:
    same loss and update (and the same top-entropy tokens chosen over the whole step)."""
    from rlvr.learn.step import high_entropy_tokens
    from tests.reference import naive_logprobs

    base = make_model(len(tokenizer))
    batch = _batch(base, tokenizer, temperature=0.8, prompts=SHARED_PREFIX)
    if knobs.endswith(("rows_without_gradient", "rows_without_advantage")):
        batch.adv[::2] = 0.0  # beta = 0: rows with advantage 0 carry no policy gradient, yet their tokens count
        # towards the step's entropy threshold, and the entropy bonus still reaches them
    if knobs == "untrained_rows_counted":
        batch.loss_mask[[1, 5]] = 0
    base = base.double()
    settings = LossSettings(**{"beta": 0.0, **OBJECTIVE_KNOBS[knobs]})
    model, naive = copy.deepcopy(base), copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = ReferencePolicy(model) if settings.beta else None
    metrics = train_step(Learner(model, opt, None, reference), batch, settings,
                         StepOptions(micro_batch_size=3, max_completion_tokens=8, max_grad_norm=0.0, chunk_tokens=5))
    with torch.no_grad():
        ref_logp = naive_logprobs(base, batch) if settings.beta else None
        entropy = naive_logprobs(base, batch, with_entropy=True)[1]
    high = None
    if settings.top_entropy_quantile < 1:
        high = high_entropy_tokens(entropy, batch.loss_mask, settings.top_entropy_quantile)
    loss, _ = naive_update(naive, batch, settings, lr=0.5, ref_logp=ref_logp, high_entropy=high)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-9)
    if high is not None:
        computed = batch.loss_mask.bool() & (batch.adv != 0)[:, None]  # the statistics cover the computed rows
        assert metrics["entropy_masked_frac"] == pytest.approx(1 - float((high & computed).sum() / computed.sum()))
        assert 0.3 < metrics["entropy_masked_frac"] < 0.7
    _assert_same_update(naive, model, base)
