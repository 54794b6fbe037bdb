"""vLLM in the learner's process (rollout.backend=vllm_colocate) on vLLM's CPU build, with the real SmolLM2-135M:
the same tokens as vLLM over HTTP and rlvr serve for the same adapter and seed, log-probs the learner's to
fp32 rounding, each pushed adapter (or base weights) what the next samples use, and a negative control that
shows why the prefix cache is reset after a push. The sleep/wake sequence runs against the real engine, where
the CPU build makes it a memory no-op.

Runs inside .venv-vllm (vLLM and rlvr in one interpreter): ``make test-vllm``; skipped where vLLM is missing.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from rlvr.learn.batch import StepBatch
from rlvr.learn.forward import completion_logprobs
from rlvr.models.policy import LoraSpec, load_tokenizer, load_trainable, resolve_model_dir
from rlvr.models.prompts import prompt_token_ids
from rlvr.rollout import SamplingParams
from rlvr.rollout.colocated import ColocatedSampler, EngineSettings, build_engine
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.store.bucket import AdapterBucket
from rlvr.tasks import arithmetic_rows
from tests.integration import vllm_server as servers
from tests.serving import ServerProcess
from tests.serving import post as post_with_key

REPO = Path(__file__).resolve().parents[2]
KEY = "colocate-test-key-7b2e"
SYSTEM = "Reply with only the number."
LONG_SYSTEM = ("You are a careful calculator. Read the question, work the arithmetic in your head, check it once, "
               "and reply with the number alone: no words, no units, no explanation. ") * 4  # > 128 tokens


def post(url, path, body):
    return post_with_key(url, path, body, api_key=KEY)


def _prompts(n=6, system=SYSTEM):
    rows, _ = arithmetic_rows(1, ("+", "*"), eval_size=20, train_size=0, seed=1234, system_prompt=system)
    return [r["prompt"] for r in rows[:n]]


def _perturb_adapter(model, seed: int, std: float = 0.02) -> None:
    """Give lora_B values (zero at init), so the adapter changes what is sampled."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, device="cpu") * std)


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def learner(model_dir):
    torch.manual_seed(0)  # lora_A's initialisation: the same adapter, so the same episodes, on every run
    model = load_trainable(model_dir, LoraSpec(r=16))
    _perturb_adapter(model, seed=1)
    return model.eval(), load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def colocated(learner, model_dir):
    model, tokenizer = learner
    settings = EngineSettings(model_dir=str(model_dir), dtype=torch.float32, lora_rank=16, seed=0, device_type="cpu",
                              sleep_level=0, kv_cache_bytes=1 << 30, max_model_len=512)
    sampler = ColocatedSampler(model, tokenizer, build_engine(settings), settings)
    yield sampler
    sampler.close()


@pytest.fixture(scope="module")
def http_vllm(model_dir, tmp_path_factory):
    servers.VLLM_PYTHON = sys.executable  # this venv's vLLM, the same build as the colocated engine
    args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1", "--dtype", "float32", "--max-model-len",
            "512", "--logprobs-mode", "processed_logprobs", "--api-key", KEY]
    with servers.vllm_server(model_dir, args, tmp_path_factory.mktemp("vllm") / "server.log",
                             {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        yield url


def _learner_logp(model, groups) -> torch.Tensor:
    n = groups.completion_ids.shape[0]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(groups, torch.zeros(n)), torch.arange(n))
    return logp


def _gap(model, groups) -> tuple[float, float]:
    """Mean and largest |learner - sampler| log-prob over the sampled tokens."""
    m = groups.completion_mask.bool()
    gap = (_learner_logp(model, groups) - groups.behaviour_logp)[m].abs()
    return float(gap.mean()), float(gap.max())


def _same_policy(model, groups) -> bool:
    """fp32 on both sides: SmolLM2's 30 layers in vLLM's CPU kernels and in the learner's agree to a mean of
    3e-6 (short prompts) to 1.2e-5 (a 160-token prompt) and at most 4e-5 per token, measured: float rounding in
    another order. A stale prefix or the wrong adapter is off by 1e-2 and more."""
    mean, largest = _gap(model, groups)
    return mean < 3e-5 and largest < 2e-4


def test_colocated_samples_what_vllm_over_http_samples_for_the_same_seed(colocated, learner, http_vllm, tmp_path):
    """Same adapter, same seed: token for token what vLLM over HTTP samples (rlvr's RemoteSampler), at a
    temperature and greedy; the log-probs are the learner's to fp32 rounding."""
    model, tokenizer = learner
    colocated.sync(1)
    pool = ServerPool([http_vllm], api_key=KEY)
    pool.wait_ready(60)
    remote = RemoteSampler(pool, tokenizer, model, AdapterBucket(tmp_path / "bucket"))
    remote.sync(1)
    prompts = _prompts(4)
    for params, g in ((SamplingParams(temperature=1.0, max_new_tokens=16), 4),
                      (SamplingParams(temperature=0.0, max_new_tokens=16), 1)):  # vLLM: greedy means n = 1
        ours = colocated.sample(prompts, g, params, seed=11)
        theirs = remote.sample(prompts, g, params, seed=11)
        assert ours.completion_token_ids() == theirs.completion_token_ids()
        assert ours.texts == theirs.texts and torch.equal(ours.truncated, theirs.truncated)
        assert (ours.version == 1).all() and ours.completion_ids.shape[0] == 4 * g
    greedy = colocated.sample(prompts, 3, SamplingParams(temperature=0.0, max_new_tokens=16), seed=0)
    assert greedy.completion_token_ids() == [ids for ids in ours.completion_token_ids() for _ in range(3)]
    served = remote.sample(prompts, 3, SamplingParams(temperature=0.0, max_new_tokens=16), seed=0)  # vLLM: n = 1
    assert served.completion_token_ids() == greedy.completion_token_ids()
    sampled = colocated.sample(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16), seed=12)
    assert _same_policy(model, sampled), _gap(model, sampled)
    remote.close()


def test_episodes_on_the_colocated_engine_are_vllm_over_http_s(colocated, learner, http_vllm, tmp_path):
    """Calculator episodes (the learner drives the turns, observation tokens appended by it): the colocated engine
    and vLLM over HTTP, same adapter and seeds, give the same episodes token for token; sampled tokens carry the
    learner's log-probs, observation tokens none."""
    from rlvr.config.schema import EnvConfig
    from rlvr.run.scoring import build_environment_setup, sample_scored
    from rlvr.tasks.tool_problems import tool_problem_rows

    model, tokenizer = learner
    setup = build_environment_setup(EnvConfig(tools=("calculator",), max_turns=3, max_episode_tokens=160), tokenizer)
    _, rows = tool_problem_rows(4, 8, 0, kind="products", shots=1)
    params = SamplingParams(temperature=0.7, max_new_tokens=48)
    colocated.sync(1)
    pool = ServerPool([http_vllm], api_key=KEY)
    pool.wait_ready(60)
    remote = RemoteSampler(pool, tokenizer, model, AdapterBucket(tmp_path / "bucket"))
    remote.sync(1)
    ours = sample_scored(colocated, rows, 2, params, 3, [], setup)
    theirs = sample_scored(remote, rows, 2, params, 3, [], setup)
    remote.close()
    g = ours.groups
    assert g.completion_token_ids() == theirs.groups.completion_token_ids()
    assert torch.equal(g.sampled_mask, theirs.groups.sampled_mask)
    assert ours.episode_stats.tools.calls == theirs.episode_stats.tools.calls
    assert ours.episode_stats.observation_tokens > 0  # tool results (or refusals) came back into the episodes
    sampled = g.sampled_mask.bool()
    n = g.completion_ids.shape[0]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(g, torch.zeros(n)), torch.arange(n))
    gap = (logp - g.behaviour_logp)[sampled].abs()
    assert gap.mean() < 3e-5 and gap.max() < 2e-4, (float(gap.mean()), float(gap.max()))
    assert (g.behaviour_logp[g.completion_mask.bool() & ~sampled] == 0).all()


def test_colocated_greedy_tokens_equal_rlvr_serve_s(colocated, learner, model_dir, tmp_path):
    """rlvr's own server, fp32, the same adapter: the same greedy tokens."""
    model, tokenizer = learner
    colocated.sync(1)
    published = AdapterBucket(tmp_path / "bucket").publish_adapter(model, 1)
    proc = ServerProcess(model_dir, "--threads", "1", "--precision", "fp32", api_key=KEY).wait_ready(timeout_s=180)
    try:
        assert post(proc.url, "/v1/load_lora_adapter", {"lora_name": "same", "lora_path": published.url}).is_success
        prompts = _prompts()
        body = {"model": "same", "prompt": [prompt_token_ids(tokenizer, p) for p in prompts], "temperature": 0,
                "max_tokens": 16, "return_token_ids": True}
        served = [c["token_ids"] for c in post(proc.url, "/v1/completions", body).json()["choices"]]
    finally:
        proc.stop()
    ours = colocated.sample(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=16), seed=0)
    assert ours.completion_token_ids() == served


def test_a_pushed_adapter_is_what_the_next_samples_use(colocated, learner):
    """After the learner's adapter changes and sync(v) pushes it, the next samples are the new adapter's (their
    log-probs the learner's); a prompt longer than a KV block (128 tokens) is sampled before and after, so its
    prefix was cached under the old adapter."""
    model, _ = learner
    prompts = _prompts(3, LONG_SYSTEM)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    colocated.sync(1)
    before = colocated.sample(prompts, 2, params, seed=5)
    assert _same_policy(model, before), _gap(model, before)
    _perturb_adapter(model, seed=2, std=0.05)
    colocated.sync(2)
    after = colocated.sample(prompts, 2, params, seed=5)
    assert (after.version == 2).all() and after.completion_token_ids() != before.completion_token_ids()
    assert _same_policy(model, after), _gap(model, after)
    _perturb_adapter(model, seed=1)  # the fixture's adapter again
    colocated.sync(3)


def test_without_the_prefix_reset_a_push_samples_from_stale_keys(colocated, learner, monkeypatch):
    """The negative control: the same push with reset_prefix_cache skipped gives log-probs far from the learner's
    on the long prompts (their cached prefix was computed by the previous adapter)."""
    model, _ = learner
    prompts = _prompts(3, LONG_SYSTEM)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    colocated.sync(4)
    colocated.sample(prompts, 2, params, seed=6)  # caches the prompts' prefix under this adapter
    monkeypatch.setattr(colocated.engine, "reset_prefix_cache", lambda *a, **k: True)
    _perturb_adapter(model, seed=3, std=0.05)
    colocated.sync(5)
    stale = colocated.sample(prompts, 2, params, seed=6)
    assert _gap(model, stale)[1] > 1e-2, _gap(model, stale)
    monkeypatch.undo()
    colocated.sync(6)
    assert _same_policy(model, colocated.sample(prompts, 2, params, seed=6))
    _perturb_adapter(model, seed=1)
    colocated.sync(7)


def test_base_weights_pushed_in_memory_and_the_sleep_sequence(colocated, learner):
    """Level-2 sleep as on CUDA (the CPU build runs the same calls as memory no-ops): the engine sleeps after each
    sampling call; the next wakes its weights, gets the learner's base weights (changed here) and adapter, resets
    the prefix cache, then wakes its KV cache - and samples what the learner computes."""
    model, _ = learner
    calls = []
    engine = colocated.engine
    for name in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "generate"):
        real = getattr(engine, name)
        setattr(engine, name, lambda *a, _real=real, _name=name, **k: calls.append((_name, a[:1])) or _real(*a, **k))
    settings = colocated.settings
    colocated.settings = replace(settings, device_type="cuda", sleep_level=2)
    down = model.base_model.model.model.layers[3].mlp.down_proj.base_layer.weight
    original = down.detach().clone()
    try:
        prompts, params = _prompts(2), SamplingParams(temperature=1.0, max_new_tokens=10)
        colocated.sync(8)
        colocated.sample(prompts, 2, params, seed=1)
        assert calls[-1] == ("sleep", ()) and colocated.asleep == 2
        with torch.no_grad():
            down.mul_(1.5)
        colocated.sync(9)  # asleep: the push waits for the wake
        calls.clear()
        after = colocated.sample(prompts, 2, params, seed=1)
        assert [c[0] for c in calls] == ["wake_up", "collective_rpc", "reset_prefix_cache", "wake_up", "generate",
                                         "sleep"]
        assert calls[0][1] == (["weights"],) and calls[1][1] == ("reload_weights",) and calls[3][1] == (["kv_cache"],)
        assert _same_policy(model, after), _gap(model, after)
    finally:
        with torch.no_grad():
            down.copy_(original)
        colocated.settings = replace(settings, device_type="cuda", sleep_level=2)
        colocated.sync(10)
        colocated.sample(_prompts(1), 1, SamplingParams(temperature=0.0, max_new_tokens=2), seed=0)  # wakes, pushes
        colocated.settings = settings
        for name in ("sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "generate"):
            vars(engine).pop(name, None)


def _train(out, *overrides, launcher=()):
    """``rlvr train`` on the demo with the colocated engine, a few small steps, in a process of its own (or as the
    learners ``launcher`` starts)."""
    args = [*(launcher or [sys.executable]), "-m", "rlvr", "train", "examples/demo.yaml", f"output_dir={out}",
            "train.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=12", "eval.every=0",
            "task.eval_size=4", "log.progress=false", "log.trackers=[]", "log.plot=false", "train.threads=1",
            "rollout.backend=vllm_colocate", "train.checkpoint_every=2", *overrides]
    done = subprocess.run(args, check=False, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # nor at exit (the engine's teardown)
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def _texts(samples, step):
    return [s["text"] for s in samples if s["step"] == step]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    return out, _train(out, "train.steps=3")


def test_rlvr_train_samples_on_the_colocated_engine_and_resumes_exactly(straight, tmp_path):
    """Three steps straight, and the same run resumed from its step-2 checkpoint in another process: step 3
    samples the same texts (the engine got the restored adapter, and each request its seed)."""
    out, samples = straight
    resumed = _train(tmp_path / "b", "train.steps=3", f"resume={out / 'checkpoints' / 'step-00000002'}")
    assert _texts(samples, 3) and _texts(resumed, 3) == _texts(samples, 3)
    metrics = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("step") == 3 and m.get("sampler/sync_s", 0) > 0 for m in metrics)


def test_two_learners_under_torchrun_each_with_its_engine(straight, tmp_path):
    """torchrun, two gloo ranks, an engine in each (vLLM's external_launcher in the learners' process group): each
    samples its share of the step's prompts, seeded by their place in the batch, so step 1 samples what one
    learner sampled; the job ends without a traceback (the engines leave the group to the learners)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = _train(tmp_path / "two", "train.steps=1", launcher=launcher)
    assert _texts(two, 1) == _texts(straight[1], 1) and len(_texts(two, 1)) == 8


def test_the_gpu_benchmark_s_colocated_row_in_its_dry_mode(tmp_path):
    """benchmarks/gpu.py --device cpu in this venv: rlvr's colocated row runs beside rlvr's own (TRL is not
    installed here), with its weight-sync time, and the table shows it."""
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--sleep-levels", "0", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())["runs"]["tiny"]["rlvr_colocate_s0"]
    assert run["summary"]["steady_step_s"] > 0 and run["summary"]["gen_tokens_per_s"] > 0
    assert len(run["sync_s"]) == 2 and all(s > 0 for s in run["sync_s"])
    assert "| tiny | 0 |" in done.stdout
