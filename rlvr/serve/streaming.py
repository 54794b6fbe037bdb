"""``stream=true`` on the generation routes, as vLLM answers it: server-sent events, one ``data: {chunk}`` per token
of each choice (``text_completion`` chunks, or ``chat.completion.chunk`` ones whose first delta carries the role),
the finish reason on each choice's last chunk, with ``stream_options.include_usage`` a last chunk holding only the
usage, then ``data: [DONE]``.

Where it departs from vLLM: rlvr serve decodes requests in batches, so the chunks are sent once the whole answer is
ready (the client gets the same events, later). The chunks' texts joined are exactly the text of the answer without
``stream``; each token's log-probs and id ride on its own chunk."""

from __future__ import annotations

import json

from fastapi.responses import StreamingResponse


def pieces(text: str, lengths: list[int]) -> list[str]:
    """``text`` cut into one piece per token, each as long as that token's own text; the last takes the rest (so the
    pieces always join to ``text``, whatever a stop string cut or a multi-byte character spread across tokens)."""
    out, at = [], 0
    for i, n in enumerate(lengths):
        end = len(text) if i == len(lengths) - 1 else min(at + n, len(text))
        out.append(text[at:end])
        at = end
    return out or [text]


def _events(chunks: list[dict]) -> StreamingResponse:
    lines = [f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n" for chunk in chunks] + ["data: [DONE]\n\n"]
    return StreamingResponse(iter(lines), media_type="text/event-stream")


def _head(body: dict, kind: str) -> dict:
    return {"id": body["id"], "object": kind, "created": body["created"], "model": body["model"]}


def _logprobs_at(logprobs: dict, i: int) -> dict:
    """Token i's slice of /v1/completions' ``logprobs`` (lists of one)."""
    return {key: values[i : i + 1] for key, values in logprobs.items()}


def completion_stream(body: dict, lengths: list[list[int]], include_usage: bool) -> StreamingResponse:
    """``body`` (the answer without ``stream``) as text_completion chunks; ``lengths[k]``: choice k's token text
    lengths."""
    head, chunks = _head(body, "text_completion"), []
    for choice, token_lengths in zip(body["choices"], lengths):
        texts = pieces(choice["text"], token_lengths)
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            part = {"index": choice["index"], "text": text, "logprobs": None,
                    "finish_reason": choice["finish_reason"] if last else None,
                    "stop_reason": choice["stop_reason"] if last else None}
            if choice["logprobs"] is not None and i < len(token_lengths):
                part["logprobs"] = _logprobs_at(choice["logprobs"], i)
            if "token_ids" in choice:
                part["token_ids"] = choice["token_ids"][i : i + 1]
                if i == 0:
                    part["prompt_token_ids"] = choice["prompt_token_ids"]
            chunks.append({**head, "choices": [part]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return _events(chunks)


def chat_stream(body: dict, lengths: list[list[int]], include_usage: bool) -> StreamingResponse:
    """``body`` (the answer without ``stream``) as chat.completion.chunk chunks: per choice, the role first, then its
    content token by token."""
    head, chunks = _head(body, "chat.completion.chunk"), []
    for choice, token_lengths in zip(body["choices"], lengths):
        chunks.append({**head, "choices": [{"index": choice["index"], "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        texts = pieces(choice["message"]["content"], token_lengths)
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            part = {"index": choice["index"], "delta": {"content": text}, "logprobs": None,
                    "finish_reason": choice["finish_reason"] if last else None,
                    "stop_reason": choice["stop_reason"] if last else None}
            if choice["logprobs"] is not None and i < len(token_lengths):
                part["logprobs"] = {"content": choice["logprobs"]["content"][i : i + 1]}
            if "token_ids" in choice:
                part["token_ids"] = choice["token_ids"][i : i + 1]
            chunks.append({**head, "choices": [part]})
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return _events(chunks)
