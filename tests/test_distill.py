"""On-policy distillation: the per-token advantage and GKD's divergence by hand, the sampled term's Monte-Carlo mean
against the exact reverse KL, a teacher equal to the student (no update), a zero coefficient (plain GRPO), a served
teacher (a real rlvr serve on loopback) equal to the in-process one, and teachers that read other tokens refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlvr.config.loading import ConfigError, load_config
from rlvr.core.distill import generalized_jsd, reverse_kl, sampled_reverse_kl, teacher_advantage
from rlvr.launch import train
from rlvr.learn.batch import StepBatch
from rlvr.learn.distill import LocalTeacher, ServedTeacher, build_teacher
from rlvr.learn.step import micro_batches
from rlvr.models.teacher import load_teacher
from rlvr.rollout import SamplingParams
from rlvr.rollout.retry import RetryPolicy
from rlvr.rollout.server_errors import MalformedAnswer
from rlvr.rollout.teacher_client import TeacherClient, TeacherError, token_logprobs
from tests.conftest import make_model, make_tokenizer, sample_tiny
from tests.judge_server import JudgeServer
from tests.serving import ServerProcess
from tests.test_e2e import _overrides


def test_the_teacher_advantage_by_hand():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -9.0, -4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = teacher_advantage(student, teacher, mask, coef=2.0)
    # -2 * (student - teacher): a token the teacher likes more than the student is pushed up
    assert adv.tolist() == [[-1.0, 2.0, 0.0], [2.0, pytest.approx(-17.8), 0.0]]
    assert sampled_reverse_kl(student, teacher, mask) == pytest.approx((0.5 - 1.0 + 0.0 - 1.0 + 8.9) / 5)


def test_generalized_jsd_against_its_definition_and_its_two_ends():
    torch.manual_seed(0)
    s, t = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    ps, pt = s.softmax(-1), t.softmax(-1)
    kl = lambda p, q: (p * (p / q).log()).sum(-1)
    assert torch.allclose(generalized_jsd(s, t, 0.0), kl(pt, ps))  # forward KL
    assert torch.allclose(generalized_jsd(s, t, 1.0), kl(ps, pt))  # reverse KL
    assert torch.allclose(reverse_kl(s, t), kl(ps, pt))
    for beta in (0.1, 0.5, 0.9):
        m = beta * pt + (1 - beta) * ps
        assert torch.allclose(generalized_jsd(s, t, beta), beta * kl(pt, m) + (1 - beta) * kl(ps, m))
    assert torch.allclose(generalized_jsd(s, s, 0.5), torch.zeros(5, dtype=torch.float64))
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, 1.5)


def test_the_sampled_term_is_an_unbiased_estimate_of_the_full_vocabulary_reverse_kl():
    torch.manual_seed(1)
    student, teacher = torch.randn(1, 50, dtype=torch.float64) * 2, torch.randn(1, 50, dtype=torch.float64) * 2
    exact = float(reverse_kl(student, teacher))
    draws = torch.distributions.Categorical(logits=student[0]).sample((40000,))  # tokens the student samples
    delta = student[0].log_softmax(-1)[draws] - teacher[0].log_softmax(-1)[draws]
    half_width = 4 * float(delta.std()) / math.sqrt(len(delta))
    assert abs(float(delta.mean()) - exact) < half_width
    assert exact > 10 * half_width / 4  # the interval is tight enough that a biased estimate would show


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Student and teacher: two tiny random Llamas of one tokenizer; and a third model with another tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    tok = make_tokenizer()
    dirs = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        dirs[name] = root / name
        make_model(len(tok), seed=seed).save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(make_model(len(tok), seed=0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                      init_lora_weights=False))  # random A and B
    dirs["adapter"] = root / "adapter"
    adapted.save_pretrained(dirs["adapter"])
    other = make_tokenizer(("Another corpus merges other pairs: zebra quartz 5150 jukebox",))  # other ids
    dirs["other"] = root / "other"
    make_model(len(other), seed=2).save_pretrained(dirs["other"])
    other.save_pretrained(dirs["other"])
    return dirs


def _run(pair, out, *extra):
    cfg = load_config(None, _overrides(pair["student"], out) + ["algo.beta=0", "train.steps=2", "eval.every=0",
                                                               "eval.on_start=false", *extra])
    train(cfg)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if "update/loss" in m], load_file(out / "adapter" / "adapter_model.safetensors")


def test_a_teacher_equal_to_the_student_teaches_nothing_and_a_zero_coefficient_is_plain_grpo(pair, tmp_path):
    steps, adapter = _run(pair, tmp_path / "same", f"distill.teacher={pair['student']}", "distill.reward_weight=0")
    assert [(s["update/distill/reverse_kl"], s["update/grad_norm"]) for s in steps] == [(0.0, 0.0)] * 2
    assert all(not t.any() for name, t in adapter.items() if "lora_B" in name)  # LoRA's B starts at 0: no update
    _, plain = _run(pair, tmp_path / "plain")
    _, mixed = _run(pair, tmp_path / "coef0", f"distill.teacher={pair['teacher']}", "distill.coef=0")
    assert plain.keys() == mixed.keys() and all(torch.allclose(plain[k], mixed[k], atol=1e-6) for k in plain)
    steps, taught = _run(pair, tmp_path / "alone", f"distill.teacher={pair['teacher']}", "distill.reward_weight=0")
    assert all(s["update/distill/reverse_kl"] != 0 and s["update/grad_norm"] > 0 for s in steps)
    assert any(not torch.equal(plain[k], taught[k]) for k in plain)


def _batch(pair, temperature: float) -> StepBatch:
    tok = make_tokenizer()
    tok.padding_side = "left"
    model = load_teacher(str(pair["student"]), "", torch.float32, torch.device("cpu"))
    prompts = ["What is 3 + 4?", "12 * 9 = 108. The answer is"]
    params = SamplingParams(max_new_tokens=8, temperature=temperature)
    groups = sample_tiny(model, tok, [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                              add_generation_prompt=True) for p in prompts],
                         3, params, seed=4, eos_every=7)
    return StepBatch.from_groups(groups, torch.zeros(6), torch.ones(6, dtype=torch.bool))


def test_a_served_teacher_scores_every_token_as_the_in_process_teacher_does(pair, tmp_path):
    """The teacher: the student's base with a LoRA adapter, merged in process, served by rlvr serve as a module."""
    batch = _batch(pair, temperature=0.7)
    rows = micro_batches(batch, 4, skip_zero_advantage=False)
    local = LocalTeacher(load_teacher(str(pair["student"]), str(pair["adapter"]), torch.float32, torch.device("cpu")))
    want = local.logprobs(batch, rows, chunk_tokens=16)
    server = ServerProcess(pair["student"], "--lora-modules", f"taught={pair['adapter']}").wait_ready()
    try:
        client = TeacherClient(server.url + "/v1", "taught", "", timeout_s=60)
        client.check_tokens(str(pair["student"]))  # the same tokenizer: accepted
        got = ServedTeacher(client).logprobs(batch, rows, chunk_tokens=16)
        client.close()
        served, _ = _run(pair, tmp_path / "served", f"distill.url={server.url}", "distill.model=taught",
                         "distill.reward_weight=0")
    finally:
        server.stop()
    here, _ = _run(pair, tmp_path / "here", f"distill.teacher={pair['student']}", f"distill.adapter={pair['adapter']}",
                   "distill.reward_weight=0")
    for a, b in zip(served, here):  # the same training, whichever side of HTTP the teacher is on
        assert a["update/distill/reverse_kl"] != 0
        assert a["update/distill/reverse_kl"] == pytest.approx(b["update/distill/reverse_kl"], abs=1e-6)
    mask = batch.completion_mask.bool()
    assert mask.sum() > 10 and torch.allclose(got[mask], want[mask].float(), atol=1e-4)
    assert not got[~mask].any()
    shifted = torch.roll(want, 1, dims=1)  # an off-by-one alignment would read these instead
    assert not torch.allclose(got[mask], shifted[mask].float(), atol=1e-2)


def test_the_prompt_logprobs_answer_is_read_as_vllm_writes_it():
    answer = {"choices": [{"text": "x", "prompt_logprobs": [
        None, {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}},
        {"9": {"logprob": -0.1, "rank": 1}, "7": {"logprob": -3.0, "rank": 4}},  # the token beyond the top-1
        {"2": {"logprob": -0.25, "rank": 1}}]}]}
    assert token_logprobs(answer, 2, [7, 2]) == [-3.0, -0.25]  # entries 2 and 3: the completion's tokens
    for bad in ({"choices": []}, {"choices": [{"prompt_logprobs": [None, {}]}]},
                {"choices": [{"prompt_logprobs": [None, {}, {"7": {"logprob": 0.5}}, {"2": {"logprob": -1}}]}]},
                {"choices": [{"prompt_logprobs": [None, {}, {"7": {"logprob": "nan"}}, {"2": {"logprob": -1}}]}]},
                {"choices": [{"prompt_logprobs": [None, {}, {"8": {"logprob": -1.0}}, {"2": {"logprob": -1}}]}]}):
        with pytest.raises(MalformedAnswer):
            token_logprobs(bad, 2, [7, 2])


@pytest.mark.parametrize("logprob", [-1e300, -(10 ** 400)])
def test_a_served_log_prob_that_float32_cannot_hold_is_a_malformed_answer_in_one_line(logprob):
    """-1e300 is finite in JSON and -inf in the trainer's float32 (three skipped steps stopped the run); a 401-digit
    integer raised OverflowError. Both are malformed: retried, then the step stops with one line naming the server."""
    answer = {"choices": [{"text": "x", "prompt_logprobs": [None, {"5": {"logprob": -0.5}},
                                                           {"7": {"logprob": logprob}}, {"2": {"logprob": -1}}]}]}
    with pytest.raises(MalformedAnswer, match="no log-prob <= 0 finite in float32 for token 7"):
        token_logprobs(answer, 2, [7, 2])
    server = JudgeServer(default=lambda body: answer)  # any JSON on any route: a teacher that answers this
    try:
        client = TeacherClient(server.url, "m", "", timeout_s=10,
                               policy=RetryPolicy(attempts=2, backoff_s=0.0, errors=(MalformedAnswer,)))
        with pytest.raises(TeacherError) as caught:
            client.score([([1, 5], [7, 2], 1.0)])
        client.close()
    finally:
        server.close()
    assert "\n" not in str(caught.value) and "finite in float32" in str(caught.value)
    assert "after 2 attempt(s)" in str(caught.value) and len(server.requests) == 2


def test_a_teacher_of_another_tokenizer_is_refused_in_one_line(pair, tmp_path):
    cfg = load_config(None, _overrides(pair["student"], tmp_path) + [f"distill.teacher={pair['other']}"])
    with pytest.raises(ValueError, match="cannot score the student's tokens: its tokenizer's vocabulary differs"):
        build_teacher(cfg, torch.device("cpu"))
    server = ServerProcess(pair["other"]).wait_ready()
    try:
        client = TeacherClient(server.url, "", "", timeout_s=60)
        with pytest.raises(TeacherError, match="its vocabulary differs|its tokenizer differs"):
            client.check_tokens(str(pair["student"]))
        client.close()
    finally:
        server.stop()


def test_distillation_settings_that_would_mislead_are_refused(pair, tmp_path):
    base = _overrides(pair["student"], tmp_path) + [f"distill.teacher={pair['teacher']}"]
    for extra, message in ((["algo.preset=dapo"], "dynamic_sampling"), (["rollout.top_p=0.9"], "top_p=1"),
                           (["algo.name=ppo", "algo.preset=ppo", "algo.beta=0"], "GRPO preset"),
                           (["distill.url=http://127.0.0.1:1"], "exclude each other")):
        with pytest.raises((ConfigError, ValueError), match=message):
            load_config(None, base + extra)


def test_the_chunked_jsd_equals_a_naive_one_with_whole_logits_and_its_gradient(pair):
    from rlvr.learn.distill import divergence_sum

    batch = _batch(pair, temperature=0.7)
    student = load_teacher(str(pair["student"]), "", torch.float64, torch.device("cpu")).requires_grad_(True)
    teacher = load_teacher(str(pair["teacher"]), "", torch.float64, torch.device("cpu"))
    rows = torch.arange(batch.num_completions)
    got = divergence_sum(student, LocalTeacher(teacher), batch, batch, rows, beta=0.3, chunk=3)
    (grad,) = torch.autograd.grad(got, [student.model.embed_tokens.weight])
    want = torch.zeros((), dtype=torch.float64)
    for i in range(batch.num_completions):  # each sequence alone, unpadded, through the models' own forward
        g = i // batch.group_size
        prompt = batch.prompt_ids[g][batch.prompt_mask[g].bool()]
        n = int(batch.completion_mask[i].sum())
        ids = torch.cat([prompt, batch.completion_ids[i, :n]])[None]
        span = slice(len(prompt) - 1, len(prompt) + n - 1)  # the positions that predict the completion's tokens
        s, t = student(ids).logits[0, span] / 0.7, teacher(ids).logits[0, span].detach() / 0.7
        want = want + generalized_jsd(s, t, 0.3)[batch.loss_mask[i, :n].bool()].sum()
    (want_grad,) = torch.autograd.grad(want, [student.model.embed_tokens.weight])
    assert float(want.detach()) > 0 and torch.allclose(got, want, rtol=1e-6, atol=0)
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert float(divergence_sum(teacher, LocalTeacher(teacher), batch, batch, rows, 0.3, 4)) == \
        pytest.approx(0.0, abs=1e-12)


def test_the_jsd_objective_trains_and_an_equal_teacher_teaches_nothing(pair, tmp_path):
    steps, adapter = _run(pair, tmp_path / "same", f"distill.teacher={pair['student']}", "distill.reward_weight=0",
                          "distill.objective=jsd", "distill.beta=0.5")
    assert all(s["update/distill/jsd"] == pytest.approx(0.0, abs=1e-9) for s in steps)
    assert all(float(t.abs().max()) < 1e-6 for name, t in adapter.items() if "lora_B" in name)
    steps, _ = _run(pair, tmp_path / "taught", f"distill.teacher={pair['teacher']}", "distill.reward_weight=0",
                    "distill.objective=jsd")
    assert all(s["update/distill/jsd"] > 0 and s["update/grad_norm"] > 0 for s in steps)


def test_the_jsd_is_trls_gkd_loss_at_every_beta():
    trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    torch.manual_seed(3)
    s, t = torch.randn(2, 4, 11, dtype=torch.float64), torch.randn(2, 4, 11, dtype=torch.float64)
    labels = torch.tensor([[1, 2, -100, 3], [4, -100, -100, 5]])
    for beta in (0.0, 0.3, 0.5, 1.0):
        theirs = trl_gkd.GKDTrainer.generalized_jsd_loss(s, t, labels, beta=beta, temperature=0.8, reduction="sum")
        ours = generalized_jsd(s[labels != -100] / 0.8, t[labels != -100] / 0.8, beta).sum()
        assert torch.allclose(ours, theirs, rtol=1e-12)


def test_trls_distillation_trainer_names_train_rlvrs_jsd_objective(pair, tmp_path):
    import rlvr

    args = rlvr.DistillationConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                                   max_completion_length=6, learning_rate=1e-2, beta=0.5, temperature=0.9)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 4?"}]} for i in range(8)]
    trainer = rlvr.DistillationTrainer(str(pair["student"]), str(pair["teacher"]), args=args, train_dataset=rows)
    cfg = trainer.rlvr_config
    assert (cfg.distill.teacher, cfg.distill.objective, cfg.distill.beta, cfg.distill.reward_weight) == \
        (str(pair["teacher"]), "jsd", 0.5, 0.0)
    assert (cfg.rollout.group_size, cfg.train.prompts_per_step, cfg.algo.beta, cfg.rollout.temperature) == \
        (1, 4, 0.0, 0.9)
    assert args.teacher_model_name_or_path is None  # the caller's config is left as given
    out = trainer.train()
    steps = [r for r in trainer.state.log_history if "update/distill/jsd" in r]
    assert out.metrics["steps"] == 2 and len(steps) == 2 and all(r["update/distill/jsd"] > 0 for r in steps)
    for bad, error, message in (({"loss_type": "dapo"}, TypeError, "'loss_type' .a GRPOConfig field"),
                                ({"beta": 1.5}, ValueError, r"beta=1.5: must be in \[0, 1\]"),
                                ({"teacher_model_revision": "main"}, ValueError, "teacher_model_revision")):
        with pytest.raises(error, match=message):
            rlvr.DistillationConfig(**bad)
    with pytest.raises(ValueError, match="pass teacher_model"):
        rlvr.DistillationTrainer(str(pair["student"]), args=rlvr.DistillationConfig(), train_dataset=rows)


def test_self_distillation_the_teacher_is_the_base_reading_a_hint_the_student_never_sees(pair, tmp_path):
    from rlvr.learn.distill import hinted_prompt

    row = {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "6 + 5 ="}], "answer": "11"}
    assert hinted_prompt(row, "The answer is {answer}.", 0)[-1] == {"role": "user",
                                                                    "content": "6 + 5 =\n\nThe answer is 11."}
    assert row["prompt"][-1]["content"] == "6 + 5 ="  # the student's row is left as it was
    assert hinted_prompt({"prompt": "Q: 2 + 2?"}, "({prompt})", 3) == "Q: 2 + 2?\n\n(Q: 2 + 2?)"
    with pytest.raises(ValueError, match="cannot be formatted with row 7"):
        hinted_prompt(row, "The answer is {gold}.", 7)
    # no hint: the teacher is the student's starting weights, so it teaches nothing
    steps, adapter = _run(pair, tmp_path / "plain", "distill.teacher=self", "distill.reward_weight=0")
    assert [s["update/distill/reverse_kl"] for s in steps] == [0.0, 0.0]
    assert all(not t.any() for name, t in adapter.items() if "lora_B" in name)
    steps, _ = _run(pair, tmp_path / "hinted", "distill.teacher=self", "distill.reward_weight=0",
                    "distill.hint=The answer is {answer}.")
    assert all(s["update/distill/reverse_kl"] != 0 and s["update/grad_norm"] > 0 for s in steps)
    steps, _ = _run(pair, tmp_path / "jsd", "distill.teacher=self", "distill.reward_weight=0", "distill.objective=jsd",
                    "distill.hint=The answer is {answer}.")
    assert all(s["update/distill/jsd"] > 0 for s in steps)
    with pytest.raises(ConfigError, match="model.lora=true"):
        load_config(None, _overrides(pair["student"], tmp_path, lora=False) + ["distill.teacher=self"])
