"""What a request body of ``rlvr serve`` may hold (vLLM's fields; unknown ones are ignored, as vLLM does), and
``parse``, which validates a body against one of them."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlvr.serve.errors import Refused
from rlvr.serve.security import MAX_PATH_CHARS

_NAME = Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")
_STOP = Annotated[str, Field(min_length=1, max_length=256)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields both generation routes take."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field("", max_length=4096)
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    stop: _STOP | Annotated[list[_STOP], Field(max_length=32)] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: each prompt token's log-prob, and the top k


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(max_length=64)
    content: str


class ChatRequest(SamplingFields):
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
    """The request, validated; ``Refused`` (400) naming the fields otherwise (never quoting the values sent)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise Refused(400, "JSON decode error: the body is not valid JSON") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_input=False, include_url=False)
        parts = [f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5]]
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise Refused(400, "; ".join(parts) + more or "invalid request") from None
