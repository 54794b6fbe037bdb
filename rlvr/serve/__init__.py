"""``rlvr serve``: an OpenAI-compatible inference server with vLLM's LoRA endpoints, on rlvr's group sampler."""

from __future__ import annotations

import socket

from rlvr.serve.engine import Engine


def serve(model: str, host: str = "127.0.0.1", port: int = 8000, max_loras: int = 4, threads: int = 0,
          max_model_len: int = 0, served_model_name: str = "", max_num_seqs: int = 256, batch_wait_ms: float = 10.0,
          ) -> None:
    """Listen on host:port (0: any free port) and serve until interrupted. The first line printed names the URL;
    the model loads in the background (requests get 503 until it is ready)."""
    import uvicorn

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
