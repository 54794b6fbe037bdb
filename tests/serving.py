"""Start real ``rlvr serve`` processes on loopback for tests, and stop them (the whole process group)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    def __init__(self, model_dir: Path, *args: str, threads: int = 1):
        cmd = [sys.executable, "-m", "rlvr", "serve", str(model_dir), "--port", "0", "--threads", str(threads), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (http://\S+)", line)
        if not match:
            self.stop()
            raise RuntimeError(f"rlvr serve did not start: {line}{self.proc.stdout.read()[-2000:]}")
        self.url = match.group(1)

    def wait_ready(self, timeout_s: float = 60.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"rlvr serve exited: {self.proc.stdout.read()[-2000:]}")
            time.sleep(0.1)
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
        if self.proc.stdout:
            self.proc.stdout.close()


def post(url: str, path: str, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(f"{url}{path}", headers={"content-type": "application/json"}, timeout=60, **kwargs)
