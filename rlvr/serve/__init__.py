"""``rlvr serve``: an OpenAI-compatible inference server with vLLM's LoRA endpoints, on rlvr's group sampler."""

from __future__ import annotations

import socket
import sys
from dataclasses import replace

from rlvr.rollout.http_client import API_KEY_ENV
from rlvr.serve.admission import DEFAULT_QUEUED_ROWS
from rlvr.serve.engine import DEFAULT_PREFIX_CACHE_MB, Engine
from rlvr.serve.lora_modules import parse_lora_modules, refuse_adapter_as_model
from rlvr.serve.security import AdapterPolicy, check_api_key, is_loopback

PR_SET_PDEATHSIG = 1


def tie_to_parent(parent_pid: int) -> None:
    """Die (SIGTERM) when the process that started us dies, even by SIGKILL (Linux)."""
    import ctypes
    import os
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before we asked
        raise SystemExit(0)


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, max_loras: int = 4, threads: int = 0,
          max_model_len: int = 0, served_model_name: str = "", max_num_seqs: int = 256, batch_wait_ms: float = 10.0,
          parent_pid: int = 0, cores: tuple[int, ...] = (), *, api_key: str | None = None,
          allowed_adapter_roots: tuple[str, ...] = (), allowed_protocols: tuple[str, ...] = ("file",),
          max_batch_tokens: int = 0, max_queued_rows: int = DEFAULT_QUEUED_ROWS,
          max_body_mb: float = 4.0, body_timeout_s: float = 30.0, precision: str = "auto", device: str = "auto",
          dtype: str = "auto", lora_modules: tuple[str, ...] = (), task: str = "auto",
          prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> None:
    """Listen on host:port (0: any free port) and serve until interrupted. The first line printed names the URL;
    the model loads in the background (requests get 503 until it is ready). ``parent_pid``: exit when that
    process dies; ``cores``: run on these CPU cores only. ``api_key`` None: the ``RLVR_API_KEY`` environment
    variable (if set). Without ``allowed_adapter_roots``, a loopback server loads adapters from any local
    directory and any other refuses every adapter path (rlvr.serve.security). ``precision``: the decoding matmuls'
    (rlvr.rollout.decode_weights: fp32, bf16, or auto). ``device``: where the model runs (auto, cpu, cuda, cuda:N or
    mps; auto: a CUDA GPU when one is visible, else the CPU); a device that is not there is a ValueError before
    anything loads. ``dtype``: the base model's weights (auto: bf16 on a bf16-capable GPU, fp32 elsewhere).
    ``lora_modules``: vLLM's ``--lora-modules`` arguments (rlvr.serve.lora_modules), loaded before the server is
    ready; an adapter folder given as ``model`` is a ValueError saying so. ``task``: generate, classify (a
    sequence-classification model such as a reward model, served with vLLM's POST /classify:
    rlvr.serve.classify_routes) or auto (classify when the model's config names a *ForSequenceClassification
    architecture). ``prefix_cache_mb``: the keys and values of recent completions kept for requests that extend them
    (an episode's next turn; rlvr.serve.engine), at most this many MiB (0: none)."""
    import os

    import uvicorn

    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV, "")
    if api_key:
        check_api_key(api_key)
    if max_body_mb <= 0 or body_timeout_s <= 0:
        raise ValueError("--max-body-mb and --body-timeout-s must be positive")
    if allowed_adapter_roots:
        policy = AdapterPolicy.parse(allowed_adapter_roots, allowed_protocols)
    else:
        policy = replace(AdapterPolicy.default(host), protocols=AdapterPolicy.parse((), allowed_protocols).protocols)
    refuse_adapter_as_model(model)
    from rlvr.rewards.reward_model import find_reward_model

    if task not in ("auto", "generate", "classify"):
        raise ValueError(f"--task must be auto, generate or classify; got {task!r}")
    classify = task == "classify" or (task == "auto" and find_reward_model(model) is not None)
    if classify and lora_modules:
        raise ValueError("--lora-modules: a sequence-classification model is served without adapters")
    modules = parse_lora_modules(lora_modules, (served_model_name or model, model))
    if len(modules) > max_loras:
        raise ValueError(f"--lora-modules names {len(modules)} adapters, more than --max-loras {max_loras}; raise "
                         "--max-loras")
    policy = replace(policy, local_roots=policy.local_roots + tuple(path for _, path in modules))
    if parent_pid:
        tie_to_parent(parent_pid)
    if cores:
        os.sched_setaffinity(0, cores)

    from rlvr.serve.app import create_app

    if classify:
        from rlvr.serve.classify_engine import ClassifyEngine

        engine = ClassifyEngine(model, max_model_len, max_num_seqs, batch_wait_ms / 1000, threads,
                                max_batch_tokens=max_batch_tokens, max_queued_rows=max_queued_rows, device=device,
                                dtype=dtype).start()
    else:
        engine = Engine(model, max_loras, max_model_len, max_num_seqs, batch_wait_ms / 1000, threads,
                        max_batch_tokens=max_batch_tokens, max_queued_rows=max_queued_rows, adapter_policy=policy,
                        precision=precision, device=device, dtype=dtype, lora_modules=modules,
                        prefix_cache_mb=prefix_cache_mb).start()
    app = create_app(engine, served_model_name or model, api_key=api_key, max_body_bytes=int(max_body_mb * 2**20),
                     body_timeout_s=body_timeout_s)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    weights = str(engine.weight_dtype).removeprefix("torch.")
    print(f"rlvr serve: listening on http://{host}:{bound} (model {served_model_name or model} on {engine.device}, "
          f"{weights} weights)", flush=True)
    what = "a sequence-classification model: POST /classify" if classify else policy.describe()
    print(f"rlvr serve: {what}; API key {'required' if api_key else 'not required'}", flush=True)
    if not is_loopback(host):
        if not api_key:
            print(f"rlvr serve: warning: {host} is not loopback and there is no --api-key: anyone who can reach this "
                  "port can generate and load adapters (docs/security.md)", file=sys.stderr, flush=True)
        print("rlvr serve: note: TLS is not built in; across untrusted networks put this server behind a TLS "
              "proxy", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])
    finally:
        engine.close(wait_s=1.0)


__all__ = ["AdapterPolicy", "Engine", "serve"]
