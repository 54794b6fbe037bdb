"""Start real ``rlvr serve`` processes on loopback for tests, and stop them (the whole process group)."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """``api_key``: start the server with it (through RLVR_API_KEY, as runtimes do) and send it from ``post`` /
    ``get``; ``env``: the server's whole environment (default: ours without RLVR_API_KEY). The server's output is
    read continuously (``output()``), so its logging can never block it."""

    def __init__(self, model_dir: Path, *args: str, threads: int = 1, api_key: str = "", env: dict | None = None):
        cmd = [sys.executable, "-m", "rlvr", "serve", str(model_dir), "--port", "0", "--threads", str(threads), *args]
        if env is None:  # inherited, without a key the test runner may happen to hold
            env = {k: v for k, v in os.environ.items() if k != "RLVR_API_KEY"}
        env = dict(env)
        if api_key:
            env["RLVR_API_KEY"] = api_key
        self.api_key = api_key
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=env)
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        if not match:
            self.kill()
            rest = self.proc.stdout.read()[-2000:]
            self.stop()
            raise RuntimeError(f"rlvr serve did not start: {line}{rest}")
        self.url = match.group(1)
        self._lines: collections.deque[str] = collections.deque([line], maxlen=2000)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    def output(self) -> str:
        """What the server has printed so far (its last 2,000 lines)."""
        return "".join(self._lines)

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=self.headers, timeout=60, **kwargs)

    def post(self, path: str, body) -> httpx.Response:
        return post(self.url, path, body, api_key=self.api_key)

    def wait_ready(self, timeout_s: float = 60.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                raise RuntimeError(f"rlvr serve exited: {self.output()[-2000:]}")
            time.sleep(0.1)
        self.stop()  # a caller whose server never got ready has no handle to stop it with
        raise TimeoutError(f"{self.url} not ready after {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the server (fault injection): no goodbye, connections reset."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(timeout=5)
        if self.proc.stdout:
            self.proc.stdout.close()


def post(url: str, path: str, body, api_key: str = "") -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return httpx.post(f"{url}{path}", headers=headers, timeout=60, **kwargs)
