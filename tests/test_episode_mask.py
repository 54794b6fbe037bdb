"""The seam episodes build on: tokens the model did not sample (tool results, observations) stay in the completion,
attended to by the tokens after them, but are never trained on (Groups.sampled_mask -> StepBatch.loss_mask)."""

import copy

import pytest
import torch

from rlvr.core import LossSettings
from rlvr.learn.batch import StepBatch
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from rlvr.rollout import Groups, SamplingParams
from tests.conftest import make_model, sample_tiny

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]
OBSERVED = slice(2, 4)  # completion columns 2 and 3 of every row: an observation between two model turns


def _episodes(model, tokenizer) -> Groups:
    groups = sample_tiny(model, tokenizer, PROMPTS, 4, SamplingParams(max_new_tokens=8), 3)  # no EOS: 8 tokens each
    assert bool(groups.completion_mask.all())
    sampled = groups.completion_mask.clone()
    sampled[:, OBSERVED] = 0
    groups.sampled_mask = sampled
    groups.__post_init__()
    return groups


def _step(model, groups: Groups) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    batch = StepBatch.from_groups(groups, torch.linspace(-1.0, 1.0, 8, dtype=torch.float64))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(Learner(model, opt), batch, LossSettings(aggregation="token_mean"),
               StepOptions(micro_batch_size=8, max_completion_tokens=8, max_grad_norm=0.0, share_prompt=False))
    return [p.detach().clone() for p in model.parameters()]


def test_loss_mask_is_the_sampled_tokens_of_included_rows():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    sampled = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 1]])
    groups = Groups(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                    completion_ids=torch.ones(2, 4, dtype=torch.long), completion_mask=mask,
                    behaviour_logp=torch.zeros(2, 4), truncated=torch.zeros(2, dtype=torch.bool), texts=["a", "b"],
                    group_size=2, version=torch.zeros(2, dtype=torch.long), temperature=torch.ones(2),
                    sampled_mask=sampled)
    batch = StepBatch.from_groups(groups, torch.ones(2), include=torch.tensor([True, False]))
    assert batch.completion_mask.tolist() == mask.tolist()
    assert batch.loss_mask.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0]]
    assert Groups.concat([groups, groups.select([0])]).sampled_mask.tolist() == sampled.tolist() * 2
    plain = Groups(**{**groups.__dict__, "sampled_mask": None})  # single-turn: every attended token was sampled
    assert torch.equal(plain.sampled_mask, mask)
    both = Groups.concat([plain, groups])
    assert both.sampled_mask.tolist() == mask.tolist() + sampled.tolist()
    with pytest.raises(ValueError, match="sampled_mask marks tokens that completion_mask leaves out"):
        Groups(**{**groups.__dict__, "sampled_mask": torch.ones(2, 4, dtype=torch.long)})


def test_observation_tokens_are_attended_but_not_trained(tokenizer):
    model = make_model(len(tokenizer))
    groups = _episodes(model, tokenizer)
    trained = _step(model, groups)
    assert any(not torch.equal(a, b) for a, b in zip(trained, model.parameters()))  # the model turns train

    # what was recorded for an observation token plays no part: it is not a sampled token
    garbled = copy.copy(groups)
    garbled.behaviour_logp = groups.behaviour_logp.clone()
    garbled.behaviour_logp[:, OBSERVED] = -30.0
    assert all(torch.equal(a, b) for a, b in zip(trained, _step(model, garbled)))

    # but the observation's tokens are read by the model turn after it
    other = copy.copy(groups)
    other.completion_ids = groups.completion_ids.clone()
    other.completion_ids[:, OBSERVED] = (groups.completion_ids[:, OBSERVED] + 1) % len(tokenizer)
    assert any(not torch.equal(a, b) for a, b in zip(trained, _step(model, other)))
