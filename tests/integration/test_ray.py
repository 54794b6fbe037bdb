"""The Ray runtime: rollout servers as Ray actors on a local Ray instance (in-process ``ray.init``); an actor
whose process is SIGKILLed mid-run is restarted by Ray and rejoins the pool at its new URL, and training goes
on with no group lost or trained twice. The actors' servers listen on loopback (async.server_host's default) and
refuse requests without the run's API key. Run by ``make test-ray`` (installs the ``ray`` extra)."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlvr.config.loading import load_config
from tests.test_async import _records, _trained_uids
from tests.test_e2e import _overrides

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_actors_serve_restart_and_rejoin(local_ray, tiny_model_dir, tmp_path):
    from rlvr.launch import train

    out = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_model_dir, out) + [
        "async.enabled=true", "async.runtime=ray", "async.servers=2", "async.server_restarts=2",
        "train.steps=150", "eval.every=0", "rollout.server_wait_s=120", "train.checkpoint_every=0"])
    result: dict = {}
    learner = threading.Thread(target=lambda: result.update(summary=train(cfg)))
    learner.start()
    deadline = time.monotonic() + 300
    while len(_records(out)) < 4:
        assert learner.is_alive() and time.monotonic() < deadline
        time.sleep(0.1)
    listed = json.loads((out / "servers.json").read_text())
    for server in listed:  # loopback only, and this run's key required (the pool has it; we do not)
        assert server["url"].startswith("http://127.0.0.1:")
        assert httpx.get(f"{server['url']}/health").status_code == 200
        assert httpx.get(f"{server['url']}/v1/models").status_code == 401
    victim = listed[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    learner.join(timeout=600)
    assert result["summary"]["steps"] == 150
    last = _records(out)[-1]
    assert last["sampler/servers_lost"] >= 1 and last["sampler/servers_revived"] >= 1
    assert last["sampler/servers_live"] == 2
    uids = _trained_uids(out)
    assert len(uids) == 300 and len(set(uids)) == 300


def test_diloco_learners_placed_by_ray_share_the_bucket(local_ray, tiny_model_dir, tmp_path):
    """diloco.placement=ray: two learners as Ray tasks, talking only through the bucket; both take every round."""
    from rlvr.launch import train
    from rlvr.store.rounds import RoundBucket

    root = str(Path(__file__).resolve().parents[2])
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path / "run") + [
        "diloco.placement=ray", "diloco.learners=2", f"diloco.bucket={tmp_path / 'bucket'}", "diloco.inner_steps=2",
        "train.steps=4", "eval.every=0", "train.threads=1", f"import_dirs=[{root}]"])
    summary = train(cfg)
    assert len(summary["learners"]) == 2 and all("error" not in s for s in summary["learners"])
    bucket = RoundBucket(str(tmp_path / "bucket"), 0, 2)
    assert [bucket.decision(r).members for r in (1, 2)] == [(0, 1), (0, 1)]
    assert (tmp_path / "run" / "learner-1" / "adapter").is_dir()


def test_learners_placed_by_ray_share_their_rollouts(local_ray, tiny_model_dir, tmp_path):
    """diloco.rollouts=step with diloco.placement=ray: each Ray task trains on both learners' groups of every step,
    so the two end on the same weights without a weight round."""
    from safetensors.torch import load_file

    from rlvr.launch import train

    root = str(Path(__file__).resolve().parents[2])
    cfg = load_config(None, _overrides(tiny_model_dir, tmp_path / "run") + [
        "diloco.placement=ray", "diloco.learners=2", f"diloco.bucket={tmp_path / 'bucket'}", "diloco.inner_steps=0",
        "diloco.rollouts=step", "algo.dynamic_sampling=true", "algo.max_resample_rounds=0", "train.steps=3",
        "eval.every=0", "train.threads=1", f"import_dirs=[{root}]"])
    summary = train(cfg)
    assert len(summary["learners"]) == 2 and all("error" not in s for s in summary["learners"])
    runs = [tmp_path / "run" / f"learner-{k}" for k in range(2)]
    last = [json.loads((r / "metrics.jsonl").read_text().splitlines()[-1]) for r in runs]
    assert all(m["shared/total_external_groups"] > 0 and m["shared/total_refused"] == 0 for m in last)
    a, b = (load_file(str(r / "adapter" / "adapter_model.safetensors")) for r in runs)
    assert all((a[k] == b[k]).all() for k in a)
