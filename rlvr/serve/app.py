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

The parts: rlvr.serve.security (the API key, checked before any route), rlvr.serve.handling (what every POST
route goes through, and the state the routes share), rlvr.serve.request_models (request validation),
rlvr.serve.errors (the error answers), and the routes: rlvr.serve.info_routes (health, models, stats),
rlvr.serve.completion_routes (generation), rlvr.serve.adapter_routes (adapter loads and unloads). A
sequence-classification model (a reward model; rlvr.serve.classify_engine) is served with POST /classify
(rlvr.serve.classify_routes) and the info routes instead; each kind of server refuses the other's routes (404).
"""

from __future__ import annotations

import sys
import traceback

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlvr.serve import adapter_routes, classify_routes, completion_routes, info_routes
from rlvr.serve.classify_engine import ClassifyEngine
from rlvr.serve.engine import Engine
from rlvr.serve.errors import error
from rlvr.serve.handling import Serving
from rlvr.serve.security import BearerAuth

DEFAULT_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 30.0  # a body still arriving after this is dropped (408)


def create_app(engine: Engine | ClassifyEngine, served_name: str, *, api_key: str = "",
               max_body_bytes: int = DEFAULT_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The app; ``api_key``: require it (Bearer) on every route but /health; a body larger than
    ``max_body_bytes`` gets 413, one still arriving after ``body_timeout_s`` 408."""
    app = FastAPI(title="rlvr serve", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    app.state.serving = Serving(engine, served_name, max_body_bytes, body_timeout_s)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crashed)
    if isinstance(engine, ClassifyEngine):  # a reward model: /classify, and generation refused
        routers = (info_routes.router, classify_routes.router, classify_routes.no_generation)
    else:
        routers = (info_routes.router, completion_routes.router, adapter_routes.router, classify_routes.no_classify)
    for router in routers:
        app.include_router(router)
    return app


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own errors (unknown route, wrong method) as JSON error answers."""
    return error(exc.status_code, str(exc.detail))


async def crashed(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception: logged with its traceback, answered 500 without its text."""
    print("rlvr serve: internal error:\n" + "".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
    return error(500, "internal server error (see the server's log)")
