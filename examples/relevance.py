"""examples/judge.yaml's second measure of "is the reply about the message" that training never sees: how much the
message explains the reply under another model - the mean over the reply's tokens of
log p(token | the message) - log p(token | a neutral message), by the policy's base model, untrained (a different
family from the Gemma judge and from the sentence encoder the reward uses). A reply that answers this message gains
from it; a platitude that would fit any message, or a reply about something else, gains nothing.

- ``message_gain``: that mean, in nats per token (None for an empty reply).
- ``about_the_message``: 1.0 when the gain is at least ``GAIN`` nats per token, else 0.0: a rate.
"""

from __future__ import annotations

import functools

import torch

from rlvr.rewards.base import completion_text
from rlvr.rewards.judge import prompt_text

MODEL = "smollm2-135m-instruct"
SYSTEM = "Reply to the message in one or two sentences."
NEUTRAL = "Hello."
GAIN = 0.2  # nats per token


@functools.cache
def _model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlvr.models.policy import resolve_model_dir

    path = resolve_model_dir(MODEL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    return AutoTokenizer.from_pretrained(path), model


def _mean_logprobs(tok, model, messages: list[str], replies: list[str]) -> list[float]:
    """Mean log p(reply's tokens | the chat with its message) under the base model, 16 rows a forward."""
    out = []
    for start in range(0, len(replies), 16):
        rows = []
        for message, reply in zip(messages[start:start + 16], replies[start:start + 16]):
            prompt = tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": message}],
                                             tokenize=False, add_generation_prompt=True)
            head = tok(prompt, add_special_tokens=False)["input_ids"]
            rows.append((head, tok(reply, add_special_tokens=False)["input_ids"][:96]))
        width = max(len(h) + len(b) for h, b in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long, device="cpu")  # [n, T], right-padded
        mask = torch.zeros((len(rows), width), dtype=torch.long, device="cpu")  # [n, T]
        for i, (h, b) in enumerate(rows):
            ids[i, :len(h) + len(b)] = torch.tensor(h + b, dtype=torch.long, device="cpu")
            mask[i, :len(h) + len(b)] = 1
        with torch.inference_mode():
            logp = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)  # [n, T, V]
        for i, (h, b) in enumerate(rows):
            picked = logp[i, len(h) - 1:len(h) + len(b) - 1].gather(-1, ids[i, len(h):len(h) + len(b), None])
            out.append(picked.mean().item())
    return out


def gains(prompts, completions) -> list[float | None]:
    tok, model = _model()
    replies = [completion_text(c).strip() for c in completions]
    kept = [i for i, r in enumerate(replies) if r]
    said = _mean_logprobs(tok, model, [prompt_text(prompts[i]) for i in kept], [replies[i] for i in kept])
    neutral = _mean_logprobs(tok, model, [NEUTRAL] * len(kept), [replies[i] for i in kept])
    out: list[float | None] = [None] * len(replies)
    for i, a, b in zip(kept, said, neutral):
        out[i] = a - b
    return out


def message_gain(prompts, completions, **_) -> list[float | None]:
    return gains(prompts, completions)


def about_the_message(prompts, completions, **_) -> list[float | None]:
    return [None if g is None else float(g >= GAIN) for g in gains(prompts, completions)]
