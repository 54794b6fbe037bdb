"""``POST /classify`` of ``rlvr serve`` serving a sequence-classification model (a reward model), as vLLM 0.32 answers
it, and the refusals that tell a client it asked the wrong kind of server.

A request holds ``input`` (a text, texts, token ids, or lists of token ids; special tokens added unless
``add_special_tokens`` is false) or ``messages`` (one conversation, rendered by the model's chat template with
``add_generation_prompt`` false unless asked, no special tokens added); ``use_activation`` (default: the model's
activation, a sigmoid for one label; false: the raw scores); ``truncate_prompt_tokens`` (-1: the context) with
``truncation_side`` (left keeps the last tokens; default: the tokenizer's side). Without truncation a text longer
than the context is refused. The answer: ``{"id", "object": "list", "created", "model", "data": [{"index",
"label", "probs", "num_classes"}], "usage"}``. Unknown fields are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from rlvr.models.prompts import chat_token_ids, defused_messages
from rlvr.serve.classify_engine import ClassifyJob, activate
from rlvr.serve.errors import Refused, error
from rlvr.serve.handling import Serving, post_route
from rlvr.serve.request_models import ChatMessage, parse

router = APIRouter()  # a classifier's server
MAX_INPUTS = 4096


class ClassifyFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, max_length=4096)
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None


class ClassifyInputRequest(ClassifyFields):
    input: str | Annotated[list[str], Field(max_length=MAX_INPUTS)] | Annotated[list[int], Field(max_length=1 << 20)] \
        | Annotated[list[list[int]], Field(max_length=MAX_INPUTS)]
    add_special_tokens: bool = True


class ClassifyChatRequest(ClassifyFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_INPUTS)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False


def request_of(body: bytes) -> ClassifyInputRequest | ClassifyChatRequest:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise Refused(400, "JSON decode error: the body is not valid JSON") from None
    chat = isinstance(data, dict) and "messages" in data
    return parse(ClassifyChatRequest if chat else ClassifyInputRequest, body)


def truncated(s: Serving, req: ClassifyFields, ids: list[int]) -> list[int]:
    """``ids`` truncated as asked; refused when empty, or too long without truncation."""
    context, keep = s.engine.max_model_len, req.truncate_prompt_tokens
    if keep is not None and keep > context:
        raise Refused(400, f"truncate_prompt_tokens {keep} is greater than max_model_len {context}; request a "
                           "smaller truncation size")
    if keep is not None:
        keep = context if keep == -1 else keep
        side = req.truncation_side or s.tokenizer.truncation_side
        ids = ids[len(ids) - keep:] if side == "left" and len(ids) > keep else ids[:keep]
    if len(ids) > context:
        raise Refused(400, f"This model's maximum context length is {context} tokens. However, a text has "
                           f"{len(ids)} tokens; shorten it or set truncate_prompt_tokens.")
    if not ids:
        raise Refused(400, "a text is empty (no tokens to classify)")
    return ids


def chat_row(s: Serving, req: ClassifyChatRequest) -> list[int]:
    """The conversation's token ids, every message's content read as text (a special-token string in it is no turn
    boundary: rlvr.models.prompts.chat_token_ids; past max_chars, or with add_special_tokens, such strings are
    broken by a word joiner before the text is cut)."""
    messages = [m.model_dump() for m in req.messages]
    template = {"add_generation_prompt": req.add_generation_prompt,
                "continue_final_message": req.continue_final_message}
    try:
        text = s.tokenizer.apply_chat_template(messages, tokenize=False, **template)
        if len(text) <= s.max_chars and not req.add_special_tokens:
            return chat_token_ids(s.tokenizer, messages, **template)
        text = s.tokenizer.apply_chat_template(defused_messages(s.tokenizer, messages), tokenize=False, **template)
    except Exception as err:  # noqa: BLE001 (a template that rejects the messages is a bad request)
        raise Refused(400, f"the chat template rejected the messages: {str(err)[:300]}") from None
    return tokens(s, req, text, req.add_special_tokens)


def tokens(s: Serving, req: ClassifyFields, text: str, special: bool) -> list[int]:
    if len(text) > s.max_chars:  # more characters than the context can hold whatever they are
        if req.truncate_prompt_tokens is None:
            raise Refused(400, f"This model's maximum context length is {s.engine.max_model_len} tokens; a text of "
                               f"{len(text)} characters is longer than that.")
        left = (req.truncation_side or s.tokenizer.truncation_side) == "left"
        text = text[-s.max_chars:] if left else text[:s.max_chars]
    return s.tokenizer(text, add_special_tokens=special)["input_ids"]


def prepare(s: Serving, body: bytes) -> tuple[ClassifyJob, tuple[ClassifyFields, ClassifyJob]]:
    req = request_of(body)
    if req.model not in (None, "", s.served_name, str(s.engine.model_dir)):
        raise Refused(404, f"The model `{req.model[:256]}` does not exist.")
    if isinstance(req, ClassifyChatRequest):
        if req.add_generation_prompt and req.continue_final_message:
            raise Refused(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if not getattr(s.tokenizer, "chat_template", None):
            raise Refused(400, "this model's tokenizer has no chat template; send input texts instead of messages")
        rows = [chat_row(s, req)]
    else:
        x = req.input
        if isinstance(x, str):
            rows = [tokens(s, req, x, req.add_special_tokens)]
        elif x and all(isinstance(t, int) for t in x):
            rows = [list(x)]
        else:
            rows = [tokens(s, req, t, req.add_special_tokens) if isinstance(t, str) else list(t) for t in x]
        if not rows:
            raise Refused(400, "You must pass at least one prompt")
        vocab = len(s.tokenizer)
        if any(not 0 <= t < vocab for row in rows for t in row):
            raise Refused(400, f"token ids must lie in [0, {vocab})")
    job = ClassifyJob([truncated(s, req, row) for row in rows])
    return job, (req, job)


def respond(s: Serving, asked: tuple[ClassifyFields, ClassifyJob], logits) -> dict:
    """vLLM's answer; ``logits`` [n, num_labels] on the CPU."""
    (req, job), engine = asked, s.engine
    probs = logits if req.use_activation is False else activate(logits, engine.activation)
    data = []
    for i, row in enumerate(probs.tolist()):
        best = max(range(len(row)), key=row.__getitem__)
        data.append({"index": i, "label": engine.labels.get(best), "probs": row, "num_classes": len(row)})
    n = sum(len(row) for row in job.rows)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": req.model or s.served_name, "data": data,
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None,
                      "completion_tokens_details": None}}


# --- the wrong kind of server ------------------------------------------------------------------------------------
no_generation = APIRouter()  # a classifier's server: generation and adapters refused
no_classify = APIRouter()  # a causal LM's server: /classify refused


async def refuse_generation(request: Request):
    return error(404, f"this server serves a sequence-classification model (a reward model): it answers POST "
                      f"/classify, not {request.url.path}")


for _path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
    no_generation.add_api_route(_path, refuse_generation, methods=["POST"])


@no_classify.post("/classify")
async def refuse_classify():
    return error(404, "this server serves a causal LM (text generation): POST /classify needs a sequence-"
                      "classification model (rlvr serve DIR of an AutoModelForSequenceClassification)")


router = APIRouter()
post_route(router, "/classify", prepare, respond)
