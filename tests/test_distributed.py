"""Many learners, one run: `torchrun --nproc-per-node 2 -m rlvr train` (gloo, 2 CPU processes, the tiny model) trains
the same run as one process with the same global batch - every trained parameter within 1e-6 after 3 steps, LoRA and
full fine-tuning, with micro-batch accumulation and activation checkpointing; the metrics rows equal; a killed rank
ends the job within 60 s, a stuck one at the collective timeout; the job resumes exactly from its checkpoint, with
the same number of learners or with one process.

A launch costs seconds of imports and the steps a fraction of one, so the runs that do not change between tests (the
one-process references, the two-learner LoRA job) run once per session (``shared``; tests/test_sharding.py too), and
a one-process run overlaps a two-learner one where the test waits for both."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr.platform.distributed import World, world_from_env
from tests.test_resume import VOLATILE

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_a_ranks_share_keeps_order_and_covers_everything():
    for n in range(12):
        for size in (1, 2, 3, 5):
            shares = [World(r, size).share(n) for r in range(size)]
            assert [i for s in shares for i in s] == list(range(n))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_world_from_the_launchers_variables():
    assert world_from_env({}) == World(0, 1, 0)
    assert world_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == World(1, 2, 1)
    for bad in ({"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "x"}, {"WORLD_SIZE": "0"}):
        with pytest.raises(ValueError, match="torchrun sets them"):
            world_from_env(bad)


def _overrides(model_dir, out, lora: bool, steps: int = 3) -> list[str]:
    return [
        f"model.name={model_dir}", f"model.lora={str(lora).lower()}", "model.lora_r=4",
        "model.gradient_checkpointing=true", f"output_dir={out}", "task.eval_size=4",
        "rewards=[{name: 'tests.helpers:length_reward'}]", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "rollout.per_completion_seeds=true", "train.prompts_per_step=4", "train.micro_batch_size=3",
        f"train.steps={steps}", "train.checkpoint_every=1", "train.threads=1", "algo.beta=0.05",
        # the learners sum their gradients in another order than one process does (rounding at 1e-9); AdamW divides
        # by the gradient's own size, so where a gradient is near 0 that rounding moves the update by up to lr:
        # (measured: 1.2e-5 at lr 1e-2 after 3 steps of episodes); 1e-4 keeps that rounding under 1e-6
        f"train.lr={1e-4 if lora else 1e-5}",
        "eval.every=2", "eval.batch_size=4", "log.progress=false", "log.trackers=[]", "log.plot=false",
        "log.sample_token_ids=true",
    ]


class Job:
    """A job started now and left running (its own process group: the launcher and every learner), so that a
    one-process run (one core) can overlap a two-learner one on a 2-core machine; ``result`` waits for it."""

    def __init__(self, command: list[str], env: dict | None = None, out: Path | None = None):
        self.command, self.out, self.done = command, out, None
        self.popen = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True)

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """The job run to its end; on the timeout its whole process group is killed."""
        if self.done is None:
            try:
                stdout, stderr = self.popen.communicate(timeout=timeout)
            finally:
                self.kill()
            self.done = subprocess.CompletedProcess(self.command, self.popen.returncode, stdout, stderr)
        return self.done

    def kill(self) -> None:
        """SIGKILL the whole job if it is still running (nothing of it outlives a test)."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.communicate()


def _run(command: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a job to its end; on the timeout its whole process group (the launcher and every learner) is killed."""
    return Job(command, env).result(timeout)


_SHARED: dict[tuple, Job] = {}  # one per configuration for the whole session (this file and tests/test_sharding.py)


def _shared(factory: pytest.TempPathFactory, launcher: list[str], model_dir: Path, lora: bool, *extra: str) -> Job:
    """``rlvr train examples/demo.yaml`` with these overrides, started (in the background) the first time a test asks
    for it and then shared: the one-process references and the two-learner LoRA run do not change between the tests
    that compare against them. Its run directory is read, never written, by those tests."""
    key = (tuple(launcher), str(model_dir), lora, *extra)
    if key not in _SHARED:
        out = factory.mktemp("shared") / "run"
        _SHARED[key] = Job([*launcher, "-m", "rlvr", "train", "examples/demo.yaml",
                            *_overrides(model_dir, out, lora), *extra], out=out)
    return _SHARED[key]


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """``shared(launcher, model_dir, lora, *extra)``: the session's run of that configuration (``_shared``); a
    shared run nobody waited for (its test failed first) is killed at the end of the session."""
    yield lambda *args: _shared(tmp_path_factory, *args)
    for job in _SHARED.values():
        job.kill()


SINGLE = [sys.executable]  # one process: python -m rlvr train


def _records(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    rows = [json.loads(line) for line in (run / name).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(m in k for m in VOLATILE)} for r in rows]


def _same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = ({k: v for k, v in r.items() if k not in ("update/allreduce_bytes", "episode/env_s")}
                for r in (x, y))  # the job's own figure; the environments' wall time
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-6), (x["step"], k)
            else:
                assert x[k] == y[k], (x["step"], k)


def _weights(run: Path, lora: bool) -> dict[str, torch.Tensor]:
    path = run / "adapter" / "adapter_model.safetensors" if lora else run / "model" / "model.safetensors"
    return load_file(str(path))


EPISODES = ["env.factory=tests.helpers:Notebook", "env.max_turns=2", "env.max_episode_tokens=64",
            "rewards=[{name: 'tests.helpers:length_reward'}, {name: 'tests.helpers:environments_reward'}]"]


PPO = ["algo.name=ppo", "algo.beta=0", "ppo.kl_coef=0.05"]


REPLICAS = ["train.shard_weights=false"]  # sharded weights (full fine-tuning's default): tests/test_sharding.py

# mu = 2 (a frozen proximal pass, then two steps on the batch) and a gradient norm (~0.75) above the clip: full
# fine-tuning runs with these both as replicas (here) and sharded (tests/test_sharding.py), against one shared
# one-process run
FULL = ["algo.num_iterations=2", "train.max_grad_norm=0.3"]

# (lora, episodes, the run's overrides, the two learners' own). A one-process run ignores train.shard_weights, so
# the one-process reference is the same run whatever the learners' layout: each is run once per session (_shared).
# "full" runs with mu = 2 and clipping, which its one-process reference shares with the sharded case; "episodes_ppo"
# is one job for what were two cases (episodes; PPO), each property still asserted on its own below.
CASES = {"lora": (True, False, [], []), "full": (False, False, FULL, REPLICAS),
         "episodes_ppo": (True, True, [*EPISODES, *PPO], [])}


@pytest.mark.parametrize("case", ["lora", *(pytest.param(c, marks=pytest.mark.long) for c in CASES if c != "lora")])
def test_two_ranks_train_what_one_process_trains(tiny_model_dir, tiny_long_model_dir, shared, case):
    lora, episodes, extra, layout = CASES[case]
    model_dir = tiny_long_model_dir if episodes else tiny_model_dir
    reference = shared(SINGLE, model_dir, lora, *extra)  # started first: one core while the learners start up
    learners = shared(TORCHRUN, model_dir, lora, *extra, *layout)  # the LoRA job is also the killed-rank test's
    job, single = learners.result(), reference.result()
    assert single.returncode == 0, single.stderr[-3000:]
    assert job.returncode == 0, job.stderr[-3000:]
    one, two = reference.out, learners.out
    a, b = _weights(one, lora), _weights(two, lora)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), name
    if PPO[0] in extra:  # the critic's head too
        a, b = (load_file(str(max((run / "checkpoints").glob("step-*")) / "weights.safetensors"))
                for run in (one, two))
        assert any("value" in name or "critic" in name for name in a) and a.keys() == b.keys(), sorted(a)
        for name in a:
            assert torch.allclose(a[name], b[name], atol=1e-6, rtol=0), f"PPO checkpoint: {name}"
    _same_rows(_records(one), _records(two))
    _same_rows(_records(one, "samples.jsonl"), _records(two, "samples.jsonl"))
    assert "learners: 2" in job.stdout
    if episodes:  # the episode statistics were gathered: turns, tool calls, tokens, as one process counts them
        assert all(r["episode/turns_mean"] >= 1 for r in _records(two)[1:]), "episode statistics not gathered"
    if extra == FULL:  # the clip bit (as in the sharded case)
        assert any(r["update/grad_norm"] > 0.3 for r in _records(two)[1:]), "the gradient norm never reached the clip"


@pytest.mark.long
def test_a_killed_rank_ends_the_job_and_it_resumes_exactly(tiny_model_dir, tmp_path, shared):
    """Rank 1 is SIGKILLed in step 3 of 3 (checkpoints after steps 1 and 2): the job ends, and its step-2 checkpoint
    resumed by two learners and by one process finishes as the uninterrupted two-learner run (the LoRA job that
    test_two_ranks_train_what_one_process_trains[lora] compares with one process: the session's shared run)."""
    done = shared(TORCHRUN, tiny_model_dir, True).result()  # before the crash is timed: nothing else runs then
    assert done.returncode == 0, done.stderr[-3000:]
    reference, out = shared(TORCHRUN, tiny_model_dir, True).out, tmp_path / "run"
    config = ["examples/demo.yaml"]
    started = time.monotonic()
    crashed = _run([*TORCHRUN, "-m", "rlvr", "train", *config, *_overrides(tiny_model_dir, out, True)],
                   env={"RLVR_FAULT": "after_generate@3", "RLVR_FAULT_RANK": "1"}, timeout=120)
    assert time.monotonic() - started < 60 and crashed.returncode != 0
    assert re.search(r"Root Cause.*?rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*-9", crashed.stderr, re.DOTALL), \
        crashed.stderr[-2000:]
    alone = tmp_path / "alone"  # the same checkpoint resumed by one process: a checkpoint is the whole state
    shutil.copytree(out, alone)
    # both resumptions at once (separate copies of the run): the one process uses the core the learners leave
    one = Job([sys.executable, "-m", "rlvr", "train", *config, *_overrides(tiny_model_dir, alone, True), "resume=auto"])
    try:
        resumed = _run([*TORCHRUN, "-m", "rlvr", "train", *config, *_overrides(tiny_model_dir, out, True),
                        "resume=auto"])
    finally:
        single = one.result()
    assert single.returncode == 0 and "(step 2)" in single.stdout, single.stderr[-3000:]
    _same_rows(_records(reference), _records(alone))
    a, b = _weights(reference, True), _weights(alone, True)
    assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "(step 2)" in resumed.stdout
    _same_rows(_records(reference), _records(out))
    a, b = _weights(reference, True), _weights(out, True)
    assert all(torch.equal(a[n], b[n]) for n in a)


def _wait_for_rows(job: Job, metrics: Path, rows: int, within_s: float = 120) -> float:
    """Wait until rank 0 has logged ``rows`` rows (step 0 is the first); returns when (time.monotonic())."""
    deadline = time.monotonic() + within_s
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= rows):
        if job.popen.poll() is not None:
            pytest.fail(f"the job ended before logging step {rows - 1}: {job.result().stderr[-2000:]}")
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"step {rows - 1} not logged within {within_s} s: {job.result().stderr[-2000:]}")
        time.sleep(0.2)
    return time.monotonic()


# torchrun with a 2 s grace instead of 30 s between its SIGTERM and its SIGKILL to the learners of a failed job
# (torch 2.13 closes a failed worker group with PContext.close()'s default, not --shutdown-timeout); else torchrun
GRACE_S = 2
SHORT_GRACE = ("import torch.distributed.elastic.multiprocessing.api as api; "
               f"api.PContext.close.__defaults__ = (None, {GRACE_S}); from torch.distributed.run import main; main()")
TORCHRUN_SHORT_GRACE = [sys.executable, "-c", SHORT_GRACE, *TORCHRUN[3:]]


@pytest.mark.long
def test_a_stuck_rank_ends_the_job_at_the_collective_timeout(tiny_model_dir, tmp_path):
    """Rank 1 stops answering after sampling step 2: rank 0's next collective gives up after
    train.collective_timeout_s, and the launcher ends the stuck rank: SIGTERM, which a learner answers only at the
    end of its step (the stuck one never gets there), then SIGKILL after the launcher's grace (GRACE_S here). Step 1
    logged marks when rank 0 starts step 2: the job ends within the timeout and the grace from then (plus the slack
    of a loaded machine)."""
    timeout_s = 3
    out = tmp_path / "run"
    started = time.monotonic()
    job = Job([*TORCHRUN_SHORT_GRACE, "-m", "rlvr", "train", "examples/demo.yaml",
               *_overrides(tiny_model_dir, out, True, steps=4), f"train.collective_timeout_s={timeout_s}"],
              env={"RLVR_FAULT": "after_generate@2:hang", "RLVR_FAULT_RANK": "1"})
    try:
        step_2 = _wait_for_rows(job, out / "metrics.jsonl", 2)
    finally:
        stuck = job.result(timeout=120)
    ended = time.monotonic()
    assert stuck.returncode != 0 and ended - started < 60, (ended - started, stuck.stderr[-2000:])
    assert ended - step_2 < timeout_s + GRACE_S + 15, (ended - step_2, stuck.stderr[-2000:])
    assert re.search(rf"rlvr: error: learner 0 of 2: \w[^:]*: another learner did not answer within {timeout_s} s "
                     r"\(train.collective_timeout_s\)", stuck.stderr), stuck.stderr[-2000:]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*-9", stuck.stderr), \
        "the launcher did not SIGKILL the stuck rank: " + stuck.stderr[-2000:]


@pytest.mark.long
def test_ctrl_c_stops_every_learner_after_a_checkpoint_and_leaves_no_process(tiny_model_dir, tmp_path):
    """A terminal's Ctrl-C reaches the launcher and both learners (one process group); the launcher then sends its
    workers SIGTERM. The learners finish the step, rank 0 checkpoints it, and nothing is left running."""
    out = tmp_path / "run"
    args = [*_overrides(tiny_model_dir, out, True, steps=200), "train.checkpoint_every=0"]
    job = subprocess.Popen([*TORCHRUN, "-m", "rlvr", "train", "examples/demo.yaml", *args], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    try:
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-2000:]
            time.sleep(0.2)
        os.killpg(job.pid, signal.SIGINT)
        stdout, stderr = job.communicate(timeout=120)
    finally:  # whatever failed above, nothing of the job outlives the test
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert "interrupted; saved" in stdout, stderr[-2000:]
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert checkpoints and int(checkpoints[-1].name.split("-")[1]) == logged
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True, check=False).stdout.split()
    assert not left, f"processes still running: {left}"


@pytest.mark.long
def test_two_learners_sample_from_shared_rollout_servers(tiny_model_dir, tmp_path):
    """rollout.backend=server: each learner sends its share of the prompts (seeded by their place in the batch) to
    the same `rlvr serve`; rank 0 alone publishes each adapter version and the other waits for it. The run is one
    process's with the same server."""
    from tests.serving import ServerProcess

    server = ServerProcess(tiny_model_dir, "--batch-wait-ms", "5")
    try:
        server.wait_ready()
        remote = ["rollout.backend=server", f"rollout.servers=[{server.url}]", "eval.every=0"]
        one, two = tmp_path / "one", tmp_path / "two"
        single = _run([sys.executable, "-m", "rlvr", "train", "examples/demo.yaml",
                       *_overrides(tiny_model_dir, one, True), *remote])
        assert single.returncode == 0, single.stderr[-3000:]
        job = _run([*TORCHRUN, "-m", "rlvr", "train", "examples/demo.yaml", *_overrides(tiny_model_dir, two, True),
                    *remote])
        assert job.returncode == 0, job.stderr[-3000:]
    finally:
        server.stop()
    a, b = _weights(one, True), _weights(two, True)
    assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a)
    _same_rows(*([{k: v for k, v in r.items() if not k.startswith("sampler/")} for r in _records(run)]
                 for run in (one, two)))  # the sampler's request counts are rank 0's own
    _same_rows(_records(one, "samples.jsonl"), _records(two, "samples.jsonl"))
    assert sorted(p.name for p in (two / "adapters").iterdir()) == ["v00000002", "v00000003"]  # published once each


@pytest.mark.long
def test_a_trl_style_script_runs_under_torchrun(tiny_model_dir, tmp_path):
    """The Python API under torchrun: the TRL quickstart (only its import changed) trains with two learners; rank 0
    writes the run, save_model is safe to call on every rank."""
    from tests.test_api import QUICKSTART

    out, script = tmp_path / "quickstart", tmp_path / "train_grpo.py"
    script.write_text(QUICKSTART.replace("OUTPUT_DIR", repr(str(out))).replace("MODEL_DIR", repr(str(tiny_model_dir)))
                      + "trainer.save_model()\n")
    job = _run([*TORCHRUN, str(script)])
    assert job.returncode == 0, job.stderr[-3000:]
    assert "learners: 2" in job.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["update/allreduce_bytes"] > 0 for r in rows[1:])
    assert (out / "model" / "config.json").is_file() and (out / "model.safetensors").is_file()
