"""The generation routes of ``rlvr serve``: POST /v1/completions and POST /v1/chat/completions, vLLM's answers
(token ids, log-probs of the distribution each token was drawn from), whole or streamed (rlvr.serve.streaming)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter

from rlvr.models.prompts import chat_token_ids
from rlvr.rollout.engine import SamplingParams
from rlvr.serve.engine import Generation, Job
from rlvr.serve.errors import Refused
from rlvr.serve.handling import Serving, post_route
from rlvr.serve.request_models import ChatRequest, CompletionRequest, SamplingFields, parse
from rlvr.serve.streaming import chat_stream, completion_stream


def adapter_of(s: Serving, name: str) -> str | None:
    """The adapter a request's ``model`` names; None for the base model (its served name, or its path)."""
    if name in ("", s.served_name, str(s.engine.model_dir)):
        return None
    if name not in s.engine.adapters:
        raise Refused(404, f"The model `{name[:256]}` does not exist.")
    return name


def check_length(s: Serving, text: str) -> None:
    """Refuse (400) a text with more characters than the context can hold whatever they are, before tokenizing it."""
    if len(text) > s.max_chars:
        raise Refused(400, f"This model's maximum context length is {s.engine.max_model_len} tokens; a prompt of "
                           f"{len(text)} characters is longer than that.")


def tokenize(s: Serving, text: str, add_special_tokens: bool = True) -> list[int]:
    check_length(s, text)
    return s.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def sampling(s: Serving, req: SamplingFields, max_tokens: int, prompt_lengths: list[int]) -> SamplingParams:
    longest, context = max(prompt_lengths), s.engine.max_model_len
    if longest + max_tokens > context:
        raise Refused(400, (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion."))
    if min(prompt_lengths) == 0:
        raise Refused(400, "a prompt is empty")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(req.temperature, req.top_p, max(req.top_k, 0), max_tokens, stop)


def text_of(s: Serving, tokens: list[int], stop_reason: str | None, req: SamplingFields) -> str:
    text = s.tokenizer.decode(tokens, skip_special_tokens=req.skip_special_tokens)
    if stop_reason is not None and not req.include_stop_str_in_output:
        text = text[: text.find(stop_reason)] if stop_reason in text else text
    return text


def usage(gens: list[Generation]) -> dict:
    prompt = sum(len(g.prompt_ids) for g in gens)
    completion = sum(len(t) for g in gens for t in g.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def prepare_completion(s: Serving, body: bytes) -> tuple[Job, CompletionRequest]:
    req = parse(CompletionRequest, body)
    adapter = adapter_of(s, req.model)
    p = req.prompt
    if isinstance(p, str):
        prompts = [tokenize(s, p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    else:
        prompts = [tokenize(s, x) if isinstance(x, str) else list(x) for x in p]
    if not prompts:
        raise Refused(400, "prompt must not be empty")
    vocab = len(s.tokenizer)
    if any(not 0 <= t < vocab for ids in prompts for t in ids):
        raise Refused(400, f"prompt token ids must lie in [0, {vocab})")
    params = sampling(s, req, req.max_tokens or 16, [len(x) for x in prompts])
    # held for a later request to extend: one completion of token ids (an episode's turn, as rlvr's pool sends it);
    # a group (n > 1) or a text prompt is single-turn, and holding it would only cost memory
    hold = req.n == 1 and not isinstance(p, str) and all(not isinstance(x, str) for x in p)
    if req.prompt_logprobs is not None:
        hold = False
    return Job(prompts, req.n, params, adapter, req.seed, req.logprobs or 0, hold, req.prompt_logprobs), req


def answer_completion(s: Serving, req: CompletionRequest, gens: list[Generation]) -> dict:
    """The /v1/completions answer. ``prompt_logprobs`` are built once per prompt and sit on its first choice (index
    i * n), null on its other n - 1: vLLM repeats the same list on every choice of a prompt, so an answer grows as
    n x prompt tokens x entries; a client reading ``choices[i * n].prompt_logprobs`` (rlvr's teacher client reads
    choices[0]) gets the same list from both servers."""
    choices = []
    for i, g in enumerate(gens):
        scored = prompt_logprobs_entries(s.tokenizer, g) if req.prompt_logprobs is not None else None
        for j, tokens in enumerate(g.token_ids):
            choice = {"index": i * req.n + j, "text": text_of(s, tokens, g.stop_reason[j], req),
                      "logprobs": None, "finish_reason": g.finish_reason[j], "stop_reason": g.stop_reason[j]}
            if req.logprobs is not None:
                choice["logprobs"] = completion_logprobs(s.tokenizer, tokens, g, j)
            if req.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = g.prompt_ids, tokens
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = scored if j == 0 else None
            choices.append(choice)
    body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or s.served_name, "choices": choices, "usage": usage(gens)}
    if req.stream:
        return completion_stream(body, token_lengths(s, gens), include_usage(req))
    return body


def prepare_chat(s: Serving, body: bytes) -> tuple[Job, ChatRequest]:
    req = parse(ChatRequest, body)
    adapter = adapter_of(s, req.model)
    messages = [m.model_dump() for m in req.messages]
    try:
        text = s.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        check_length(s, text)
        # every content read as text: a special-token string a policy wrote in it is no turn boundary for the judge
        prompt = chat_token_ids(s.tokenizer, messages, add_generation_prompt=True)
    except Refused:
        raise
    except Exception as err:  # noqa: BLE001 (a template that rejects the messages is a bad request)
        raise Refused(400, f"the chat template rejected the messages: {str(err)[:300]}") from None
    max_tokens = req.max_completion_tokens or req.max_tokens or s.engine.max_model_len - len(prompt)
    params = sampling(s, req, max_tokens, [len(prompt)])
    k = (req.top_logprobs or 0) if req.logprobs else 0
    return Job([prompt], req.n, params, adapter, req.seed, k), req


def answer_chat(s: Serving, req: ChatRequest, gens: list[Generation]) -> dict:
    (g,) = gens
    choices = []
    for j, tokens in enumerate(g.token_ids):
        choice = {"index": j, "message": {"role": "assistant", "content": text_of(s, tokens, g.stop_reason[j], req)},
                  "logprobs": chat_logprobs(s.tokenizer, tokens, g, j) if req.logprobs else None,
                  "finish_reason": g.finish_reason[j], "stop_reason": g.stop_reason[j]}
        if req.return_token_ids:
            choice["token_ids"] = tokens
        choices.append(choice)
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or s.served_name, "choices": choices, "usage": usage([g])}
    if req.stream:
        return chat_stream(body, token_lengths(s, gens), include_usage(req))
    if req.return_token_ids:
        body["prompt_token_ids"] = g.prompt_ids
    return body


def token_lengths(s: Serving, gens: list[Generation]) -> list[list[int]]:
    """Per choice, in answer order, the length of each token's own text (where stream chunks cut the text)."""
    return [[len(_piece(s.tokenizer, t)) for t in tokens] for g in gens for tokens in g.token_ids]


def include_usage(req: SamplingFields) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _piece(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def completion_logprobs(tok, tokens: list[int], g: Generation, j: int) -> dict:
    """/v1/completions' ``logprobs`` of completion j of ``g``: offsets, pieces, log-probs, the top ones."""
    pieces = [_piece(tok, t) for t in tokens]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    # as vLLM: the sampled token, then the k most likely ones (fewer entries when two share a text)
    top = [{piece: lp} for piece, lp in zip(pieces, g.logprobs[j])]
    if g.top_logprobs is not None:
        for entry, step in zip(top, g.top_logprobs[j]):
            entry.update({_piece(tok, t): lp for t, lp in step if _piece(tok, t) not in entry})
    return {"text_offset": offsets, "token_logprobs": g.logprobs[j], "tokens": pieces, "top_logprobs": top}


def prompt_logprobs_entries(tok, g: Generation) -> list:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token ``{id: {"logprob", "rank",
    "decoded_token"}}`` for the token itself and the k most likely ones (ids as strings)."""
    entries: list = [None]
    for token, (logp, rank, top) in zip(g.prompt_ids[1:], g.prompt_logprobs or []):
        entry = {str(token): {"logprob": logp, "rank": rank, "decoded_token": _piece(tok, token)}}
        for r, (other, lp) in enumerate(top, start=1):
            entry.setdefault(str(other), {"logprob": lp, "rank": r, "decoded_token": _piece(tok, other)})
        entries.append(entry)
    return entries


def chat_logprobs(tok, tokens: list[int], g: Generation, j: int) -> dict:
    """/v1/chat/completions' ``logprobs`` of completion j of ``g``: per token, its log-prob and the top ones."""
    content = []
    for t, token in enumerate(tokens):
        piece = _piece(tok, token)
        top = [] if g.top_logprobs is None else [
            {"token": _piece(tok, i), "logprob": lp, "bytes": list(_piece(tok, i).encode())}
            for i, lp in g.top_logprobs[j][t]]
        content.append({"token": piece, "logprob": g.logprobs[j][t], "bytes": list(piece.encode()),
                        "top_logprobs": top})
    return {"content": content}


router = APIRouter()
post_route(router, "/v1/completions", prepare_completion, answer_completion)
post_route(router, "/v1/chat/completions", prepare_chat, answer_chat)
