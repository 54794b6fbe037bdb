"""Weights sharded across learners (FSDP2, train.shard_weights): `torchrun --nproc-per-node 2` (gloo, 2 CPU processes,
the tiny model) trains what one process trains - every weight within 1e-6 after 3 steps, with two optimizer steps per
batch, clipping that bites, micro-batch accumulation and activation checkpointing; the metrics rows equal; its
checkpoints hold whole tensors, so the job resumes exactly with two learners or with one process."""

import shutil

import pytest
import torch

from rlvr.config.loading import load_config
from rlvr.learn.sharding import clip_sharded_gradients
from rlvr.platform.distributed import World
from rlvr.run.learners import check_learners, sharded_weights
from tests.test_distributed import FULL, SINGLE, TORCHRUN, Job, _overrides, _records, _run, _same_rows, _weights, shared

__all__ = ["shared"]  # the session's shared runs (tests/test_distributed.py): the one-process references

# mu = 2 (a frozen proximal pass, then two steps on the batch) and a gradient norm (~0.75) above the clip; the same
# run as test_two_ranks_train_what_one_process_trains[full], whose one-process reference this file shares
SHARDED = FULL


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.allclose(tensor, b[name], atol=1e-6, rtol=0), name


def _resume_from_step_2(done, out) -> None:
    """A copy of the finished run ``done`` as it was after step 2 (its last checkpoint and outputs removed)."""
    shutil.copytree(done, out)
    shutil.rmtree(out / "checkpoints" / "step-00000003")
    for name in ("model", "adapter", "summary.json"):
        shutil.rmtree(out / name, ignore_errors=True) if (out / name).is_dir() else (out / name).unlink(missing_ok=True)


@pytest.mark.long
def test_sharded_full_fine_tuning_trains_and_resumes_as_one_process(tiny_model_dir, tmp_path, shared):
    two = tmp_path / "two"
    config = ["examples/demo.yaml"]
    reference = shared(SINGLE, tiny_model_dir, False, *SHARDED)  # one process ignores the sharding: shared
    job = _run([*TORCHRUN, "-m", "rlvr", "train", *config, *_overrides(tiny_model_dir, two, False), *SHARDED])
    single, one = reference.result(), reference.out
    assert single.returncode == 0, single.stderr[-3000:]
    assert job.returncode == 0, job.stderr[-3000:]
    _close(_weights(one, False), _weights(two, False))
    _same_rows(_records(one), _records(two))
    _same_rows(_records(one, "samples.jsonl"), _records(two, "samples.jsonl"))
    assert any(r["update/grad_norm"] > 0.3 for r in _records(two)[1:])  # the clip bit
    resumptions = {}  # two learners and one process at once (each on its own copy): one core each
    try:
        for name, launcher in (("alone", SINGLE), ("again", TORCHRUN)):
            _resume_from_step_2(two, tmp_path / name)
            resumptions[name] = Job([*launcher, "-m", "rlvr", "train", *config,
                                     *_overrides(tiny_model_dir, tmp_path / name, False), *SHARDED, "resume=auto"])
    finally:
        resumed = {name: job.result() for name, job in resumptions.items()}
    for name in ("again", "alone"):  # two learners, then one process
        out = tmp_path / name
        assert resumed[name].returncode == 0 and "(step 2)" in resumed[name].stdout, resumed[name].stderr[-3000:]
        _close(_weights(two, False), _weights(out, False))
        _same_rows(_records(two), _records(out))


@pytest.mark.long
def test_a_sharded_frozen_base_under_lora_trains_what_one_process_trains(tiny_model_dir, tmp_path, shared):
    two = tmp_path / "two"
    args = ["examples/demo.yaml", "train.shard_weights=true"]
    # one process ignores train.shard_weights: the reference is the session's one-process LoRA run
    reference = shared(SINGLE, tiny_model_dir, True)
    job = _run([*TORCHRUN, "-m", "rlvr", "train", *args, *_overrides(tiny_model_dir, two, True)])
    single, one = reference.result(), reference.out
    assert single.returncode == 0, single.stderr[-3000:]
    assert job.returncode == 0, job.stderr[-3000:]
    _close(_weights(one, True), _weights(two, True))
    _same_rows(_records(one), _records(two))


def test_what_shards_and_what_is_refused():
    two = World(0, 2)
    full = load_config("examples/demo.yaml", ["model.lora=false"])
    lora = load_config("examples/demo.yaml", [])
    assert sharded_weights(full, two) and not sharded_weights(lora, two) and not sharded_weights(full, World())
    assert sharded_weights(load_config("examples/demo.yaml", ["train.shard_weights=true"]), two)
    assert not sharded_weights(load_config("examples/demo.yaml", ["model.lora=false", "train.shard_weights=false"]),
                               two)
    with pytest.raises(ValueError, match="PPO's critic is not sharded; set train.shard_weights=false"):
        check_learners(load_config("examples/ppo.yaml", ["model.lora=false", "train.prompts_per_step=2"]), two)
    with pytest.raises(ValueError, match="shard_weights must be auto, true or false"):
        load_config("examples/demo.yaml", ["train.shard_weights=2"])


def test_clipping_whole_gradients_matches_torch():
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    by_hand = sum(float(p.grad.double().pow(2).sum()) for p in ours) ** 0.5  # the norm over every element
    norm = clip_sharded_gradients(ours, 0.5)
    assert norm == pytest.approx(by_hand, rel=1e-9) and norm > 0.5
    assert norm == pytest.approx(float(torch.nn.utils.clip_grad_norm_(theirs, 0.5)), rel=1e-6)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a.grad, b.grad, atol=1e-7)
    assert float(torch.cat([p.grad.reshape(-1) for p in ours]).norm()) == pytest.approx(0.5, rel=1e-5)
