"""What every POST route of ``rlvr serve`` goes through: the model must be ready, the body is read (bounded in size
and time) and prepared (parsed, validated, tokenized) on a small worker pool, its job runs on the engine, and the
answer is built on the worker pool again; the event loop only moves bytes. A client that disconnects while its
generation or classification waits or runs has it cancelled (the engine drops it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from rlvr.serve.admission import EngineError
from rlvr.serve.engine import Engine
from rlvr.serve.errors import Refused, error

MAX_OPEN_BODIES = 64  # requests being read or parsed at once; beyond: 503
WORKERS = 2  # threads that parse, template, tokenize and build answers


class Serving:
    """What the routes share: the engine, the name the base model is served as, the body limits (larger than
    ``max_body_bytes``: 413; still arriving after ``body_timeout_s``: 408), the worker pool, and the count of
    bodies being read (changed on the event loop only)."""

    def __init__(self, engine: Engine, served_name: str, max_body_bytes: int, body_timeout_s: float):
        self.engine, self.served_name = engine, served_name
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.tokenizer = engine.tokenizer
        self.workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="rlvr-serve-parse")
        # no tokenization of a string has fewer tokens than characters / the longest token's length, so a longer
        # string cannot fit the context, whatever it holds: refused without spending a second tokenizing it
        self.max_chars = engine.max_model_len * max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.open_bodies = 0


def serving(request: Request) -> Serving:
    """The app's shared state (a FastAPI dependency of every route)."""
    return request.app.state.serving


def not_ready(engine: Engine) -> JSONResponse | None:
    """The error answer while the model is loading (503) or failed to load (500); None when it is ready."""
    if engine.load_error:
        return error(500, "the model failed to load (see the server's log)")
    if not engine.ready.is_set():
        return error(503, "the model is still loading", {"Retry-After": "5"})
    return None


async def read_body(s: Serving, request: Request) -> bytes:
    too_large = Refused(413, f"the request body is larger than this server accepts ({s.max_body_bytes} bytes, "
                             "--max-body-mb)")
    length = request.headers.get("content-length")
    if length is not None and not (length.isascii() and length.isdigit() and int(length) <= s.max_body_bytes):
        raise too_large
    chunks, size = [], 0

    async def collect() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > s.max_body_bytes:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), s.body_timeout_s)
    except TimeoutError:
        raise Refused(408, f"the request body did not arrive within {s.body_timeout_s:g} s") from None
    except ClientDisconnect:
        raise Refused(400, "the client went away") from None
    return b"".join(chunks)


async def off_loop(s: Serving, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(s.workers, fn, *args)


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.1)


async def run_job(engine: Engine, job, request: Request) -> object:
    """The engine's answer to ``job``; a ``cancellable`` job is cancelled if the client disconnects meanwhile."""
    try:
        future = engine.submit(job)
    except EngineError as err:
        raise Refused(err.status, str(err), err.headers) from None
    answer = asyncio.wrap_future(future)
    if job.cancellable:
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not answer.done():  # nobody is listening: the engine drops the request's rows
            answer.cancel()
            future.cancel()
            raise Refused(400, "the client went away")
    try:
        return await answer
    except EngineError as err:
        raise Refused(err.status, str(err), err.headers) from None


async def handle(s: Serving, request: Request, prepare: Callable[[Serving, bytes], tuple[object, object]],
                 respond: Callable[[Serving, object, object], object]):
    """Read the body and ``prepare(s, body) -> (job, req)`` off the loop, run the job on the engine, and build the
    answer with ``respond(s, req, result)`` off the loop."""
    if (answer := not_ready(s.engine)) is not None:
        return answer
    if s.open_bodies >= MAX_OPEN_BODIES:
        return error(503, f"the server is busy ({s.open_bodies} requests being read); retry later",
                     {"Retry-After": "1"})
    s.open_bodies += 1
    try:
        try:
            job, req = await off_loop(s, prepare, s, await read_body(s, request))
        finally:
            s.open_bodies -= 1
        result = await run_job(s.engine, job, request)
        return await off_loop(s, respond, s, req, result)
    except Refused as refused:
        return refused.response


def post_route(router: APIRouter, path: str, prepare: Callable[[Serving, bytes], tuple[object, object]],
               respond: Callable[[Serving, object, object], object]) -> None:
    """Add POST ``path`` to ``router``: ``handle`` with ``prepare`` and ``respond`` (every route that runs a job on
    the engine has this one shape)."""
    async def endpoint(request: Request, s: Annotated[Serving, Depends(serving)]):
        return await handle(s, request, prepare, respond)

    endpoint.__name__ = endpoint.__qualname__ = path.strip("/").replace("/", "_")  # FastAPI's operation id
    router.post(path)(endpoint)
