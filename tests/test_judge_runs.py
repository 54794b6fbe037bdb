"""A judge in real runs on the tiny model: the synchronous loop and the asynchronous runtime score every completion
through a judge endpoint on loopback (tests/judge_server.py: len(text) % 11 on [0, 10]), samples.jsonl holds those
scores, and the steps' metrics count the judge's calls under judge/."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from rlvr.config.loading import load_config
from rlvr.launch import train
from rlvr.run.eval_only import evaluate_model
from rlvr.run.resume_checks import ResumeError
from tests.judge_server import JudgeServer, length_score
from tests.test_async import ASYNC
from tests.test_e2e import _overrides
from tests.test_security_resume import rewrite


def _judged_run(model_dir, out, url: str, *extra: str) -> tuple[list[dict], list[dict]]:
    rewards = (f"rewards=[{{name: judge, model: m, kwargs: {{base_url: '{url}', backoff_s: 0.01}}}}, "
               "{name: 'tests.helpers:length_reward', weight: 0.0}]")
    cfg = load_config(None, [*_overrides(model_dir, out), rewards, "log.samples=true", *extra])
    train(cfg)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return samples, metrics


@pytest.mark.parametrize("runtime", ["sync", pytest.param("async", marks=pytest.mark.long)])
def test_a_run_is_rewarded_by_the_judge(tiny_model_dir, tmp_path, runtime):
    server = JudgeServer()
    server.script.extend([("status", 503)] * 2)  # the first question (check_rewards' placeholder) retried twice
    try:
        extra = [*ASYNC, "train.steps=3"] if runtime == "async" else ["eval.every=0"]
        samples, metrics = _judged_run(tiny_model_dir, tmp_path / "run", server.url, *extra)
    finally:
        server.close()
    assert samples and all(s["rewards"]["judge"] == pytest.approx((len(s["text"]) % 11) / 10, abs=1e-6)
                           for s in samples)
    assert all(s["reward"] == pytest.approx(s["rewards"]["judge"], abs=1e-6) for s in samples)  # weight 1 and 0
    steps = [m for m in metrics if "judge/calls" in m]
    assert len(steps) == 3
    asked = sum(m["judge/calls"] + m["judge/cache_hits"] for m in steps)
    assert asked >= len(samples) and sum(m["judge/retries"] for m in steps) == 2
    assert all(m["judge/failures"] == 0 for m in steps)


def test_a_resumed_run_keeps_the_judges_answers(tiny_model_dir, tmp_path):
    """The checkpoint holds the judge's cache: resumed from it, the run does not ask again what it asked before
    (held-out replies that did not change: lr 1e-12); the same resume without the cache asks more."""
    import shutil

    out = tmp_path / "run"
    server = JudgeServer()
    try:
        _judged_run(tiny_model_dir, out, server.url, "train.steps=2", "train.checkpoint_every=1", "train.lr=1e-12",
                    "eval.every=1")
        state_path = out / "checkpoints" / "step-00000002" / "state.json"
        cached = json.loads(state_path.read_text())["judge_cache"]["reward/judge"]
        assert len(cached) >= 6 and all(len(k) == 64 and 0 <= v <= 1 for k, v in cached)
        asked = {}
        for keep in (True, False):
            run = tmp_path / f"resumed-{keep}"
            shutil.copytree(out, run)
            if not keep:
                path = run / "checkpoints" / "step-00000002" / "state.json"
                state = json.loads(path.read_text())
                del state["judge_cache"]
                path.write_text(json.dumps(state))
            server.requests.clear()
            _judged_run(tiny_model_dir, run, server.url, "train.steps=3", "train.lr=1e-12", "eval.every=1",
                        "resume=auto")
            asked[keep] = len(server.requests)
    finally:
        server.close()
    assert asked[True] + 6 <= asked[False]  # at least the 6 held-out replies, asked again without the cache
    # a score no float holds (before: OverflowError out of the check, a traceback) is the one-line refusal
    run = tmp_path / "resumed-big"
    shutil.copytree(out, run)
    path = run / "checkpoints" / "step-00000002" / "state.json"
    state = json.loads(path.read_text())
    state["judge_cache"]["reward/judge"][0][1] = 10 ** 400
    rewrite(path.parent, "state.json", json.dumps(state))  # its manifest too: else the resume takes step 1
    with pytest.raises(ResumeError) as caught:
        _judged_run(tiny_model_dir, run, "http://127.0.0.1:9/v1", "train.steps=3", "resume=auto")
    assert "\n" not in str(caught.value) and "state.json field 'judge_cache'" in str(caught.value)


def test_a_judge_as_an_evaluation_metric(tiny_model_dir, tmp_path):
    """eval.metrics takes a judge like any reward: logged as eval/metric/judge at every evaluation; asked the same
    questions as the run's own judge on the same held-out replies, it gives the same mean. The judge fails every
    question of a third of the hashes (400, not retried): every request the server saw is counted
    once, by the steps (judge/) or the evaluations (eval/judge/) - before, the evaluations' calls were counted by the
    next step or, after the last step, by nothing."""
    def failing(body):  # the same questions for both judges (their tags' nonces aside)
        question = re.sub(r"response-\w+", "", body["messages"][-1]["content"])
        return hashlib.sha256(question.encode()).digest()[0] % 3 == 0

    def flaky(body):
        return ("status", 400) if failing(body) else length_score(body)

    server = JudgeServer(flaky)
    try:
        metric = f"eval.metrics=[{{name: judge, model: m, kwargs: {{base_url: '{server.url}', backoff_s: 0.01}}}}]"
        _, metrics = _judged_run(tiny_model_dir, tmp_path / "run", server.url, metric, "eval.every=1",
                                 "train.steps=2")
        seen = len(server.requests)
        after = evaluate_model(load_config(tmp_path / "run" / "config.yaml"), tmp_path / "run", against_base=True)
        asked = server.requests[seen:]  # rlvr eval: the trained model's replies, then the base model's
    finally:
        server.close()
    assert after["eval/judge/calls"] + after["base"]["eval/judge/calls"] == len(asked) > 0
    assert after["eval/judge/failures"] + after["base"]["eval/judge/failures"] == sum(map(failing, asked))
    evals = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 1, 2]
    for m in evals:
        assert 0 <= m["eval/metric/judge"] <= 1
        assert m["eval/metric/judge"] == pytest.approx(m["eval/reward/judge"], abs=1e-6)
    counted = sum(m.get("judge/calls", 0) + m.get("eval/judge/calls", 0) for m in metrics)
    assert counted == seen
    assert sum(m.get("judge/failures", 0) + m.get("eval/judge/failures", 0) for m in metrics) == \
        sum(map(failing, server.requests[:seen])) > 0
    assert any(m["eval/judge/failures"] for m in evals)
