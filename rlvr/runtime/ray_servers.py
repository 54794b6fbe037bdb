"""The Ray runtime: rollout servers as Ray actors on an existing Ray cluster (optional extra ``rlvr[ray]``).

Each actor runs `rlvr serve` inside its own process (engine thread + HTTP server) and reports its URL. Ray
places the actors (``num_cpus`` = the server's threads) on any node, CPU-only nodes included, and restarts an
actor whose process dies (``max_restarts``); the pool re-reads a dead server's URL from its actor before
probing it, so a restarted server rejoins even on another node or port. Transport stays HTTP plus the bucket:
nothing uses NCCL. Add a machine to a running cluster with Ray's own command, ``ray start --address=HEAD:6379``.

Exposure: by default the servers listen on 127.0.0.1 and are placed on the learner's node (loopback is not
reachable from another one); ``host="node"`` (Ray's address of each node) or an explicit address puts them on the
network, anywhere on the cluster. Either way they require the run's API key on every route but /health; the key
reaches each actor through its runtime environment (``RLVR_API_KEY``), not its arguments. Anyone who can submit
work to the Ray cluster can read it - and run any code there - so the cluster itself must be trusted. The servers
load adapters only from ``adapter_roots`` (the learner gives its bucket).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlvr.rollout.http_client import API_KEY_ENV


def _actor_class():
    import ray

    @ray.remote(max_concurrency=4)
    class RolloutServer:
        def __init__(self, model: str, threads: int, max_loras: int, host: str, adapter_roots: tuple[str, ...],
                     adapter_protocols: tuple[str, ...], precision: str, device: str):
            import socket
            import threading

            import uvicorn

            from rlvr.serve.app import create_app
            from rlvr.serve.engine import Engine
            from rlvr.serve.security import AdapterPolicy

            node = ray.util.get_node_ip_address()
            bind = node if host == "node" else host
            policy = AdapterPolicy.parse(adapter_roots, adapter_protocols) if adapter_roots else \
                AdapterPolicy.default(bind)
            engine = Engine(model, max_loras=max_loras, threads=threads, adapter_policy=policy,
                            precision=precision, device=device).start()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, 0))
            self._url = f"http://{node if bind in ('0.0.0.0', '') else bind}:{sock.getsockname()[1]}"
            app = create_app(engine, model, api_key=os.environ.get(API_KEY_ENV, ""))
            server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()

        def url(self) -> str:
            return self._url

        def pid(self) -> int:
            return os.getpid()

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    return RolloutServer


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class RayServers:
    def __init__(self, model: str, count: int, threads: int, *, address: str = "", restarts: int = 3,
                 max_loras: int = 4, run_dir: Path | None = None, host: str = "127.0.0.1", api_key: str | None = None,
                 adapter_roots: tuple[str, ...] = (), adapter_protocols: tuple[str, ...] = ("file",),
                 precision: str = "auto", device: str = "cpu"):
        try:
            import ray
        except ImportError:
            raise RuntimeError("async.runtime=ray needs Ray: pip install 'rlvr[ray]'") from None
        self.ray = ray
        self.model, self.count, self.threads, self.restarts, self.max_loras = model, count, threads, restarts, max_loras
        self.address, self.run_dir, self.host, self.api_key = address, run_dir, host, api_key
        self.adapter_roots, self.adapter_protocols = tuple(adapter_roots), tuple(adapter_protocols)
        self.precision, self.device = precision, device
        self._started_ray = False
        self.actors: list = []

    def start(self) -> list[str]:
        ray = self.ray
        if not ray.is_initialized():
            ray.init(address=self.address or None, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"RLVR_CACHE": os.environ.get("RLVR_CACHE", "")}} if
                     os.environ.get("RLVR_CACHE") else None)
            self._started_ray = True
        options = {"num_cpus": self.threads, "max_restarts": self.restarts, "max_task_retries": -1,
                   "runtime_env": {"env_vars": {API_KEY_ENV: self.api_key or ""}}}
        if self.device.startswith("cuda"):  # Ray hands the actor one GPU of its own, visible to it as cuda:0
            options["num_gpus"] = 1
        if _loopback(self.host):  # a loopback server is only reachable from its own node: the learner's
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            here = ray.get_runtime_context().get_node_id()
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=here, soft=False)
        cls = _actor_class().options(**options)
        self.actors = [cls.remote(self.model, self.threads, self.max_loras, self.host, self.adapter_roots,
                                  self.adapter_protocols, self.precision,
                                  "cuda" if self.device.startswith("cuda") else self.device) for _ in range(self.count)]
        urls = ray.get([a.url.remote() for a in self.actors], timeout=600)
        if self.run_dir is not None:  # for operators and tests, as the embedded runtime writes it
            nodes = ray.get([a.node.remote() for a in self.actors], timeout=30)
            info = [{"url": u, "pid": p, "node": n} for u, p, n in zip(urls, self.pids(), nodes)]
            (self.run_dir / "servers.json").write_text(json.dumps(info, indent=1))
        return urls

    def resolve(self, index: int) -> str | None:
        """The current URL of server ``index`` (None while its actor is restarting)."""
        try:
            return self.ray.get(self.actors[index].url.remote(), timeout=5)
        except Exception:  # noqa: BLE001 (an actor being restarted or gone)
            return None

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors], timeout=30)

    def stop(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []
        if self._started_ray:
            self.ray.shutdown()
