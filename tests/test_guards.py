"""Numerical guards: a non-finite update is skipped and counted; K in a row stop the run with a clear error."""

import copy
import math

import pytest
import torch

from rlvr.cli import main
from rlvr.config.loading import load_config
from rlvr.core import LossSettings, group_advantages
from rlvr.launch import NonFiniteError, train
from rlvr.learn.learner import Learner
from rlvr.learn.step import StepOptions, train_step
from tests.conftest import make_model
from tests.test_e2e import _overrides
from tests.test_step import _batch


def test_non_finite_update_is_skipped_and_weights_unchanged(tokenizer):
    model = make_model(len(tokenizer))
    batch = _batch(model, tokenizer)
    batch.adv[0] = float("nan")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    metrics = train_step(Learner(model, optimizer, None), batch, LossSettings(),
                         StepOptions(num_iterations=2, micro_batch_size=4, max_completion_tokens=8, max_grad_norm=1.0))
    assert metrics["skipped_updates"] == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state  # Adam moments untouched too
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("G", [1, 2, 3, 8, 16])
def test_advantages_finite_and_bounded_on_edge_cases(G):
    torch.manual_seed(G)
    cases = [torch.zeros(G), torch.full((G,), 7.5), torch.randn(G) * 1e6, torch.randn(G) * 1e-9]
    outlier = torch.zeros(G)
    outlier[0] = 1e9
    half_missing = torch.randn(G)
    half_missing[::2] = float("nan")
    cases += [outlier, half_missing, torch.full((G,), float("nan"))]
    for rewards in cases:
        for scale in ("group", "batch"):
            adv = group_advantages(rewards, G, scale=scale)
            assert torch.isfinite(adv).all()
            if scale == "group":
                assert adv.abs().max() <= math.sqrt(G)


@pytest.fixture
def nan_model_dir(tmp_path, tokenizer):
    model = make_model(len(tokenizer))
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(tmp_path / "nan-model")
    tokenizer.save_pretrained(tmp_path / "nan-model")
    return tmp_path / "nan-model"


def test_consecutive_non_finite_steps_stop_the_run(nan_model_dir, tmp_path, capsys):
    args = _overrides(nan_model_dir, tmp_path / "run", lora=False) + ["train.max_consecutive_skips=2", "eval.every=0"]
    with pytest.raises(NonFiniteError, match="2 consecutive steps had a non-finite loss or gradient norm"):
        train(load_config(None, args))
    assert main(["train", "examples/demo.yaml", *args]) == 2
    assert "Lower train.lr, check the reward functions, or raise train.max_consecutive_skips" in capsys.readouterr().err
