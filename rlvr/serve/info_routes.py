"""The routes of ``rlvr serve`` that read its state: GET /health, GET /v1/models, and rlvr's own GET /stats."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from rlvr.serve.handling import Serving, not_ready, serving

router = APIRouter()


@router.get("/health")
async def health(s: Annotated[Serving, Depends(serving)]):
    return not_ready(s.engine) or JSONResponse({})


@router.get("/stats")
async def stats(s: Annotated[Serving, Depends(serving)]):
    """How the engine has batched its work."""
    e = s.engine
    prefixes = getattr(e, "prefixes", None)  # a classify engine holds none
    held = {"prefix_hits": prefixes.hits, "prefix_reused_tokens": prefixes.reused_tokens,
            "prefix_cache_bytes": prefixes.bytes} if prefixes is not None else {}
    return {"batches": e.batches, "requests": e.requests, "completions": e.rows, "busy_s": e.busy_s,
            "adapters": list(e.adapters), "queued_completions": e.admission.rows, "cancelled": e.admission.cancelled,
            **held}


@router.get("/v1/models")
async def models(s: Annotated[Serving, Depends(serving)]):
    now, engine = int(time.time()), s.engine
    base = {"id": s.served_name, "object": "model", "created": now, "owned_by": "rlvr",
            "root": str(engine.model_dir), "parent": None, "max_model_len": engine.max_model_len}
    loras = [{"id": name, "object": "model", "created": now, "owned_by": "rlvr", "root": path,
              "parent": s.served_name} for name, path in engine.adapters.items()]  # a snapshot: never changed
    return {"object": "list", "data": [base, *loras]}
