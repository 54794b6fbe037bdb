"""What a rollout server's /v1/completions answer must be, and the Groups built from validated answers. Nothing a
server answers is trusted: an answer is validated (``parse_completions``: n choices with indices 0..n-1 each
once, token ids in the vocabulary, one finite log-prob <= 0 per token, no more tokens than asked, a known finish
reason) before anything is built from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlvr.models.prompts import left_pad
from rlvr.platform.numbers import finite_float32
from rlvr.rollout.groups import Groups
from rlvr.rollout.http_client import show
from rlvr.rollout.server_errors import MalformedAnswer

LOGP_ROUNDING = 1e-4
"""A log-prob up to this far above 0 is accepted as float rounding of a probability-1 token (log-softmax in fp32
of a dominant logit) and stored as 0; anything higher is malformed (it would make p > 1)."""
LOGP_FLOOR = -1000.0
"""A sampled token's log-prob below this is malformed: no float format holds a probability under e^-745, so such
a token was not drawn from the distribution the log-prob claims."""
FINISH_REASONS = ("stop", "length")


@dataclass
class ServerChoice:
    """One validated choice of a /v1/completions answer."""

    token_ids: list[int]
    logprobs: list[float]  # one per token, finite, <= 0
    truncated: bool  # finish_reason == "length"


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_completions(answer: object, n: int, max_tokens: int | None, vocab_size: int) -> list[ServerChoice]:
    """The n choices of a /v1/completions answer for one prompt, in index order, or ``MalformedAnswer`` saying
    what is wrong: exactly n choices with indices 0..n-1 each once; per choice 1..max_tokens token ids, each in
    [0, vocab_size); exactly one log-prob per token, each a finite number in [LOGP_FLOOR, 0] (up to
    LOGP_ROUNDING above 0 is rounding, stored as 0); finish_reason stop or length. The server's text is not
    used (the learner decodes the token ids itself)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        raise MalformedAnswer("no list of choices")
    if len(choices) != n:
        raise MalformedAnswer(f"{len(choices)} choices for n = {n}")
    out: list[ServerChoice | None] = [None] * n
    for c in choices:
        i = c.get("index") if isinstance(c, dict) else None
        if not is_int(i) or not 0 <= i < n:
            raise MalformedAnswer(f"a choice index {show(i)} outside 0..{n - 1}")
        if out[i] is not None:
            raise MalformedAnswer(f"choice index {i} appears twice")
        out[i] = _parse_choice(c, i, max_tokens, vocab_size)
    return out


def _parse_choice(c: dict, i: int, max_tokens: int | None, vocab_size: int) -> ServerChoice:
    ids, lp = c.get("token_ids"), c.get("logprobs")
    logps = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if ids is None or logps is None:
        raise MalformedAnswer(f"choice {i} has no token ids or log-probs (the server must support return_token_ids "
                              "and logprobs: rlvr serve, or vLLM >= 0.10)")
    if not isinstance(ids, list) or not isinstance(logps, list):
        raise MalformedAnswer(f"choice {i}: token ids or log-probs that are not lists")
    if not ids:
        raise MalformedAnswer(f"choice {i} has no tokens")
    if max_tokens is not None and len(ids) > max_tokens:
        raise MalformedAnswer(f"choice {i} has {len(ids)} tokens, more than max_tokens = {max_tokens}")
    if len(logps) != len(ids):
        raise MalformedAnswer(f"choice {i} has {len(logps)} log-probs for {len(ids)} tokens")
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise MalformedAnswer(f"choice {i}: token id {show(t)} outside the vocabulary (0..{vocab_size - 1})")
    clean = []
    for x in logps:
        value = finite_float32(x)
        if value is None or not LOGP_FLOOR <= value <= LOGP_ROUNDING:
            raise MalformedAnswer(f"choice {i}: log-prob {show(x)} is not a finite number in [{LOGP_FLOOR:g}, 0]")
        clean.append(min(value, 0.0))
    reason = c.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise MalformedAnswer(f"choice {i}: finish_reason {show(reason)} is not one of {', '.join(FINISH_REASONS)}")
    return ServerChoice(list(ids), clean, reason == "length")


def choices_to_ask(n: int, temperature: float) -> int:
    """How many choices to request for ``n`` completions of one prompt: one when decoding is greedy (vLLM refuses
    n > 1 without sampling, and the n would be equal), repeated by ``parse_group``."""
    return 1 if temperature == 0 else n


def parse_group(answer: object, n: int, temperature: float, max_tokens: int | None,
                vocab_size: int) -> list[ServerChoice]:
    """The ``n`` choices of an answer to a request for ``choices_to_ask(n, temperature)`` (``parse_completions``)."""
    asked = choices_to_ask(n, temperature)
    return parse_completions(answer, asked, max_tokens, vocab_size) * (n // asked)


def groups_from_completions(answers: list[dict], prompt_ids: list[list[int]], group_size: int, tokenizer,
                            version: int, temperature: float, max_tokens: int | None = None,
                            vocab: int | None = None) -> Groups:
    """Groups from /v1/completions answers (one per prompt, n = group_size choices each, with token ids and
    log-probs), each validated by ``parse_completions`` (``vocab`` defaults to the tokenizer's length)."""
    vocab = vocab or len(tokenizer)
    parsed = [parse_completions(a, group_size, max_tokens, vocab) for a in answers]
    return groups_of(parsed, prompt_ids, group_size, tokenizer, version, temperature)


def groups_of(answers: list[list[ServerChoice]], prompt_ids: list[list[int]], group_size: int, tokenizer,
              version: int, temperature: float) -> Groups:
    """Groups from validated answers: one list of ``group_size`` choices per prompt, every tensor on the CPU (made
    there explicitly, so a trainer whose model is on a GPU gets CPU groups too)."""
    completions = [c for answer in answers for c in answer]
    n, width = len(completions), max((len(c.token_ids) for c in completions), default=0)
    completion_ids = torch.zeros(n, width, dtype=torch.long, device="cpu")  # a server's answer: CPU bookkeeping
    behaviour = torch.zeros(n, width, device="cpu")
    mask = torch.zeros(n, width, dtype=torch.long, device="cpu")
    for r, c in enumerate(completions):
        completion_ids[r, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long, device="cpu")
        behaviour[r, : len(c.logprobs)] = torch.tensor(c.logprobs, device="cpu")
        mask[r, : len(c.token_ids)] = 1
    ids, pmask = left_pad(prompt_ids, tokenizer.pad_token_id)
    return Groups(
        prompt_ids=ids, prompt_mask=pmask, completion_ids=completion_ids, completion_mask=mask,
        behaviour_logp=behaviour,
        truncated=torch.tensor([c.truncated for c in completions], dtype=torch.bool, device="cpu"),
        texts=tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True),
        group_size=group_size, version=torch.full((n,), version, dtype=torch.long, device="cpu"),
        temperature=torch.full((n,), float(temperature), device="cpu"),
    )
