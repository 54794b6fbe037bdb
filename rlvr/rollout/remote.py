"""Generation on rollout servers over HTTP - ``rlvr serve`` or vLLM, unchanged: the pool and the remote Sampler.

The pool is the "proxy" of the wave-2 design, living inside the learner:
- a request (one prompt, its n = G samples) goes whole to one server, so the prompt is prefilled once and
  its prefix cache is reused; the server is the live one with the fewest outstanding tokens;
- a request that fails (connection refused or reset, timeout, 5xx) is sent to another server; its answer is
  taken from exactly one server, so nothing is counted twice; a server that cannot be reached is marked
  dead and probed again (GET /health) every ``probe_interval_s``; when it answers it is brought back to the
  pool's current adapters before it gets work;
- an adapter load goes to every live server, all or nothing: if one server fails to load version v, v is
  unloaded from the servers that took it and the error is raised;
- with no live server left it keeps probing for ``no_server_wait_s``, then raises ``NoServerError``: a run
  never hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import torch

from rlvr.bucket import AdapterBucket
from rlvr.prompts import Prompt, left_pad, prompt_token_ids
from rlvr.rollout.engine import SamplingParams
from rlvr.rollout.groups import Groups
from rlvr.rollout.sampler import StaleVersion


class NoServerError(RuntimeError):
    """No rollout server can be reached."""


class ServerRequestError(RuntimeError):
    """A server refused a request (4xx): retrying elsewhere would not help."""


class AdapterSyncError(RuntimeError):
    """An adapter could not be loaded on every server; it was unloaded from those that took it."""


@dataclass
class Server:
    url: str
    alive: bool = True
    outstanding: int = 0  # tokens requested and not yet answered
    next_probe: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class PoolStats:
    requests: int = 0
    retries: int = 0
    servers_lost: int = 0
    servers_revived: int = 0


class ServerPool:
    def __init__(self, urls: list[str] | tuple[str, ...], *, request_timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, probe_interval_s: float = 5.0, max_attempts: int = 4,
                 no_server_wait_s: float = 30.0, resolve: Callable[[int], str | None] | None = None):
        if not urls:
            raise ValueError("a server pool needs at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.client = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s))
        self.probe_interval_s, self.max_attempts = probe_interval_s, max_attempts
        self.no_server_wait_s = no_server_wait_s
        self.resolve = resolve  # server index -> its current URL (a restarted Ray actor may have moved)
        self.adapters: dict[str, str] = {}  # what every live server holds: lora name -> lora path
        self._ever_loaded: set[str] = set()
        self._adapter_lock = threading.RLock()
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rlvr-pool")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # --- health ---------------------------------------------------------------------------------------
    def _healthy(self, server: Server, timeout_s: float = 5.0) -> bool:
        try:
            return self.client.get(f"{server.url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every server answers /health with 200 (servers load their model first)."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.servers)
        while waiting:
            waiting = [s for s in waiting if not self._healthy(s)]
            if waiting and time.monotonic() > deadline:
                raise NoServerError(f"rollout servers not ready after {timeout_s:.0f} s: "
                                    f"{', '.join(s.url for s in waiting)}")
            if waiting:
                time.sleep(0.5)

    def _mark_dead(self, server: Server) -> None:
        with self._lock:
            if server.alive:
                server.alive = False
                self.stats.servers_lost += 1
            server.next_probe = time.monotonic() + self.probe_interval_s

    def _revive_due(self) -> None:
        """Probe dead servers whose time has come; a server that answers is synced to the current adapters."""
        now = time.monotonic()
        for server in self.servers:
            if server.alive or server.next_probe > now or not server.lock.acquire(blocking=False):
                continue
            try:
                if server.alive:
                    continue
                server.next_probe = now + self.probe_interval_s
                if self.resolve is not None:
                    url = self.resolve(self.servers.index(server))
                    if url is None:
                        continue
                    server.url = url.rstrip("/")
                with self._adapter_lock:  # no adapter change between its sync and its return to the pool
                    if self._healthy(server) and self._sync_server(server):
                        with self._lock:
                            server.alive = True
                            self.stats.servers_revived += 1
            finally:
                server.lock.release()

    def _sync_server(self, server: Server) -> bool:
        """Bring a server to the pool's adapters: unload the ones the pool has dropped since (a server that was
        away missed those unloads), load the current ones (a restarted server has none); False if it cannot."""
        try:
            r = self.client.get(f"{server.url}/v1/models", timeout=10)
            held = {m["id"] for m in r.json()["data"]} if r.status_code == 200 else set()
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        for name in held & (self._ever_loaded - set(self.adapters)):
            try:
                self.client.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name})
            except httpx.HTTPError:
                return False
        for name, path in list(self.adapters.items()):
            try:
                r = self.client.post(f"{server.url}/v1/load_lora_adapter",
                                     json={"lora_name": name, "lora_path": path, "load_inplace": True})
            except httpx.HTTPError:
                return False
            if r.status_code != 200:
                return False
        return True

    def live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    # --- requests -------------------------------------------------------------------------------------
    def _acquire(self, exclude: set[str], cost: int) -> Server:
        """The live server with the fewest outstanding tokens (not yet tried, if possible); its count is raised
        by ``cost`` in the same breath, so concurrent requests spread out."""
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            self._revive_due()
            with self._lock:
                candidates = [s for s in self.servers if s.alive and s.url not in exclude]
                if not candidates:
                    candidates = [s for s in self.servers if s.alive]  # every live one tried: try again
                if candidates:
                    server = min(candidates, key=lambda s: s.outstanding)
                    server.outstanding += cost
                    return server
            if time.monotonic() > deadline:
                raise NoServerError(f"all {len(self.servers)} rollout servers have been unreachable for "
                                    f"{self.no_server_wait_s:.0f} s: {', '.join(s.url for s in self.servers)}")
            time.sleep(min(1.0, self.probe_interval_s))

    def post(self, path: str, body: dict, cost: int = 1) -> dict:
        """POST to one server, retried on others on failure; the JSON answer of exactly one server."""
        tried: set[str] = set()
        last = ""
        for attempt in range(self.max_attempts):
            server = self._acquire(tried, cost)
            tried.add(server.url)
            with self._lock:
                self.stats.requests += 1
                self.stats.retries += attempt > 0
            try:
                r = self.client.post(f"{server.url}{path}", json=body)
            except httpx.TransportError as err:  # refused, reset, timed out: the server is gone or stuck
                self._mark_dead(server)
                last = f"{server.url}: {type(err).__name__}: {err}"
                continue
            finally:
                with self._lock:
                    server.outstanding -= cost
            if r.status_code == 200:
                return r.json()
            message = _error_message(r)
            if r.status_code == 404 and body.get("model") in self.adapters:  # restarted without our adapter
                if not self._sync_server(server):
                    self._mark_dead(server)
                last = f"{server.url}: {message}"
                continue
            if r.status_code == 404 and body.get("model") in self._ever_loaded:  # retired while in flight
                raise StaleVersion(f"{body['model']} was unloaded while the request was in flight ({server.url})")
            if 400 <= r.status_code < 500:
                raise ServerRequestError(f"{server.url}{path} refused the request ({r.status_code}): {message}")
            last = f"{server.url}: {r.status_code} {message}"  # 5xx (or 503 while loading): another server
            if r.status_code == 503:
                self._mark_dead(server)
        raise NoServerError(f"{path} failed on {self.max_attempts} attempts; last: {last}")

    def post_many(self, path: str, bodies: list[dict], costs: list[int]) -> list[dict]:
        """Several requests concurrently (each whole to one server); answers in order."""
        futures = [self._executor.submit(self.post, path, b, c) for b, c in zip(bodies, costs)]
        return [f.result() for f in futures]

    # --- adapters -------------------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> float:
        """Load on every live server, all or nothing; returns the seconds it took. A server that refuses the
        adapter fails the load (and it is unloaded from the others); one that cannot be reached is marked dead
        and gets the adapter when it rejoins (if none is reachable, this waits up to ``no_server_wait_s``)."""
        with self._adapter_lock:
            return self._load_adapter(name, path)

    def _load_adapter(self, name: str, path: str) -> float:
        started = time.perf_counter()
        self._revive_due()
        servers = self.live()
        self._ever_loaded.add(name)
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}

        def load(server: Server) -> str | None:
            try:
                r = self.client.post(f"{server.url}/v1/load_lora_adapter", json=body)
            except httpx.HTTPError:
                self._mark_dead(server)
                return None
            return None if r.status_code == 200 else f"{server.url}: {r.status_code} {_error_message(r)}"

        errors = list(self._executor.map(load, servers))
        loaded = [s for s, e in zip(servers, errors) if e is None and s.alive]
        failed = [e for e in errors if e]
        if failed:
            for server in loaded:
                self._unload_on(server, name)
            raise AdapterSyncError(f"adapter {name} ({path}) did not load everywhere, so it was unloaded from "
                                   f"the others: {'; '.join(failed)}")
        self.adapters[name] = path  # servers that rejoin load it before they get work
        if not loaded:  # every server is down right now: wait for one to come back with it
            deadline = time.monotonic() + self.no_server_wait_s
            while not self.live():
                if time.monotonic() > deadline:
                    del self.adapters[name]
                    raise NoServerError(f"no rollout server reachable for {self.no_server_wait_s:.0f} s to load "
                                        f"adapter {name} on: {', '.join(s.url for s in self.servers)}")
                time.sleep(min(1.0, self.probe_interval_s))
                self._revive_due()
        return time.perf_counter() - started

    def _unload_on(self, server: Server, name: str) -> None:
        try:
            self.client.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": name})
        except httpx.HTTPError:
            self._mark_dead(server)

    def unload_adapter(self, name: str) -> None:
        with self._adapter_lock:
            self.adapters.pop(name, None)
            list(self._executor.map(lambda s: self._unload_on(s, name), self.live()))


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    return str(body)[:500]


def request_seed(seed: int, prompt: int) -> int:
    """A request's seed from the step's seed and the prompt's position (distinct for nearby steps)."""
    return (seed * 1_000_033 + prompt * 7_919) % (2**31 - 1)


class RemoteSampler:
    """The Sampler over a server pool. ``sync(v)`` publishes the trainer's LoRA adapter as version v to the
    bucket, loads it on every server as ``{prefix}-v{v}`` (each version its own name, since servers key their
    prefix caches by adapter name), and unloads versions older than the last ``keep_versions``."""

    def __init__(self, pool: ServerPool, tokenizer, model, bucket: AdapterBucket, *, keep_versions: int = 2,
                 prefix: str = "policy", version: int = 0):
        self.pool, self.tokenizer, self.model, self.bucket = pool, tokenizer, model, bucket
        self.keep_versions, self.prefix, self.version = max(keep_versions, 1), prefix, version
        self.last_sync: dict[str, float] = {}

    def adapter_name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def sync(self, version: int) -> None:
        published = self.bucket.publish_adapter(self.model, version)
        load_s = self.pool.load_adapter(self.adapter_name(version), published.url)
        self.version = version
        for old in [n for n in self.pool.adapters if n.startswith(f"{self.prefix}-v")]:
            if int(old.rsplit("-v", 1)[1]) <= version - self.keep_versions:
                self.pool.unload_adapter(old)
        self.bucket.gc(self.keep_versions)
        self.last_sync = {"adapter_bytes": published.bytes, "publish_s": published.seconds, "load_s": load_s}

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each live `rlvr serve` has spent generating (from its /stats; other engines are left out)."""
        out = {}
        for server in self.pool.live():
            try:
                r = self.pool.client.get(f"{server.url}/stats", timeout=5)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                out[server.url] = float(r.json()["busy_s"])
        return out

    def stats(self) -> dict[str, float]:
        s = self.pool.stats
        return {**self.last_sync, "servers_live": len(self.pool.live()), "requests": s.requests,
                "requests_retried": s.retries, "servers_lost": s.servers_lost, "servers_revived": s.servers_revived}

    def close(self) -> None:
        self.pool.close()

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> Groups:
        prompt_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        version = self.version
        bodies = []
        for i, ids in enumerate(prompt_ids):
            body = {"model": self.adapter_name(version), "prompt": ids, "n": group_size,
                    "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                    "seed": request_seed(seed, i), "logprobs": 0, "return_token_ids": True,
                    "include_stop_str_in_output": True, "skip_special_tokens": True}
            if params.top_k > 0:
                body["top_k"] = params.top_k
            if params.stop:
                body["stop"] = list(params.stop)
            bodies.append(body)
        answers = self.pool.post_many("/v1/completions", bodies, [group_size * params.max_new_tokens] * len(bodies))
        return groups_from_completions(answers, prompt_ids, group_size, self.tokenizer, version, params.temperature)


def groups_from_completions(answers: list[dict], prompt_ids: list[list[int]], group_size: int, tokenizer,
                            version: int, temperature: float) -> Groups:
    """Groups from /v1/completions answers (one per prompt, n = group_size choices each, with token ids and
    log-probs)."""
    tokens, logps, truncated = [], [], []
    for answer, ids in zip(answers, prompt_ids):
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != group_size:
            raise ServerRequestError(f"asked for {group_size} completions, got {len(choices)}")
        for c in choices:
            if c.get("token_ids") is None or not c.get("logprobs"):
                raise ServerRequestError("the server returned no token ids or log-probs (needs return_token_ids "
                                         "and logprobs support: rlvr serve, or vLLM >= 0.10)")
            tokens.append(list(c["token_ids"]))
            logps.append([float(x) for x in c["logprobs"]["token_logprobs"]])
            truncated.append(c.get("finish_reason") == "length")
    n, width = len(tokens), max((len(t) for t in tokens), default=0)
    completion_ids = torch.zeros(n, width, dtype=torch.long)
    behaviour = torch.zeros(n, width)
    mask = torch.zeros(n, width, dtype=torch.long)
    for r, (t, lp) in enumerate(zip(tokens, logps)):
        completion_ids[r, : len(t)] = torch.tensor(t, dtype=torch.long)
        behaviour[r, : len(lp)] = torch.tensor(lp)
        mask[r, : len(t)] = 1
    ids, pmask = left_pad(prompt_ids, tokenizer.pad_token_id)
    return Groups(
        prompt_ids=ids, prompt_mask=pmask, completion_ids=completion_ids, completion_mask=mask,
        behaviour_logp=behaviour, truncated=torch.tensor(truncated, dtype=torch.bool),
        texts=tokenizer.batch_decode(tokens, skip_special_tokens=True), group_size=group_size,
        version=torch.full((n,), version, dtype=torch.long), temperature=torch.full((n,), float(temperature)),
    )
