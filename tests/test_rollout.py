"""The group sampler: equals HF generate when greedy, and records the log-probs the trainer recomputes."""

import pytest
import torch

from rlvr.learn.forward import completion_logprobs
from rlvr.rollout import SamplingParams, encode_prompts, generate_groups
from tests.conftest import make_model, sample_tiny

PROMPTS = [
    [{"role": "user", "content": "3 + 4 ="}],
    [{"role": "system", "content": "Reply with only the number."}, {"role": "user", "content": "12 * 9 ="}],
    "What is 7?",
]


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model(len(tokenizer)).eval()


def _sample(model, tokenizer, group_size, params, seed=0, eos_ids=(2,)):
    ids, mask = encode_prompts(tokenizer, PROMPTS)
    out = generate_groups(model.model, model.lm_head, ids, mask, group_size, params, list(eos_ids),
                          tokenizer.pad_token_id,
                          torch.Generator().manual_seed(seed))
    return ids, mask, out


def test_prompts_are_left_padded(tokenizer):
    ids, mask = encode_prompts(tokenizer, PROMPTS)
    lengths = mask.sum(-1)
    assert lengths.max() == ids.shape[1] and (lengths < ids.shape[1]).any()
    for row, m in zip(ids, mask):
        assert (row[m == 0] == tokenizer.pad_token_id).all()
        assert m.tolist() == sorted(m.tolist())  # zeros first


def test_greedy_single_sample_equals_hf_generate(model, tokenizer):
    ids, mask, out = _sample(model, tokenizer, 1, SamplingParams(temperature=0.0, max_new_tokens=10))
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=2,
                         pad_token_id=tokenizer.pad_token_id, top_k=None, top_p=None)[:, ids.shape[1]:]
    for row in range(ids.shape[0]):
        n = int(out.mask[row].sum())
        assert out.ids[row, :n].tolist() == ref[row, :n].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_match_trainer(model, tokenizer, temperature):
    from rlvr.learn.batch import StepBatch

    groups = sample_tiny(model, tokenizer, PROMPTS, 4, SamplingParams(temperature=temperature, max_new_tokens=12),
                         eos_every=5)
    batch = StepBatch.from_groups(groups, torch.zeros(groups.completion_ids.shape[0]))
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, torch.arange(batch.num_completions), 64)
    m = groups.completion_mask.bool()
    assert (m.sum(-1) < 12).any(), "some completions should end early"
    assert (logp - groups.behaviour_logp)[m].abs().mean() < 1e-4
    assert (groups.behaviour_logp[~m] == 0).all()
    assert (batch.temperature == temperature).all()


def test_eos_ends_completion_and_mask(model, tokenizer):
    eos = list(range(0, len(tokenizer), 4))
    _, _, out = _sample(model, tokenizer, 4, SamplingParams(max_new_tokens=12), eos_ids=eos)
    for row, m, trunc in zip(out.ids, out.mask, out.truncated):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        assert (row[n:] == 0).all()  # pad id of the test tokenizer
        assert bool(trunc) == (row[n - 1].item() not in eos)
        assert all(t not in eos for t in row[: n - 1].tolist())


def test_top_k_only_draws_from_top_k(model, tokenizer):
    ids, mask, out = _sample(model, tokenizer, 4, SamplingParams(top_k=3, max_new_tokens=6))
    full = torch.cat([ids.repeat_interleave(4, 0), out.ids], 1)
    att = torch.cat([mask.repeat_interleave(4, 0), out.mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits
    p = ids.shape[1]
    step_logits = logits[:, p - 1 : -1]  # [N, T, V]
    rank = (step_logits > step_logits.gather(-1, out.ids[..., None])).sum(-1)
    assert (rank[out.mask] < 3).all()


def test_top_p_keeps_the_nucleus():
    from rlvr.rollout.engine import _filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_filter_logits(logits, top_k=0, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.5 + 0.3 crosses it


def test_seeded_and_groups_differ(model, tokenizer):
    params = SamplingParams(max_new_tokens=8)
    _, _, a = _sample(model, tokenizer, 4, params, seed=1)
    _, _, b = _sample(model, tokenizer, 4, params, seed=1)
    _, _, c = _sample(model, tokenizer, 4, params, seed=2)
    assert torch.equal(a.ids, b.ids)
    assert not torch.equal(a.ids, c.ids)
    assert len({tuple(r.tolist()) for r in a.ids[:4]}) > 1


def test_stop_strings_end_completions(model, tokenizer):
    from rlvr.rollout import sample_groups

    params = SamplingParams(max_new_tokens=24, stop=("e",))
    groups = sample_groups(model, tokenizer, PROMPTS, 4, params, torch.Generator().manual_seed(3))
    stopped = 0
    for ids, mask, trunc in zip(groups.completion_ids, groups.completion_mask, groups.truncated):
        tokens = ids[mask.bool()].tolist()
        pieces = [tokenizer.decode(tokens[:k], skip_special_tokens=True) for k in range(1, len(tokens) + 1)]
        assert all("e" not in p for p in pieces[:-1])  # nothing before the last token completed a stop string
        if "e" in pieces[-1]:
            stopped += 1
            assert not trunc  # a stop string ends a completion normally
    assert stopped > 0


def test_truncated_sampling_records_the_processed_logprob(model, tokenizer):
    """With top-k the recorded log-prob is under the renormalised top-k distribution (vLLM's processed mode)."""
    ids, mask, out = _sample(model, tokenizer, 4, SamplingParams(top_k=3, temperature=0.8, max_new_tokens=5))
    full = torch.cat([ids.repeat_interleave(4, 0), out.ids], 1)
    att = torch.cat([mask.repeat_interleave(4, 0), out.mask.long()], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits
    step_logits = logits[:, ids.shape[1] - 1 : -1] / 0.8  # [N, T, V]
    top = step_logits.topk(3, dim=-1).values  # the three kept logits
    expected = step_logits.gather(-1, out.ids[..., None]).squeeze(-1) - top.logsumexp(-1)
    assert torch.allclose(out.behaviour_logp[out.mask], expected[out.mask], atol=1e-5)


def test_per_completion_generators_make_samples_independent_of_the_batch(model, tokenizer):
    """One generator per completion: a prompt's samples depend on its seeds only, not on what shares the batch."""
    params = SamplingParams(max_new_tokens=8)

    def run(prompts, seeds):
        ids, mask = encode_prompts(tokenizer, prompts)
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return generate_groups(model.model, model.lm_head, ids, mask, 2, params, [2], tokenizer.pad_token_id, gens)

    alone = run([PROMPTS[0]], [11, 12])
    together = run([PROMPTS[1], PROMPTS[0]], [21, 22, 11, 12])
    width = alone.ids.shape[1]
    assert torch.equal(together.ids[2:, :width], alone.ids) and torch.equal(together.mask[2:, :width], alone.mask)


SHARED = [{"role": "system", "content": "You are a careful assistant. Reply with one number and nothing else."}]
SHARED_PROMPTS = [[*SHARED, {"role": "user", "content": q}] for q in ("3 + 4 =", "12 * 9 = ?", "What is 7 - 5?")]


def test_common_prefix_length_by_hand():
    from rlvr.rollout.engine import common_prefix_length

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [5, 6, 7, 9, 9, 9], [0, 5, 6, 1, 2, 3]])
    mask = (torch.arange(6)[None] >= torch.tensor([2, 0, 1])[:, None]).long()
    assert common_prefix_length(ids, mask) == 2  # 5, 6
    assert common_prefix_length(ids[:1], mask[:1]) == 0  # one prompt: nothing to share
    same = torch.tensor([[5, 6, 7], [5, 6, 7]])
    assert common_prefix_length(same, torch.ones_like(same)) == 2  # each keeps its last token


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefix_prefill_samples_what_separate_prefills_do(model, tokenizer, temperature):
    """Prefilling the system message once for the batch changes nothing a caller sees: same tokens, same
    recorded log-probs (to float error) as running every left-padded prompt whole."""
    ids, mask = encode_prompts(tokenizer, SHARED_PROMPTS)
    from rlvr.rollout.engine import common_prefix_length

    assert common_prefix_length(ids, mask) >= 16 and (mask.sum(-1) < ids.shape[1]).any()  # shared, and padded
    params = SamplingParams(temperature=temperature, max_new_tokens=10)
    runs = [generate_groups(model.model, model.lm_head, ids, mask, 3, params, [2], tokenizer.pad_token_id,
                            torch.Generator().manual_seed(5), share_prefix=k) for k in (0, 16)]
    assert torch.equal(runs[0].ids, runs[1].ids) and torch.equal(runs[0].mask, runs[1].mask)
    assert torch.allclose(runs[0].behaviour_logp, runs[1].behaviour_logp, atol=1e-5)
