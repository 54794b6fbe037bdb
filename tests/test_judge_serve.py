"""The logprob judge against a real `rlvr serve` of SmolLM2-135M-Instruct on loopback: its score of each reply is the
expected value over the scale that a naive in-process reference computes from the same model's next-token
distribution (the chat template applied by hand, one forward pass per question)."""

from __future__ import annotations

import pytest
import torch

from rlvr.rewards.judge import expected_score, judge, scale_labels
from tests.serving import ServerProcess

pytestmark = pytest.mark.slow


FEW_SHOT = ("Text: What a lovely surprise, thank you so much!\nTone: warm\n\n"
            "Text: I don't care, figure it out yourself.\nTone: cold\n\n"
            "Text: You've got this, I'm proud of you.\nTone: warm\n\n"
            "Text: That was a stupid thing to do.\nTone: cold\n\n"
            "Text: {completion}\nTone:")


def _reference(model, tokenizer, body: dict, labels: dict, lo: float, hi: float, min_mass: float) -> float | None:
    """The first token's top 20 (token text, log-prob) at temperature 1, and the expected score over them."""
    if "messages" in body:
        text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(body["prompt"], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logp = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)  # [V]
    top = torch.topk(logp, 20)
    pairs = [(tokenizer.decode([int(i)]), float(v)) for v, i in zip(top.values, top.indices)]
    return expected_score(pairs, labels, lo, hi, min_mass)


@pytest.mark.long
def test_the_logprob_judge_reads_what_the_model_says(tmp_path):
    """A few-shot base-model judge through /v1/completions (labels warm / cold), and a chat judge on a 1-5 scale."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlvr.models.policy import resolve_model_dir

    model_dir = resolve_model_dir("smollm2-135m-instruct")
    server = ServerProcess(model_dir, "--dtype", "fp32", "--precision", "fp32", "--served-model-name", "j")
    prompts = ["My bus was cancelled so I walked to work in the rain."] * 3
    replies = ["Oh no, that sounds rough! I hope the rest of your day is lovely.", "Whatever. Buses get cancelled.",
               "I hate rain. Walking in it is awful and miserable."]
    try:
        server.wait_ready(120)
        few_shot = judge("j", f"{server.url}/v1", api="completions", template=FEW_SHOT, answer="logprobs",
                         labels={"warm": 1, "cold": 0}, min_mass=0.1)
        chat = judge("j", f"{server.url}/v1", rubric="How kind the reply is.", scale=[1, 5], answer="logprobs",
                     min_mass=0.05)
        scores = {"few_shot": few_shot(prompts, replies), "chat": chat(prompts, replies)}
        bodies = {name: [fn._body(fn._single(p, r, {})) for p, r in zip(prompts, replies)]
                  for name, fn in (("few_shot", few_shot), ("chat", chat))}
        few_shot.close()
        chat.close()
    finally:
        server.stop()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = {"few_shot": [_reference(model, tokenizer, b, {"warm": 1, "cold": 0}, 0, 1, 0.1)
                             for b in bodies["few_shot"]],
                "chat": [_reference(model, tokenizer, b, scale_labels(1, 5), 1, 5, 0.05) for b in bodies["chat"]]}
    for name, values in expected.items():
        assert all(e is not None for e in values), name
        assert scores[name] == [pytest.approx(e, abs=1e-3) for e in values], name
    assert scores["few_shot"][0] > max(scores["few_shot"][1:])  # the warm reply is told apart
    prompt = bodies["few_shot"][0]["prompt"]
    assert prompt.startswith("Text: What a lovely") and "<response-" in prompt
