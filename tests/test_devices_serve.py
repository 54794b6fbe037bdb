"""rlvr serve's engine and the remote sampler follow the model's device (tests/test_devices.py covers the trainer's
side): the engine's generation run under a non-CPU *default* device ("meta") gives the same completions as a plain
run - a tensor made without an explicit device would land on meta and fail loudly at the first operation that meets
the CPU model - and the remote sampler builds its groups on the CPU whatever the default device. `rlvr serve
--device cuda` on a machine without a GPU fails with one line saying what to do, before any model loads."""

import dataclasses
import re

import pytest
import torch

from rlvr.platform.devices import model_device
from rlvr.rollout import SamplingParams
from rlvr.serve.engine import AdapterJob, Engine, Job
from tests.test_devices import _same_groups
from tests.test_serve import make_adapter

SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=8)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
STOP_TOP_K = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_new_tokens=12, stop=("e", "1"))


@pytest.fixture
def engine(tiny_model_dir):
    """Engines built and loaded in this thread (not started), so that a test can run their batches itself, inside or
    outside a default-device block (torch's default device is per thread)."""
    made = []

    def make(**kwargs) -> Engine:
        made.append(Engine(str(tiny_model_dir), device="cpu", **kwargs))
        made[-1].load_model()
        return made[-1]

    yield make
    for e in made:
        e.close()


def _run(engine: Engine, job: Job):
    """One batch of ``job``'s prompts on the engine, in this thread (what the engine thread does for a batch)."""
    engine.check(job)
    job.taken = len(job.prompts)
    engine._generate([(job, 0, len(job.prompts))])
    return job.future.result(timeout=0)


def _load(engine: Engine, name: str, path) -> str:
    job = AdapterJob("load", name, str(path))
    engine._adapter_job(job)
    return job.future.result(timeout=0)


def _job(tokenizer, params, adapter=None, n=3, top_logprobs=0) -> Job:
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 3 + 4?", "12 * 9 =", "Say something.")]
    return Job(prompts, n, params, adapter, seed=11, top_logprobs=top_logprobs)


def _same_with_and_without_meta(engine, make_job):
    want = _run(engine, make_job())
    engine._decode_cache.clear()  # the meta run folds its decoding weights again
    with torch.device("meta"):
        got = _run(engine, make_job())
    assert [dataclasses.asdict(g) for g in got] == [dataclasses.asdict(g) for g in want]
    return want


@pytest.mark.parametrize("params, top_logprobs", [(SAMPLED, 0), (GREEDY, 2), (STOP_TOP_K, 3)],
                         ids=["sampled", "greedy-top-logprobs", "stop-top-k-top-p"])
@pytest.mark.parametrize("adapter", [False, True], ids=["base", "lora"])
def test_the_serve_engine_makes_every_tensor_on_the_models_device(engine, tokenizer, tmp_path, params, top_logprobs,
                                                                  adapter):
    """Prompts padded on the CPU and moved to the model's device, per-completion generators on it, the KV cache,
    folded LoRA weights and the results brought back as Python values: the same completions as a plain run."""
    e = engine()
    if adapter:
        assert "added" in _load(e, "one", make_adapter(tmp_path / "a", len(tokenizer), seed=1))
    want = _same_with_and_without_meta(e, lambda: _job(tokenizer, params, "one" if adapter else None,
                                                         top_logprobs=top_logprobs))
    assert all(isinstance(t, int) for g in want for row in g.token_ids for t in row)
    assert all(type(x) is float for g in want for row in g.logprobs for x in row)
    if params.stop:
        assert any(r is not None for g in want for r in g.stop_reason), "some completion should end on a stop string"
    model = e._peft if adapter else e._base
    assert all(p.device == e.device for p in model.parameters())


def test_bf16_weights_decode_alike_under_the_meta_default(engine, tokenizer, tmp_path):
    """--dtype bf16: the base model in bf16 (fp32 logits), an adapter peft loads in its own dtype (fp32)."""
    e = engine(dtype="bf16")
    assert e._base.dtype == torch.bfloat16 and e.dtype == torch.bfloat16
    _load(e, "one", make_adapter(tmp_path / "a", len(tokenizer), seed=1))
    lora = [p for n, p in e._peft.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 for p in lora)
    for adapter in (None, "one"):
        _same_with_and_without_meta(e, lambda adapter=adapter: _job(tokenizer, SAMPLED, adapter, top_logprobs=1))


def test_the_cpu_default_changes_no_number(engine, tokenizer, tiny_model_dir):
    """device=cpu (auto here) and fp32: the engine's greedy completion is the in-process sampler's."""
    from rlvr.models.policy import load_causal_lm
    from rlvr.models.prompts import prompt_token_ids
    from rlvr.rollout import sample_groups

    e = engine()
    assert e.device == torch.device("cpu") and e.weight_dtype == torch.float32 and model_device(e._base) == e.device
    if not torch.cuda.is_available():
        auto = Engine(str(tiny_model_dir))
        auto.close()
        assert (auto.device, auto.weight_dtype) == (torch.device("cpu"), torch.float32)  # auto without a GPU
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    local = sample_groups(load_causal_lm(tiny_model_dir).eval(), tokenizer, [chat], 1, GREEDY)
    (g,) = _run(e, Job([prompt_token_ids(tokenizer, chat)], 1, GREEDY, None, seed=0))
    assert g.token_ids[0] == local.completion_ids[0][local.completion_mask[0].bool()].tolist()
    assert g.logprobs[0] == local.behaviour_logp[0][local.completion_mask[0].bool()].tolist()


def test_adapters_are_read_onto_the_models_device(engine, tokenizer, tmp_path, monkeypatch):
    """peft reads adapter weights onto the device it guesses (the first GPU whenever one is visible) unless told:
    the engine tells it the model's. Here peft is made to guess a GPU this machine does not have."""
    import peft.peft_model

    monkeypatch.setattr(peft.peft_model, "infer_device", lambda: "cuda")
    e = engine()
    for name, seed in (("one", 1), ("two", 2)):  # PeftModel.from_pretrained, then load_adapter
        assert "added" in _load(e, name, make_adapter(tmp_path / name, len(tokenizer), seed=seed))
    assert all(p.device == e.device for p in e._peft.parameters())


# --- the remote sampler: groups from a server's answers, on the CPU ---------------------------------------------


def test_groups_from_a_servers_answer_are_made_on_the_cpu(tokenizer):
    from rlvr.rollout.server_answers import groups_from_completions
    from tests.test_pool_validation import valid_answer

    answers = [valid_answer(2, 5), valid_answer(2, 3)]
    answers[1]["choices"][0]["finish_reason"] = "stop"
    prompt_ids = [[5, 6, 7], [8, 9]]

    def build():
        return groups_from_completions(answers, prompt_ids, 2, tokenizer, 3, 0.9, max_tokens=5)

    want = build()
    with torch.device("meta"):
        got = build()
    _same_groups(got, want)
    assert want.truncated.tolist() == [True, True, False, True] and want.version.tolist() == [3] * 4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from tests.serving import ServerProcess

    proc = ServerProcess(tiny_model_dir, "--device", "cpu", "--dtype", "fp32").wait_ready()
    yield proc
    proc.stop()


def test_the_remote_sampler_builds_cpu_groups_under_a_device_default(server, tiny_model_dir, tokenizer, tmp_path):
    """RemoteSampler.sample and sample_episodes against a real `rlvr serve`: the same groups, all on the CPU, with
    or without the meta default (what a trainer whose model is on a GPU gets)."""
    from tests.test_episodes_remote import LIMITS, STOP, Answering, _ids, _remote
    from tests.test_remote import PROMPTS, _trainer

    sampler = _remote([server.url], _trainer(tiny_model_dir), tokenizer, tmp_path)
    try:
        want = sampler.sample(PROMPTS, 3, SAMPLED, seed=4)
        with torch.device("meta"):
            got = sampler.sample(PROMPTS, 3, SAMPLED, seed=4)
        _same_served_groups(got, want)

        def episodes():
            return sampler.sample_episodes(_ids(tokenizer), [Answering() for _ in range(4)], 2, STOP, 0, LIMITS)

        want = episodes()
        with torch.device("meta"):
            got = episodes()
        _same_served_groups(got.groups, want.groups)
    finally:
        sampler.close()


def _same_served_groups(a, b):
    """The same groups from a server, all on the CPU: the server batches the requests as they arrive, and a batch of
    other rows rounds a log-prob otherwise (fp32, ~1e-7); everything else is exact."""
    assert torch.allclose(a.behaviour_logp, b.behaviour_logp, atol=1e-5, rtol=0)
    _same_groups(dataclasses.replace(a, behaviour_logp=b.behaviour_logp), b)


# --- the command line ----------------------------------------------------------------------------------------------


def test_serve_device_and_dtype_arguments(monkeypatch):
    import rlvr.serve
    from rlvr.cli import main

    calls = []
    monkeypatch.setattr(rlvr.serve, "serve", lambda *args, **kwargs: calls.append(kwargs))
    assert main(["serve", "m"]) == 0
    assert (calls[-1]["device"], calls[-1]["dtype"]) == ("auto", "auto")
    for device in ("cpu", "cuda", "cuda:1", "mps"):
        for dtype in ("fp32", "bf16"):
            assert main(["serve", "m", "--device", device, "--dtype", dtype]) == 0
            assert (calls[-1]["device"], calls[-1]["dtype"]) == (device, dtype)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "m", "--dtype", "fp16"])
    assert exit_.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize("device, message", [
    ("cuda", (r"^rlvr: error: --device cuda: no CUDA device is visible to torch \(.*\); install a CUDA build of "
              r"torch, or use --device cpu \(auto picks the CPU when there is no GPU\)$")),
    ("cuda:3", r"^rlvr: error: --device cuda:3: no CUDA device is visible to torch .* use --device cpu"),
    ("gpu", r"^rlvr: error: --device must be one of auto, cpu, cuda, cuda:N or mps; got 'gpu'$"),
])
def test_serve_on_a_device_that_is_not_there_fails_in_one_line_before_loading(tiny_model_dir, capsys, monkeypatch,
                                                                               device, message):
    import rlvr.serve.engine
    from rlvr.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(rlvr.serve.engine, "load_causal_lm", no_load)
    monkeypatch.setattr(rlvr.serve.engine, "load_tokenizer", no_load)
    assert main(["serve", str(tiny_model_dir), "--port", "0", "--device", device]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.match(message, err.strip()), err


def test_the_listening_line_names_the_device(server):
    assert "on cpu, float32 weights)" in server.output().splitlines()[0]
