"""Off-policy corrections: importance weights, truncation, masking and the decoupled objective against values
derived by hand, and a batch sampled by a deliberately different policy trained with the right gradient."""

import copy
import math

import pytest
import torch

from rlvr.config.loading import ConfigError, load_config
from rlvr.core import LossSettings, TokenBatch, gap_mask, importance_weight, sequence_log_ratio, stat_sums, token_loss
from rlvr.learn.batch import StepBatch
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.rollout import SamplingParams
from tests.conftest import make_model, sample_tiny
from tests.reference import naive_logprobs

log = math.log


def _objective(logp, behaviour, adv, mask=None, **knobs):
    """token_loss on probability lists (one completion, or [N, T] with ``mask``); returns (loss, d loss / d logp,
    stats)."""
    lp = torch.log(torch.tensor(logp, dtype=torch.float64)).requires_grad_()
    mask = torch.ones_like(lp) if mask is None else torch.tensor(mask, dtype=torch.float64)
    x = TokenBatch(logp=lp, behaviour_logp=torch.log(torch.tensor(behaviour, dtype=torch.float64)),
                   adv=torch.tensor(adv, dtype=torch.float64), mask=mask,
                   proximal_logp=knobs.pop("proximal_logp", None))
    loss, stats = token_loss(x, LossSettings(**knobs))
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)
    return loss.detach() * mask, grad, stats


def test_token_truncated_is_by_hand():
    # mu = 1: pi_prox = pi_theta, so r = 1 (never clipped) and the loss is -w * A with w = min(pi/pi_behav, C)
    loss, grad, stats = _objective([0.5, 0.3, 0.4], [0.25, 0.6, 0.4], [1.0, 1.0, -2.0], is_level="token", is_cap=1.5)
    # rho = 0.5/0.25 = 2 -> truncated to 1.5; 0.3/0.6 = 0.5; 0.4/0.4 = 1
    assert torch.allclose(loss, torch.tensor([-1.5, -0.5, 2.0], dtype=torch.float64))
    # d(-w A r)/d logp = -w A r with r = 1
    assert torch.allclose(grad, torch.tensor([-1.5, -0.5, 2.0], dtype=torch.float64))
    assert stats["is_capped_frac"].tolist() == [True, False, False]
    assert torch.allclose(stats["is_weight_mean"], torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64))
    assert torch.allclose(stats["logp_gap"], torch.tensor([log(2), log(2), 0.0], dtype=torch.float64))
    sums = stat_sums(stats, torch.ones(3))
    assert sums["is_weight_max"] == pytest.approx(2.0) and sums["is_capped_frac"] == 1 and sums["tokens"] == 3


def test_masked_is_zeroes_weights_above_the_cap():
    loss, grad, stats = _objective([0.5, 0.3], [0.25, 0.6], [1.0, 1.0], is_level="token", is_mode="mask", is_cap=1.5)
    # rho = 2 > 1.5 -> weight 0 (AReaL's cap); rho = 0.5 kept as it is
    assert torch.allclose(loss, torch.tensor([0.0, -0.5], dtype=torch.float64))
    assert torch.allclose(grad, torch.tensor([0.0, -0.5], dtype=torch.float64))
    assert stats["is_capped_frac"].tolist() == [True, False]


def test_no_weight_means_plain_policy_gradient():
    loss, grad, stats = _objective([0.5, 0.3], [0.25, 0.6], [1.0, -1.0], is_level="none")
    assert torch.allclose(loss, torch.tensor([-1.0, 1.0], dtype=torch.float64))
    assert torch.allclose(grad, torch.tensor([-1.0, 1.0], dtype=torch.float64))
    assert not stats["is_capped_frac"].any()
    assert torch.allclose(stats["is_weight_mean"], torch.tensor([2.0, 0.5], dtype=torch.float64))  # still reported


def test_sequence_level_weight_by_hand():
    # two completions: tokens with rho 2 and 0.75 (product 1.5), and a single token with rho 3 (capped at 2)
    proximal = torch.log(torch.tensor([[0.4, 0.3], [0.6, 0.0]], dtype=torch.float64).clamp(min=1e-9))
    behaviour = torch.log(torch.tensor([[0.2, 0.4], [0.2, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1], [1, 0]])
    seq = sequence_log_ratio(proximal, behaviour, mask)
    assert torch.allclose(seq.exp(), torch.tensor([1.5, 3.0], dtype=torch.float64))
    w, capped = importance_weight(seq, "truncate", 2.0)
    assert torch.allclose(w, torch.tensor([1.5, 2.0], dtype=torch.float64)) and capped.tolist() == [False, True]
    # in the objective every token of a completion carries its completion's weight
    loss, _grad, _ = _objective([[0.4, 0.3], [0.6, 1.0]], [[0.2, 0.4], [0.2, 1.0]], [[1.0], [1.0]], [[1, 1], [1, 0]],
                                is_level="sequence", is_cap=2.0)
    assert torch.allclose(loss, torch.tensor([[-1.5, -1.5], [-2.0, 0.0]], dtype=torch.float64))


def test_ratio_to_behaviour_clips_against_the_sampler():
    # r = pi_theta / pi_behav = 2; A = 1: clipped at 1.2 (no gradient); A = -1: max(2, 1.2) = 2 (gradient -A r = 2)
    loss, grad, stats = _objective([0.5, 0.5], [0.25, 0.25], [1.0, -1.0], ratio_to="behaviour", is_level="none")
    assert torch.allclose(loss, torch.tensor([-1.2, 2.0], dtype=torch.float64))
    assert torch.allclose(grad, torch.tensor([0.0, 2.0], dtype=torch.float64))
    assert stats["clip_high"].tolist() == [True, False]


def test_decoupled_objective_by_hand():
    # AReaL: -w * min(r A, clip(r) A) with r = pi_theta / pi_prox = 0.5 / 0.4 = 1.25, w = pi_prox / pi_behav = 2
    prox = torch.log(torch.tensor([0.4, 0.4], dtype=torch.float64))
    loss, grad, stats = _objective([0.5, 0.5], [0.2, 0.2], [1.0, -1.0], is_level="token", is_cap=3.0,
                                   proximal_logp=prox)
    # A = 1: r clipped to 1.2 -> -2 * 1.2 = -2.4, no gradient; A = -1: max(1.25, 1.2) = 1.25 -> 2 * 1.25 = 2.5,
    # gradient w * (-A) * r = 2.5
    assert torch.allclose(loss, torch.tensor([-2.4, 2.5], dtype=torch.float64))
    assert torch.allclose(grad, torch.tensor([0.0, 2.5], dtype=torch.float64))
    assert stats["clip_high"].tolist() == [True, False]
    assert torch.allclose(stats["is_weight_mean"], torch.tensor([2.0, 2.0], dtype=torch.float64))


def test_gap_mask_drops_tokens_pushed_further_away():
    logp = torch.log(torch.tensor([0.6, 0.6, 0.2, 0.2, 0.45]))
    behaviour = torch.log(torch.tensor([0.3, 0.3, 0.5, 0.5, 0.3]))
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    keep = gap_mask(logp, behaviour, adv, delta=0.2)
    # +0.3 with A > 0: masked; +0.3 with A < 0 (moving back): kept; -0.3 with A < 0: masked; -0.3 with A > 0:
    # kept; +0.15 with A > 0: inside the region, kept
    assert keep.tolist() == [False, True, False, True, True]
    assert gap_mask(logp, behaviour, adv, delta=0.0).all()
    loss, grad, stats = _objective([0.6, 0.6], [0.3, 0.3], [1.0, -1.0], is_level="none", gap_mask=0.2)
    assert torch.allclose(loss, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert torch.allclose(grad, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert stats["gap_masked_frac"].tolist() == [True, False]


def test_invalid_knob_combinations_are_errors():
    with pytest.raises(ValueError, match="correct twice"):
        LossSettings(ratio_to="behaviour", is_level="token")
    with pytest.raises(ValueError, match="is_mode must be one of"):
        LossSettings(is_mode="clip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="algo.is_level must be one of none, token, sequence"):
        load_config(None, ["algo.is_level=tokens"])
    with pytest.raises(ConfigError, match="correct twice"):
        load_config(None, ["algo.ratio_to=behaviour", "algo.is_level=token"])
    assert load_config(None, ["algo.ratio_to=behaviour"]).algo.is_level == "none"  # the ratio is the correction
    assert load_config(None).algo.loss_settings() == LossSettings(beta=0.04)  # the default correction: token TIS, C = 2


# A batch sampled by one policy and trained by another (the learner has moved on: weights perturbed).

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}], "What is 7?"]


@pytest.fixture(scope="module")
def stale_batch(tokenizer):
    """(behaviour model, trainer model, batch sampled by the behaviour model), all fp64."""
    behaviour = make_model(len(tokenizer), seed=0)
    groups = sample_tiny(behaviour, tokenizer, PROMPTS, 4, SamplingParams(temperature=0.9, max_new_tokens=8),
                         seed=5, eos_every=7, version=3)
    adv = torch.randn(groups.completion_ids.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    batch = StepBatch.from_groups(groups, adv)
    trainer = copy.deepcopy(behaviour).double()
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.15)
    return behaviour.double(), trainer, batch


def _expected_update(trainer, batch, per_token_loss, lr):
    """SGD update of the sequence-mean aggregate of ``per_token_loss(logp, behaviour_logp, adv)``, written out."""
    model = copy.deepcopy(trainer)
    logp = naive_logprobs(model, batch)  # [N, T]
    mask = batch.loss_mask.double()
    per_token = per_token_loss(logp, batch.behaviour_logp.double(), batch.adv[:, None])
    loss = ((per_token * mask).sum(-1) / mask.sum(-1)).sum() / (mask.sum(-1) > 0).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return model


def _train(trainer, batch, settings, lr):
    model = copy.deepcopy(trainer)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    metrics = train_step(Learner(model, opt), batch, settings,
                         StepOptions(micro_batch_size=5, max_completion_tokens=8, max_grad_norm=0.0))
    return model, metrics


def _assert_same_weights(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6 * float(q.detach().abs().max())), name


def test_stale_batch_is_importance_weighted(stale_batch):
    """Default correction (token TIS, C = 2): the gradient is min(pi_theta / pi_behav, 2) * (-A) * grad logp."""
    behaviour, trainer, batch = stale_batch
    with torch.no_grad():
        gap = (naive_logprobs(trainer, batch) - naive_logprobs(behaviour, batch))[batch.loss_mask.bool()]
    assert gap.abs().mean() > 0.05  # the two policies really differ
    model, metrics = _train(trainer, batch, LossSettings(), lr=0.3)

    def tis(logp, behav, adv):
        w = torch.exp(logp.detach() - behav).clamp(max=2.0)
        return -w * adv * torch.exp(logp - logp.detach())  # ratio to pi_prox = pi_theta: value 1, gradient grad logp

    _assert_same_weights(model, _expected_update(trainer, batch, tis, lr=0.3))
    assert metrics["is_weight_mean"] != pytest.approx(1.0, abs=0.02)
    assert metrics["is_weight_max"] > 2.0 and metrics["is_capped_frac"] > 0
    assert metrics["logp_gap"] == pytest.approx(float(gap.abs().mean()), rel=1e-4)


def test_stale_batch_ratio_to_behaviour_clips(stale_batch):
    """ratio_to=behaviour: PPO's clip engages against the sampler's log-probs even on the first pass."""
    _, trainer, batch = stale_batch
    settings = LossSettings(ratio_to="behaviour", is_level="none")
    model, metrics = _train(trainer, batch, settings, lr=0.3)

    def clipped(logp, behav, adv):
        r = torch.exp(logp - behav)
        return torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))

    _assert_same_weights(model, _expected_update(trainer, batch, clipped, lr=0.3))
    assert metrics["clip_low"] + metrics["clip_high"] > 0.05


def test_stale_batch_sequence_weights_and_gap_mask(stale_batch):
    _, trainer, batch = stale_batch
    settings = LossSettings(is_level="sequence", is_cap=1.5, gap_mask=0.0015)  # tiny vocab-318 probabilities
    model, metrics = _train(trainer, batch, settings, lr=0.3)
    mask = batch.loss_mask.double()

    def weighted_and_masked(logp, behav, adv):
        w = torch.exp(((logp.detach() - behav) * mask).sum(-1, keepdim=True)).clamp(max=1.5)
        gap = logp.detach().exp() - behav.exp()
        keep = ~(((adv > 0) & (gap > 0.0015)) | ((adv < 0) & (gap < -0.0015)))
        return keep * -w * adv * torch.exp(logp - logp.detach())

    _assert_same_weights(model, _expected_update(trainer, batch, weighted_and_masked, lr=0.3))
    assert 0 < metrics["gap_masked_frac"] < 1


def test_on_policy_batch_has_unit_weights(tokenizer):
    """Sampled and trained by the same weights: weights 1 up to numerics, nothing capped or masked."""
    model = make_model(len(tokenizer))
    groups = sample_tiny(model, tokenizer, PROMPTS, 4, SamplingParams(max_new_tokens=8), seed=2, eos_every=7)
    batch = StepBatch.from_groups(groups, torch.randn(groups.completion_ids.shape[0]))
    _, metrics = _train(model, batch, LossSettings(gap_mask=0.01), lr=0.1)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["logp_gap"] < 1e-4
    assert metrics["is_capped_frac"] == 0 and metrics["gap_masked_frac"] == 0


def test_temperatures_travel_with_the_batch(stale_batch):
    _, _, batch = stale_batch
    m = batch.completion_mask.bool()
    assert batch.temperature[m] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="loss_mask marks tokens that completion_mask leaves out"):
        StepBatch(**{**batch.__dict__, "loss_mask": torch.ones_like(batch.loss_mask)})
