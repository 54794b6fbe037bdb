"""The embedded runtime: the learner starts its own `rlvr serve` processes on this machine and stops them.

- Each server is pinned to cores of its own (where there are enough) and told to die with the learner
  (Linux's parent-death signal), so not even a SIGKILLed learner leaves one behind; a normal exit, Ctrl-C or
  an error stops them all (SIGTERM to the process group, then SIGKILL).
- A watcher restarts a server that dies (up to ``restarts`` times) on the same port, so the pool's probe finds
  it again and loads the current adapters onto it before giving it work.
- ``servers.json`` in the run directory names every server's URL and pid (for operators and tests).
- The servers listen on loopback only and, given an ``api_key`` (the learner makes a random one per run), require
  it on every route but /health; the key reaches them through their environment (``RLVR_API_KEY``), never their
  command line, which any local user can read in /proc; they load adapters only from ``adapter_roots`` (the
  learner gives its bucket).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlvr.rollout.http_client import API_KEY_ENV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan_cores(servers: int, server_threads: int, learner_threads: int) -> tuple[list[int], list[list[int]]] | None:
    """(learner cores, cores of each server), or None when the machine has too few cores to give each its own.
    Servers take cores from the end of the available set, the learner the rest (or ``learner_threads`` of them)."""
    available = sorted(os.sched_getaffinity(0))
    need = servers * server_threads
    if need >= len(available):
        return None
    server_cores = [available[len(available) - need + i * server_threads:][:server_threads] for i in range(servers)]
    learner = available[: len(available) - need]
    return (learner[:learner_threads] if learner_threads else learner), server_cores


@dataclass
class _Server:
    index: int
    port: int
    cores: list[int] | None
    proc: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class EmbeddedServers:
    def __init__(self, model: str, count: int, threads: int, run_dir: Path, *, cores: list[list[int]] | None = None,
                 restarts: int = 3, max_loras: int = 4, env: dict | None = None, api_key: str | None = None,
                 adapter_roots: tuple[str, ...] = (), adapter_protocols: tuple[str, ...] = ("file",),
                 precision: str = "auto", device: str = "cpu"):
        self.model, self.threads, self.run_dir, self.restarts_allowed = model, threads, run_dir, restarts
        self.max_loras = max_loras
        self.env = dict(os.environ if env is None else env)
        self.env.pop(API_KEY_ENV, None)  # the servers get this run's key, or none
        if api_key:
            self.env[API_KEY_ENV] = api_key
        if any("," in r for r in (*adapter_roots, *adapter_protocols)):
            raise ValueError(f"rlvr serve takes adapter roots as a comma-separated list: {adapter_roots} cannot be "
                             "passed (use a bucket path without commas)")
        self.adapter_flags = ["--precision", precision, "--device", device]
        if adapter_roots:  # the servers load adapters from the run's bucket and nowhere else
            self.adapter_flags += ["--allowed-adapter-roots", ",".join(adapter_roots),
                                  "--allowed-protocols", ",".join(adapter_protocols)]
        self.servers = [_Server(i, _free_port(), cores[i] if cores else None) for i in range(count)]
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="rlvr-servers", daemon=True)
        (run_dir / "servers").mkdir(parents=True, exist_ok=True)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _spawn(self, server: _Server, env: dict) -> None:
        log = (self.run_dir / "servers" / f"server-{server.index}.log").open("ab")
        cmd = [sys.executable, "-m", "rlvr", "serve", self.model, "--host", "127.0.0.1", "--port", str(server.port),
               "--threads", str(self.threads), "--max-loras", str(self.max_loras), "--parent-pid", str(os.getpid()),
               *self.adapter_flags]
        if server.cores:
            cmd += ["--cores", ",".join(map(str, server.cores))]
        server.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self._record()

    def _record(self) -> None:
        info = [{"url": s.url, "pid": s.proc.pid if s.proc else None, "restarts": s.restarts, "cores": s.cores}
                for s in self.servers]
        (self.run_dir / "servers.json").write_text(json.dumps(info, indent=1))

    def start(self) -> list[str]:
        for server in self.servers:
            self._spawn(server, self.env)
        self._watcher.start()
        return self.urls

    def _watch(self) -> None:
        restart_env = {k: v for k, v in self.env.items() if k != "RLVR_FAULT"}  # an injected fault fires once
        while not self._stop.wait(0.5):
            for server in self.servers:
                if server.proc is None or server.proc.poll() is None:
                    continue
                if server.restarts >= self.restarts_allowed:
                    continue
                server.restarts += 1
                time.sleep(0.2)  # let the port be released
                self._spawn(server, restart_env)

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.servers)

    def stop(self) -> None:
        self._stop.set()
        for server in self.servers:
            if server.proc is not None and server.proc.poll() is None:
                try:
                    os.killpg(server.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for server in self.servers:
            if server.proc is None:
                continue
            try:
                server.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(server.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                server.proc.wait()
