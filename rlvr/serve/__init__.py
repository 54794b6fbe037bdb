"""``rlvr serve``: an OpenAI-compatible inference server with vLLM's LoRA endpoints, on rlvr's group sampler."""

from __future__ import annotations

import socket

from rlvr.serve.engine import Engine

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
          parent_pid: int = 0, cores: tuple[int, ...] = ()) -> None:
    """Listen on host:port (0: any free port) and serve until interrupted. The first line printed names the URL;
    the model loads in the background (requests get 503 until it is ready). ``parent_pid``: exit when that
    process dies; ``cores``: run on these CPU cores only."""
    import os

    import uvicorn

    if parent_pid:
        tie_to_parent(parent_pid)
    if cores:
        os.sched_setaffinity(0, cores)

    from rlvr.serve.app import create_app

    engine = Engine(model, max_loras, max_model_len, max_num_seqs, batch_wait_ms / 1000, threads).start()
    app = create_app(engine, served_model_name or model)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    print(f"rlvr serve: listening on http://{host}:{bound} (model {served_model_name or model})", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])


__all__ = ["Engine", "serve"]
