"""vLLM's LoRA routes on ``rlvr serve``: POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter; the engine
loads and unloads (what a path may be: rlvr.serve.security), and a success is answered in plain text."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from rlvr.serve.engine import AdapterJob
from rlvr.serve.errors import Refused
from rlvr.serve.handling import Serving, post_route
from rlvr.serve.request_models import LoadLoraRequest, UnloadLoraRequest, parse


def prepare_load(s: Serving, body: bytes) -> tuple[AdapterJob, None]:
    req = parse(LoadLoraRequest, body)
    if req.lora_name in (s.served_name, str(s.engine.model_dir)):
        raise Refused(400, "lora_name is the base model's name; choose another")
    return AdapterJob("load", req.lora_name, req.lora_path, req.load_inplace), None


def prepare_unload(s: Serving, body: bytes) -> tuple[AdapterJob, None]:
    return AdapterJob("unload", parse(UnloadLoraRequest, body).lora_name), None


def plain(s: Serving, req: None, message: str) -> PlainTextResponse:
    return PlainTextResponse(message)


router = APIRouter()
post_route(router, "/v1/load_lora_adapter", prepare_load, plain)
post_route(router, "/v1/unload_lora_adapter", prepare_unload, plain)
