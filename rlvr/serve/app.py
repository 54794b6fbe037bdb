"""The HTTP face of ``rlvr serve``: vLLM's OpenAI-compatible routes and its LoRA endpoints, on FastAPI.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, and rlvr's own GET /stats (batches run, requests and
completions served, seconds spent generating). A request picks an adapter with ``"model":
lora_name`` (the served model name, or the path it was started with, means the base model). Log-probs are
those of the distribution each token was drawn from (temperature, then top-k / top-p): vLLM's
``--logprobs-mode processed_logprobs``. Errors are JSON ``{"error": {"message", "type", "code"}}`` with status
400 (bad request), 404 (unknown route, adapter or model), 503 (model still loading) or 500; no request stops
the server.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlvr.rollout.engine import SamplingParams
from rlvr.serve.engine import AdapterJob, Engine, EngineError, Generation, Job

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError", 500: "InternalServerError"}


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None,
                                   "code": status}}, status_code=status)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does

    model: str = ""
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class LoadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def create_app(engine: Engine, served_name: str) -> FastAPI:
    app = FastAPI(title="rlvr serve")
    tok = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
        return error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return error(500, f"{type(exc).__name__}: {exc}")

    def not_ready() -> JSONResponse | None:
        if engine.load_error:
            return error(500, f"the model failed to load: {engine.load_error}")
        if not engine.ready.is_set():
            return error(503, "the model is still loading")
        return None

    async def run(job) -> object:
        try:
            return await asyncio.wrap_future(engine.submit(job))
        except EngineError as err:
            raise _Answer(error(err.status, str(err))) from None

    def adapter_of(name: str) -> str | None:
        if name in ("", served_name, str(engine.model_dir)):
            return None
        if name not in engine.adapters:
            raise _Answer(error(404, f"The model `{name}` does not exist."))
        return name

    def sampling(req: _Sampling, max_tokens: int, prompt_lengths: list[int]) -> SamplingParams:
        if req.stream:
            raise _Answer(error(400, "stream=true is not supported by rlvr serve"))
        longest = max(prompt_lengths)
        if longest + max_tokens > engine.max_model_len:
            raise _Answer(error(400, (
                f"This model's maximum context length is {engine.max_model_len} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.")))
        if min(prompt_lengths) == 0:
            raise _Answer(error(400, "a prompt is empty"))
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return SamplingParams(req.temperature, req.top_p, max(req.top_k, 0), max_tokens, stop)

    def text_of(tokens: list[int], stop_reason: str | None, req: _Sampling) -> str:
        text = tok.decode(tokens, skip_special_tokens=req.skip_special_tokens)
        if stop_reason is not None and not req.include_stop_str_in_output:
            text = text[: text.find(stop_reason)] if stop_reason in text else text
        return text

    def usage(gens: list[Generation]) -> dict:
        prompt = sum(len(g.prompt_ids) for g in gens)
        completion = sum(len(t) for g in gens for t in g.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @app.get("/health")
    async def health():
        return not_ready() or JSONResponse({})

    @app.get("/stats")
    async def stats():  # rlvr's own: how the engine has batched its work
        return {"batches": engine.batches, "requests": engine.requests, "completions": engine.rows,
                "busy_s": engine.busy_s, "adapters": list(engine.adapters)}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        base = {"id": served_name, "object": "model", "created": now, "owned_by": "rlvr", "root": str(engine.model_dir),
                "parent": None, "max_model_len": engine.max_model_len}
        loras = [{"id": name, "object": "model", "created": now, "owned_by": "rlvr", "root": path,
                  "parent": served_name} for name, path in engine.adapters.items()]
        return {"object": "list", "data": [base, *loras]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        try:
            if (answer := not_ready()) is not None:
                return answer
            adapter = adapter_of(req.model)
            p = req.prompt
            if isinstance(p, str):
                prompts = [tok(p)["input_ids"]]
            elif p and all(isinstance(x, int) for x in p):
                prompts = [list(p)]
            else:
                prompts = [tok(x)["input_ids"] if isinstance(x, str) else list(x) for x in p]
            if not prompts:
                return error(400, "prompt must not be empty")
            vocab = len(tok)
            if any(not 0 <= t < vocab for ids in prompts for t in ids):
                return error(400, f"prompt token ids must lie in [0, {vocab})")
            params = sampling(req, req.max_tokens or 16, [len(x) for x in prompts])
            k = req.logprobs or 0
            gens: list[Generation] = await run(Job(prompts, req.n, params, adapter, req.seed, k))
        except _Answer as answer:
            return answer.response
        choices = []
        for i, g in enumerate(gens):
            for j, tokens in enumerate(g.token_ids):
                choice = {"index": i * req.n + j, "text": text_of(tokens, g.stop_reason[j], req),
                          "logprobs": None, "finish_reason": g.finish_reason[j], "stop_reason": g.stop_reason[j]}
                if req.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(tok, tokens, g, j)
                if req.return_token_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = g.prompt_ids, tokens
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or served_name, "choices": choices, "usage": usage(gens)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        try:
            if (answer := not_ready()) is not None:
                return answer
            adapter = adapter_of(req.model)
            messages = [m.model_dump() for m in req.messages]
            try:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as err:  # noqa: BLE001 (a template that rejects the messages is a bad request)
                return error(400, f"the chat template rejected the messages: {err}")
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            max_tokens = req.max_completion_tokens or req.max_tokens or engine.max_model_len - len(prompt)
            params = sampling(req, max_tokens, [len(prompt)])
            k = (req.top_logprobs or 0) if req.logprobs else 0
            (g,) = await run(Job([prompt], req.n, params, adapter, req.seed, k))
        except _Answer as answer:
            return answer.response
        choices = []
        for j, tokens in enumerate(g.token_ids):
            choice = {"index": j, "message": {"role": "assistant", "content": text_of(tokens, g.stop_reason[j], req)},
                      "logprobs": _chat_logprobs(tok, tokens, g, j) if req.logprobs else None,
                      "finish_reason": g.finish_reason[j], "stop_reason": g.stop_reason[j]}
            if req.return_token_ids:
                choice["token_ids"] = tokens
            choices.append(choice)
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": req.model or served_name, "choices": choices, "usage": usage([g])}
        if req.return_token_ids:
            body["prompt_token_ids"] = g.prompt_ids
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora(req: LoadLoraRequest):
        try:
            if (answer := not_ready()) is not None:
                return answer
            return PlainTextResponse(await run(AdapterJob("load", req.lora_name, req.lora_path, req.load_inplace)))
        except _Answer as answer:
            return answer.response

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(req: UnloadLoraRequest):
        try:
            if (answer := not_ready()) is not None:
                return answer
            return PlainTextResponse(await run(AdapterJob("unload", req.lora_name)))
        except _Answer as answer:
            return answer.response

    return app


class _Answer(Exception):
    """Carries a finished error response out of nested helpers."""

    def __init__(self, response: JSONResponse):
        self.response = response


def _piece(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=False)


def _completion_logprobs(tok, tokens: list[int], g: Generation, j: int) -> dict:
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


def _chat_logprobs(tok, tokens: list[int], g: Generation, j: int) -> dict:
    content = []
    for t, token in enumerate(tokens):
        piece = _piece(tok, token)
        top = [] if g.top_logprobs is None else [
            {"token": _piece(tok, i), "logprob": lp, "bytes": list(_piece(tok, i).encode())}
            for i, lp in g.top_logprobs[j][t]]
        content.append({"token": piece, "logprob": g.logprobs[j][t], "bytes": list(piece.encode()),
                        "top_logprobs": top})
    return {"content": content}

