"""DiLoCo: learners that share only a bucket. The outer step by hand; the bucket refusing what a learner of the run
does not write; real `rlvr train` learners (tiny model, LoRA) on a loopback directory: every round's shared weights
are exactly the documented update of the deltas the round decided, learners end on the same weights; a slow
learner's delta is dropped and it catches up, a learner joins mid-run, a hostile delta is refused or bounded."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr.config.diloco import parse_learner
from rlvr.config.loading import load_config
from rlvr.core.outer import bound_norm, nesterov_step, outer_gradient
from rlvr.store.rounds import Decision, RefusedDelta, RoundBucket
from tests.test_resume import (
    _tail,
    fork_server,  # noqa: F401 (an autouse module fixture: the fork server starts early)
    join_forked,
    start_forked_train,
    train_killed,
)

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- the outer step
def test_the_outer_step_by_hand():
    theta = {"w": torch.tensor([1.0, 2.0])}
    deltas = [{"w": torch.tensor([0.2, -0.4])}, {"w": torch.tensor([0.0, 0.2])}]
    g = outer_gradient(deltas)  # -(mean delta) = -[0.1, -0.1]
    assert torch.allclose(g["w"], torch.tensor([-0.1, 0.1]))
    theta1, m1 = nesterov_step(theta, g, None, lr=0.7, mu=0.9)  # m = g; step = g + 0.9 g = 1.9 g
    assert torch.allclose(m1["w"], torch.tensor([-0.1, 0.1]))
    assert torch.allclose(theta1["w"], torch.tensor([1.133, 1.867]))
    theta2, m2 = nesterov_step(theta1, g, m1, lr=0.7, mu=0.9)  # m = 0.9 m + g = 1.9 g; step = g + 0.9 m = 2.71 g
    assert torch.allclose(m2["w"], torch.tensor([-0.19, 0.19]))
    assert torch.allclose(theta2["w"], torch.tensor([1.133 + 0.1897, 1.867 - 0.1897]))
    p = torch.nn.Parameter(theta["w"].clone())  # torch's SGD with Nesterov momentum: the same two steps
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(2):
        p.grad = g["w"].clone()
        sgd.step()
    assert torch.allclose(p.detach(), theta2["w"])
    avg, _ = nesterov_step(theta, g, None, lr=1.0, mu=0.0)  # lr 1, no momentum: the average of the learners
    assert torch.allclose(avg["w"], torch.tensor([1.1, 1.9]))


def test_a_delta_is_bounded_in_norm():
    delta = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}  # norm 5
    scaled, was = bound_norm(delta, 1.0)
    assert was and torch.allclose(scaled["a"], torch.tensor([0.6])) and torch.allclose(scaled["b"], torch.tensor([0.8]))
    assert bound_norm(delta, 0.0) == (delta, False) and bound_norm(delta, 5.0)[1] is False


def test_learner_spec_and_what_is_refused():
    assert parse_learner("1/3") == (1, 3)
    for bad in ("3/3", "1", "-1/2", "a/b"):
        with pytest.raises(ValueError, match="k/K"):
            parse_learner(bad)
    with pytest.raises(ValueError, match="diloco.learner needs diloco.bucket"):
        load_config("examples/diloco.yaml", ["diloco.learner=0/2", "diloco.bucket="])
    with pytest.raises(ValueError, match="places diloco.learners"):
        load_config("examples/diloco.yaml", ["diloco.placement=ray"])
    with pytest.raises(ValueError, match="synchronous GRPO loop"):
        load_config("examples/ppo.yaml", ["diloco.learner=0/2", "diloco.bucket=/tmp/b"])


# ------------------------------------------------------------------------------------------------ the bucket
LIKE = {"layer.lora_A.weight": torch.zeros(2, 3), "layer.lora_B.weight": torch.zeros(3, 2)}


def _delta(value: float = 0.1) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in LIKE.items()}


def test_a_delta_round_trips_and_hostile_ones_are_refused(tmp_path):
    b = RoundBucket(str(tmp_path), 0, 3)
    b.publish_delta(1, _delta(), {"steps": 2})
    tensors, digest = b.read_delta(1, 0, LIKE, torch.float32)
    assert all(torch.equal(tensors[k], _delta()[k]) for k in LIKE) and len(digest) == 64
    assert b.arrived(1) == [0] and b.arrived(2) == []
    hostile = {
        1: {**_delta(), "extra": torch.zeros(1)},  # a name the model does not have
        2: {**_delta(), "layer.lora_A.weight": torch.zeros(3, 3)},  # another shape
    }
    for k, tensors in hostile.items():
        RoundBucket(str(tmp_path), k, 3).publish_delta(1, tensors, {})
    with pytest.raises(RefusedDelta, match="other tensor names"):
        b.read_delta(1, 1, LIKE, torch.float32)
    with pytest.raises(RefusedDelta, match=r"\(3, 3\), not torch.float32 \(2, 3\)"):
        b.read_delta(1, 2, LIKE, torch.float32)
    nan = {**_delta(), "layer.lora_B.weight": torch.full((3, 2), float("nan"))}
    RoundBucket(str(tmp_path), 1, 3).publish_delta(2, nan, {})
    with pytest.raises(RefusedDelta, match="not finite"):
        b.read_delta(2, 1, LIKE, torch.float32)
    RoundBucket(str(tmp_path), 2, 3).publish_delta(2, {k: v.bfloat16() for k, v in _delta().items()}, {})
    with pytest.raises(RefusedDelta, match="bfloat16"):
        b.read_delta(2, 2, LIKE, torch.float32)
    with pytest.raises(RefusedDelta, match="changed after the round's decision"):
        b.read_delta(1, 0, LIKE, torch.float32, digest="0" * 64)
    big = tmp_path / "learner-0001" / "v00000003"  # a manifest that declares a payload larger than a delta can be
    RoundBucket(str(tmp_path), 1, 3).publish_delta(3, _delta(), {})
    manifest = json.loads((big / "manifest.json").read_text())
    manifest["files"]["adapter_model.safetensors"]["bytes"] = 1 << 30
    (big / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RefusedDelta, match="more than the"):
        b.read_delta(3, 1, LIKE, torch.float32)


def test_a_round_is_decided_once_and_a_forged_decision_is_refused(tmp_path):
    b = RoundBucket(str(tmp_path), 0, 2)
    assert b.decision(1) is None
    first = Decision(1, (0, 1), {0: "a" * 64, 1: "b" * 64}, closed_by=0, reason="all")
    assert b.decide(first) and not b.decide(Decision(1, (0,), {0: "a" * 64}, closed_by=1, reason="timeout"))
    assert b.decision(1) == first
    assert b.claim_start() and not RoundBucket(str(tmp_path), 1, 2).claim_start()  # one learner publishes the start
    (tmp_path / "rounds" / "00000002.json").write_text(json.dumps(
        {"round": 2, "members": [0, 7], "digests": {"0": "a" * 64, "7": "b" * 64}, "closed_by": 0, "reason": "all"}))
    with pytest.raises(RefusedDelta, match="not what rlvr writes"):
        b.decision(2)  # learner 7 of 2


# ------------------------------------------------------------------------------------------- real learners
def _overrides(out: Path, bucket: Path, learner: str, *extra: str) -> list[str]:
    return [f"output_dir={out}", "model.lora=true", "model.lora_r=4", "task.eval_size=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "train.prompts_per_step=2", "train.micro_batch_size=8", "train.steps=4",
            "train.checkpoint_every=2",
            "train.threads=1", "algo.beta=0", "train.lr=1e-3", "eval.every=0", "log.progress=false",
            "log.trackers=[]", "log.plot=false", "rewards=[{name: 'tests.helpers:length_reward'}]",
            f"diloco.learner={learner}", f"diloco.bucket={bucket}", "diloco.inner_steps=2", *extra]


def _train_here(model_dir: Path, out: Path, bucket: Path, learner: str, *extra: str) -> dict:
    """A learner (`rlvr train examples/demo.yaml` with these settings) run in this process (no interpreter start-up);
    torch's thread count restored after (train.threads=1 sets it). Learners that are processes of their own:
    tests/test_resume.py, start_forked_train."""
    from rlvr.launch import train

    threads = torch.get_num_threads()
    try:
        return train(load_config(ROOT / "examples" / "demo.yaml",
                                 _overrides(out, bucket, learner, f"model.name={model_dir}", *extra)))
    finally:
        torch.set_num_threads(threads)


def _outer(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {k.removeprefix("update/outer_"): v for k, v in rows[-1].items() if k.startswith("update/outer_")}


def _replay(bucket: Path, learners: int, bound: float = 0.0) -> list:
    """Check every round the bucket holds: its shared weights (and momentum) are the documented outer step
    (lr 0.7, Nesterov 0.9) from the previous round's, on the decided deltas in learner order. Returns the decisions."""
    b = RoundBucket(str(bucket), 0, learners)
    theta = load_file(str(bucket / "global" / "v00000000" / "adapter_model.safetensors"))
    momentum, decisions = None, []
    for path in sorted((bucket / "rounds").glob("*.json")):
        decision = b.decision(int(path.stem))
        decisions.append(decision)
        deltas = [bound_norm(load_file(str(bucket / f"learner-{k:04d}" / f"v{decision.round:08d}" /
                                           "adapter_model.safetensors")), bound)[0] for k in decision.members]
        if deltas:
            theta, momentum = nesterov_step(theta, outer_gradient(deltas), momentum, 0.7, 0.9)
        shared = load_file(str(bucket / "global" / f"v{decision.round:08d}" / "adapter_model.safetensors"))
        assert shared.keys() == theta.keys() and all(torch.equal(shared[k], theta[k]) for k in theta), decision
        if momentum is not None:
            held = load_file(str(bucket / "momentum" / f"v{decision.round:08d}" / "adapter_model.safetensors"))
            assert all(torch.equal(held[k], momentum[k]) for k in momentum)
    return decisions


def _adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_two_learners_take_the_documented_outer_steps_and_end_equal(tiny_model_dir, tmp_path):
    """Learner 1 is a forked `rlvr train` process (tests/test_resume.py: start_forked_train), learner 0 runs in this
    process meanwhile: no interpreter start-up."""
    bucket, log = tmp_path / "bucket", tmp_path / "l1.log"
    other = start_forked_train(_overrides(tmp_path / "l1", bucket, "1/2", f"model.name={tiny_model_dir}"), "", log)
    try:
        _train_here(tiny_model_dir, tmp_path / "l0", bucket, "0/2")
    except BaseException:
        other.kill()  # it would wait for learner 0's deltas (diloco.round_timeout_s)
        other.join()
        raise
    assert join_forked(other) == 0, _tail(log)
    decisions = _replay(bucket, 2)
    assert [(d.round, d.members, d.reason) for d in decisions] == [(1, (0, 1), "all"), (2, (0, 1), "all")]
    a, b = _adapter(tmp_path / "l0"), _adapter(tmp_path / "l1")
    assert all(torch.equal(a[k], b[k]) for k in a)  # both hold round 2's shared weights
    for k in range(2):
        outer = _outer(tmp_path / f"l{k}")
        assert outer["rounds"] == 2 and outer["late"] == 0 and outer["refused"] == 0 and outer["learners"] == 2
    assert "learner: 0/2" in (tmp_path / "l0" / "config.yaml").read_text()


def test_a_slow_learner_is_dropped_and_catches_up_and_a_late_one_joins(tiny_model_dir, tmp_path):
    """Learners 0 and 1 of 3 both start round 1; learner 1 publishes its delta 10 s late, so learner 0 closes the
    round alone at the timeout, and round 2 too; learner 1's delta is dropped (counted) and it goes on from the newest
    shared weights. Learner 2 starts after both ended: refused until told diloco.join=true, it joins from the weights
the decided rounds give.
    Learner 1 is a forked process (tests/test_resume.py: start_forked_train); learners 0 and 2 run in this process,
    so learner 0 closes round 1 within its model load, two steps and the 2 s timeout of learner 1 joining, with no
    interpreter start-up in between (that start-up, up to 15 s on 2 busy cores, used to outlast a 15 s delay)."""
    bucket, timeout, log = tmp_path / "bucket", "diloco.round_timeout_s=2", tmp_path / "slow.log"
    slow = start_forked_train(_overrides(tmp_path / "slow", bucket, "1/3", f"model.name={tiny_model_dir}", timeout),
                              "diloco_delta@1:sleep10", log)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "slow" / "diloco.json").is_file():  # it has joined round 1
            assert slow.is_alive() and time.monotonic() < deadline, _tail(log)
            time.sleep(0.1)
        _train_here(tiny_model_dir, tmp_path / "fast", bucket, "0/3", timeout)
    finally:
        code = join_forked(slow)
    assert code == 0, _tail(log)
    assert _outer(tmp_path / "fast")["late"] == 0 and _outer(tmp_path / "slow")["late"] == 1
    joined_at = max(int(p.stem) for p in (bucket / "rounds").glob("*.json"))
    with pytest.raises(RefusedDelta, match=f"already holds a job at round {joined_at}.*diloco.join=true"):
        _train_here(tiny_model_dir, tmp_path / "late", bucket, "2/3", timeout)  # a fresh learner, not told to join
    _train_here(tiny_model_dir, tmp_path / "late", bucket, "2/3", timeout, "diloco.join=true")
    assert sorted(int(p.name[1:]) for p in (bucket / "learner-0002").glob("v*")) == [joined_at + 1, joined_at + 2]
    decisions = _replay(bucket, 3)  # every round, the joiner's included, is the documented step from the last
    assert [d.members for d in decisions[:2]] == [(0,), (0,)] and decisions[-1].members == (2,)
    # round 1 waited for all three, round 2 only for learner 0 (learner 1 missed round 1): closed when it arrived
    assert [d.reason for d in decisions[:2]] == ["timeout", "all"]


def test_a_hostile_delta_is_refused_and_an_outsized_one_bounded(tiny_model_dir, tmp_path):
    """Learner 0 runs; 'learners' 1 and 2 are files planted in the bucket for round 1: a delta holding NaN (refused,
    never applied) and a delta a thousand times too large (scaled to diloco.max_delta_norm). Learner 0 runs in this
    process; a thread plants the files once it has published round 0's shared weights."""
    bucket, planted, finished = tmp_path / "bucket", threading.Event(), threading.Event()

    def plant() -> None:
        deadline = time.monotonic() + 120
        while not (bucket / "global" / "v00000000" / "manifest.json").is_file():
            if finished.is_set() or time.monotonic() > deadline:
                return
            time.sleep(0.1)
        like = load_file(str(bucket / "global" / "v00000000" / "adapter_model.safetensors"))
        poisoned = {k: torch.full_like(v, float("nan")) for k, v in like.items()}
        huge = {k: torch.full_like(v, 1000.0) for k, v in like.items()}
        for k, tensors in ((1, poisoned), (2, huge)):
            RoundBucket(str(bucket), k, 3).publish_delta(1, tensors, {})
        planted.set()

    planter = threading.Thread(target=plant, daemon=True)
    planter.start()
    try:
        _train_here(tiny_model_dir, tmp_path / "l0", bucket, "0/3", "diloco.round_timeout_s=3", "train.steps=2",
                    "diloco.max_delta_norm=0.05")
    finally:
        finished.set()
        planter.join()
    assert planted.is_set()
    outer = _outer(tmp_path / "l0")
    assert outer["refused"] >= 1 and outer["bounded"] >= 1
    (decision,) = _replay(bucket, 3, bound=0.05)
    assert decision.members == (0, 2)


def test_a_learner_killed_inside_a_round_resumes_where_it_was(tiny_model_dir, tmp_path):
    """A lone learner (K = 1: every round closes at once) is SIGKILLed after step 3, inside round 2; resumed from its
    step-2 checkpoint, it keeps the checkpoint's weights, takes round 2 from the shared weights after round 1, and
    ends on the weights of a run that was never killed. The killed learner is a forked process (tests/test_resume.py:
    train_killed); the uninterrupted run and the resume run in this process (the resume reads only what the killed
    one left on disk)."""
    args = ["train.checkpoint_every=1"]
    _train_here(tiny_model_dir, tmp_path / "whole", tmp_path / "bucket-whole", "0/1", *args)
    out, bucket, log = tmp_path / "killed", tmp_path / "bucket-killed", tmp_path / "killed.log"
    code = train_killed(_overrides(out, bucket, "0/1", f"model.name={tiny_model_dir}", *args), "after_update@3", log)
    assert code == -9, _tail(log)
    assert json.loads((out / "diloco.json").read_text()) == {"round": 2, "round_start_step": 2}
    _train_here(tiny_model_dir, out, bucket, "0/1", *args, "resume=auto")
    a, b = _adapter(tmp_path / "whole"), _adapter(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [d.members for d in _replay(bucket, 1)] == [(0,), (0,)]


def test_a_second_run_of_a_config_does_not_join_the_first_job_and_other_settings_are_refused(tiny_model_dir,
                                                                                            tmp_path):
    """A new user runs the same DiLoCo config twice (its bucket is the same directory): the second fresh run stops
    with a line saying a job is under way, instead of silently starting from its weights and round numbers; a
    learner whose outer settings differ from the job's record (job.json) is refused too."""
    bucket = tmp_path / "bucket"
    _train_here(tiny_model_dir, tmp_path / "first", bucket, "0/1")
    assert json.loads((bucket / "job.json").read_text())["learners"] == 1
    with pytest.raises(RefusedDelta, match="already holds a job at round 2"):
        _train_here(tiny_model_dir, tmp_path / "second", bucket, "0/1")
    with pytest.raises(RefusedDelta, match="other settings.*outer_lr: job 0.7, this learner 1.0"):
        _train_here(tiny_model_dir, tmp_path / "other", bucket, "0/1", "diloco.outer_lr=1.0", "diloco.join=true")


def test_sigterm_while_waiting_for_a_round_checkpoints_and_the_round_closes_on_resume(tiny_model_dir, tmp_path):
    """Learner 0 of 2 waits for round 1 (learner 1 never comes, round_timeout_s 600): SIGTERM ends it at once with
    its step-2 checkpoint (exit 143), the round still open; resumed with a 1 s timeout, it closes round 1 first and
    ends on the weights of a run that waited out 1 s timeouts without a stop."""
    import signal

    _train_here(tiny_model_dir, tmp_path / "whole", tmp_path / "bucket-whole", "0/2", "diloco.round_timeout_s=1")
    out, bucket, log = tmp_path / "stopped", tmp_path / "bucket", tmp_path / "stopped.log"
    proc = start_forked_train(_overrides(out, bucket, "0/2", f"model.name={tiny_model_dir}",
                                         "diloco.round_timeout_s=600"), "", log)
    try:
        deadline = time.monotonic() + 120
        while not (bucket / "learner-0000" / "v00000001" / "manifest.json").is_file():  # waiting for round 1
            assert proc.is_alive() and time.monotonic() < deadline, _tail(log)
            time.sleep(0.1)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        code = join_forked(proc, timeout=60)
    assert code == 143, _tail(log)
    assert "stopped while waiting for round 1's decision" in _tail(log)
    assert json.loads((out / "diloco.json").read_text()) == {"round": 1, "round_start_step": 0}
    assert not (bucket / "rounds" / "00000001.json").exists()
    _train_here(tiny_model_dir, out, bucket, "0/2", "diloco.round_timeout_s=1", "resume=auto")
    a, b = _adapter(tmp_path / "whole"), _adapter(out)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [d.members for d in _replay(bucket, 2)] == [(0,), (0,)]
