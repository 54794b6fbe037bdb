"""The HTTP face of ``rlvr serve``: vLLM's OpenAI-compatible routes and its LoRA endpoints, on FastAPI.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, and rlvr's own GET /stats (batches run, requests and
completions served, seconds spent generating, completions queued, requests cancelled). A request picks an adapter
with ``"model": lora_name`` (the served model name, or the path it was started with, means the base model).
Log-probs are those of the distribution each token was drawn from (temperature, then top-k / top-p): vLLM's
``--logprobs-mode processed_logprobs``. Errors are JSON ``{"error": {"message", "type", "code"}}`` with status
400 (bad request: the message says which field or limit), 401 (missing or wrong API key, when the server has
one), 404 (unknown route, adapter or model), 408 (body still arriving after ``--body-timeout-s``), 413 (body
larger than ``--max-body-mb``), 503 (model still loading, or the queue full: with ``Retry-After``) or 500; no
request stops the server, and no error quotes a remote server, an exception's text or a path outside the
allowed roots.

The event loop only moves bytes: reading the body (bounded in size and time), parsing, validating, templating
and tokenizing run on a small worker pool, generation on the engine thread, so ``/health`` answers at once
while a large request is being parsed or refused. A client that disconnects while its request waits or runs
has it cancelled (the engine drops its rows).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rlvr.rollout.engine import SamplingParams
from rlvr.serve.engine import AdapterJob, Engine, EngineError, Generation, Job
from rlvr.serve.security import MAX_PATH_CHARS, BearerAuth

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
               413: "RequestTooLargeError", 503: "ServiceUnavailableError", 500: "InternalServerError"}
DEFAULT_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 30.0  # a body still arriving after this is dropped (408)
MAX_OPEN_BODIES = 64  # requests being read or parsed at once; beyond: 503
WORKERS = 2  # threads that parse, template, tokenize and build answers


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": None,
                                   "code": status}}, status_code=status, headers=headers)


_NAME = Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")
_STOP = Annotated[str, Field(min_length=1, max_length=256)]


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # unknown fields are ignored, as vLLM does

    model: str = Field("", max_length=4096)
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    stop: _STOP | Annotated[list[_STOP], Field(max_length=32)] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
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
    role: str = Field(max_length=64)
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class LoadLoraRequest(BaseModel):
    lora_name: str = _NAME
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    load_inplace: bool = False


class UnloadLoraRequest(BaseModel):
    lora_name: str = _NAME
    lora_int_id: int | None = None


def parse(model: type[BaseModel], body: bytes) -> BaseModel:
    """The request, validated; _Answer(400) naming the fields otherwise (never quoting the values sent)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise _Answer(error(400, "JSON decode error: the body is not valid JSON")) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
        parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5]]
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise _Answer(error(400, "; ".join(parts) + more or "invalid request")) from None


def create_app(engine: Engine, served_name: str, *, api_key: str = "", max_body_bytes: int = DEFAULT_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app; ``api_key``: require it (Bearer) on every route but /health; a body larger than
    ``max_body_bytes`` gets 413, one still arriving after ``body_timeout_s`` 408."""
    app = FastAPI(title="rlvr serve", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    tok = engine.tokenizer
    workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="rlvr-serve-parse")
    # no tokenization of a string has fewer tokens than characters / the longest token's length, so a longer
    # string cannot fit the context, whatever it holds: refused without spending a second tokenizing it
    max_chars = engine.max_model_len * max((len(t) for t in tok.get_vocab()), default=1)
    open_bodies = 0

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        print("rlvr serve: internal error:\n" + "".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
        return error(500, "internal server error (see the server's log)")

    def not_ready() -> JSONResponse | None:
        if engine.load_error:
            return error(500, "the model failed to load (see the server's log)")
        if not engine.ready.is_set():
            return error(503, "the model is still loading", {"Retry-After": "5"})
        return None

    async def read_body(request: Request) -> bytes:
        too_large = _Answer(error(413, f"the request body is larger than this server accepts ({max_body_bytes} "
                                       "bytes, --max-body-mb)"))
        length = request.headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit() and int(length) <= max_body_bytes):
            raise too_large
        chunks, size = [], 0

        async def collect() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise too_large
                chunks.append(chunk)

        try:
            await asyncio.wait_for(collect(), body_timeout_s)
        except TimeoutError:
            raise _Answer(error(408, f"the request body did not arrive within {body_timeout_s:g} s")) from None
        except ClientDisconnect:
            raise _Answer(error(400, "the client went away")) from None
        return b"".join(chunks)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(workers, fn, *args)

    async def disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.1)

    async def run(job, request: Request) -> object:
        """The engine's answer to ``job``; a generation is cancelled if the client disconnects meanwhile."""
        try:
            future = engine.submit(job)
        except EngineError as err:
            raise _Answer(error(err.status, str(err), err.headers)) from None
        answer = asyncio.wrap_future(future)
        if isinstance(job, Job):
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
            if not answer.done():  # nobody is listening: the engine drops the request's rows
                answer.cancel()
                future.cancel()
                raise _Answer(error(400, "the client went away"))
        try:
            return await answer
        except EngineError as err:
            raise _Answer(error(err.status, str(err), err.headers)) from None

    async def handle(request: Request, prepare, respond):
        """Read and prepare the request off the loop, run its job on the engine, build the answer off the loop."""
        nonlocal open_bodies
        if (answer := not_ready()) is not None:
            return answer
        if open_bodies >= MAX_OPEN_BODIES:
            return error(503, f"the server is busy ({open_bodies} requests being read); retry later",
                         {"Retry-After": "1"})
        open_bodies += 1
        try:
            try:
                job, req = await off_loop(prepare, await read_body(request))
            finally:
                open_bodies -= 1
            result = await run(job, request)
            return await off_loop(respond, req, result)
        except _Answer as answer:
            return answer.response

    def adapter_of(name: str) -> str | None:
        if name in ("", served_name, str(engine.model_dir)):
            return None
        if name not in engine.adapters:
            raise _Answer(error(404, f"The model `{name[:256]}` does not exist."))
        return name

    def tokenize(text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > max_chars:
            raise _Answer(error(400, f"This model's maximum context length is {engine.max_model_len} tokens; a "
                                     f"prompt of {len(text)} characters is longer than that."))
        return tok(text, add_special_tokens=add_special_tokens)["input_ids"]

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
                "busy_s": engine.busy_s, "adapters": list(engine.adapters), "queued_completions": engine.queued_rows,
                "cancelled": engine.cancelled}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        base = {"id": served_name, "object": "model", "created": now, "owned_by": "rlvr", "root": str(engine.model_dir),
                "parent": None, "max_model_len": engine.max_model_len}
        loras = [{"id": name, "object": "model", "created": now, "owned_by": "rlvr", "root": path,
                  "parent": served_name} for name, path in engine.adapters.items()]  # a snapshot: never changed
        return {"object": "list", "data": [base, *loras]}

    def prepare_completion(body: bytes) -> tuple[Job, CompletionRequest]:
        req = parse(CompletionRequest, body)
        adapter = adapter_of(req.model)
        p = req.prompt
        if isinstance(p, str):
            prompts = [tokenize(p)]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = [tokenize(x) if isinstance(x, str) else list(x) for x in p]
        if not prompts:
            raise _Answer(error(400, "prompt must not be empty"))
        vocab = len(tok)
        if any(not 0 <= t < vocab for ids in prompts for t in ids):
            raise _Answer(error(400, f"prompt token ids must lie in [0, {vocab})"))
        params = sampling(req, req.max_tokens or 16, [len(x) for x in prompts])
        return Job(prompts, req.n, params, adapter, req.seed, req.logprobs or 0), req

    def answer_completion(req: CompletionRequest, gens: list[Generation]) -> dict:
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, prepare_completion, answer_completion)

    def prepare_chat(body: bytes) -> tuple[Job, ChatRequest]:
        req = parse(ChatRequest, body)
        adapter = adapter_of(req.model)
        messages = [m.model_dump() for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 (a template that rejects the messages is a bad request)
            raise _Answer(error(400, f"the chat template rejected the messages: {str(err)[:300]}")) from None
        prompt = tokenize(text, add_special_tokens=False)
        max_tokens = req.max_completion_tokens or req.max_tokens or engine.max_model_len - len(prompt)
        params = sampling(req, max_tokens, [len(prompt)])
        k = (req.top_logprobs or 0) if req.logprobs else 0
        return Job([prompt], req.n, params, adapter, req.seed, k), req

    def answer_chat(req: ChatRequest, gens: list[Generation]) -> dict:
        (g,) = gens
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

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, prepare_chat, answer_chat)

    def prepare_load(body: bytes) -> tuple[AdapterJob, None]:
        req = parse(LoadLoraRequest, body)
        if req.lora_name in (served_name, str(engine.model_dir)):
            raise _Answer(error(400, "lora_name is the base model's name; choose another"))
        return AdapterJob("load", req.lora_name, req.lora_path, req.load_inplace), None

    def prepare_unload(body: bytes) -> tuple[AdapterJob, None]:
        return AdapterJob("unload", parse(UnloadLoraRequest, body).lora_name), None

    def plain(_, message: str) -> PlainTextResponse:
        return PlainTextResponse(message)

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request):
        return await handle(request, prepare_load, plain)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request):
        return await handle(request, prepare_unload, plain)

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

