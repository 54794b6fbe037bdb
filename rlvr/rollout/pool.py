"""The server pool: several rollout servers (``rlvr serve`` or vLLM, unchanged) behind one interface. The pool is
the proxy between the learner and the servers, living inside the learner:
- a request (one prompt, its n = G samples) goes whole to one server, so the prompt is prefilled once and
  its prefix cache is reused; the server is the live one with the fewest outstanding tokens;
- a request that fails (connection refused or reset, deadline passed, 5xx) is sent to another server; its answer
  is taken from exactly one server, so nothing is counted twice; a server that cannot be reached is marked
  dead and probed again (GET /health) every ``probe_interval_s``; when it answers it is brought back to the
  pool's current adapters (rlvr.rollout.adapter_sync) before it gets work;
- nothing a server answers is trusted: each exchange is bounded in time and size (rlvr.rollout.http_client; one
  attempt runs as rlvr.rollout.retry's ``post_once`` under the pool's ``RetryPolicy``),
  and a generation answer is validated by the caller's ``parse`` (rlvr.rollout.server_answers) before anything is
  built from it; a malformed answer is counted (``answers_rejected``) and the request sent to another server;
  only when every attempt was refused or malformed does the request fail (``BadAnswerError``, naming what was
  wrong);
- a 503 with Retry-After (a full queue, a model still loading) is not a failure: the request goes to another
  server, or waits as asked when every server was tried, for at most ``request_timeout_s`` in all;
- a server that refuses the API key stops the run with an error that says where the key comes from;
- with no live server left it keeps probing for ``no_server_wait_s``, then raises ``NoServerError``: a run
  never hangs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from rlvr.rollout.adapter_sync import AdapterSync
from rlvr.rollout.http_client import HttpClient, answer_limit, error_message, printable
from rlvr.rollout.retry import RetryPolicy, post_once
from rlvr.rollout.sampler import StaleVersion
from rlvr.rollout.server_errors import (
    BadAnswerError,
    MalformedAnswer,
    NoServerError,
    ServerRequestError,
)

log = logging.getLogger("rlvr.pool")
SERVER_FAULTS = frozenset(range(500, 600))  # a server's fault: the request goes to another server


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
    answers_rejected: int = 0  # malformed answers (each retried on another server)
    answers_busy: int = 0  # 503 with Retry-After: a full queue (or a model still loading), tried again later
    rejected_by: Counter = field(default_factory=Counter)  # server URL -> malformed answers


class ServerPool:
    def __init__(self, urls: list[str] | tuple[str, ...], *, api_key: str | None = None,
                 request_timeout_s: float = 600.0, connect_timeout_s: float = 5.0, probe_interval_s: float = 5.0,
                 max_attempts: int = 4, no_server_wait_s: float = 30.0,
                 resolve: Callable[[int], str | None] | None = None):
        if not urls:
            raise ValueError("a server pool needs at least one server URL")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.http = HttpClient(api_key, connect_timeout_s)
        self.request_timeout_s = request_timeout_s
        self.probe_interval_s = probe_interval_s
        # each attempt goes at once to another server (no backoff): 5xx, dropped connections and malformed answers
        # fail over; a 503's Retry-After (at most 10 s) is waited for once every server was tried
        self.retry_policy = RetryPolicy(attempts=max_attempts, backoff_s=0.0, jitter=0.0, statuses=SERVER_FAULTS,
                                        errors=(httpx.TransportError, MalformedAnswer))
        self.no_server_wait_s = no_server_wait_s
        self.resolve = resolve  # server index -> its current URL (a restarted Ray actor may have moved)
        self.stats = PoolStats()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="rlvr-pool")
        self.adapter_sync = AdapterSync(self.http, request_timeout_s, self._executor)

    @property
    def adapters(self) -> dict[str, str]:
        """What every live server holds: lora name -> lora path."""
        return self.adapter_sync.held

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def get(self, url: str, timeout_s: float = 5.0) -> httpx.Response | None:
        """GET a small answer (None if the server cannot be reached, is too slow, or answers too much)."""
        try:
            return self.http.request("GET", url, timeout_s=timeout_s)
        except (httpx.HTTPError, MalformedAnswer):
            return None

    # --- health ---------------------------------------------------------------------------------------
    def _healthy(self, server: Server, timeout_s: float = 5.0) -> bool:
        r = self.get(f"{server.url}/health", timeout_s)
        return r is not None and r.status_code == 200

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until every server answers /health with 200 (servers load their model first), then check that
        each accepts the pool's API key (or needs none)."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.servers)
        while waiting:
            waiting = [s for s in waiting if not self._healthy(s)]
            if waiting and time.monotonic() > deadline:
                raise NoServerError(f"rollout servers not ready after {timeout_s:.0f} s: "
                                    f"{', '.join(s.url for s in waiting)}")
            if waiting:
                time.sleep(0.5)
        for server in self.servers:
            r = self.get(f"{server.url}/v1/models", timeout_s=30)
            if r is not None and r.status_code in (401, 403):
                raise self.http.auth_error(server.url, "/v1/models", r)

    def _mark_dead(self, server: Server) -> None:
        with self._lock:
            if server.alive:
                server.alive = False
                self.stats.servers_lost += 1
            server.next_probe = time.monotonic() + self.probe_interval_s

    def _reject(self, server: Server, reason: str) -> None:
        """Count a malformed answer (the request goes elsewhere); the first one from each server is logged."""
        with self._lock:
            self.stats.answers_rejected += 1
            self.stats.rejected_by[server.url] += 1
            first = self.stats.rejected_by[server.url] == 1
        if first:
            log.warning("rollout server %s answered malformed (%s); the request was sent to another server, and "
                        "further malformed answers are counted in answers_rejected", server.url, reason)

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
                with self.adapter_sync.lock:  # no adapter change between its sync and its return to the pool
                    if self._healthy(server) and self.adapter_sync.bring_up_to_date(server.url):
                        with self._lock:
                            server.alive = True
                            self.stats.servers_revived += 1
            finally:
                server.lock.release()

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

    def post(self, path: str, body: dict, cost: int = 1, parse: Callable[[object], object] | None = None) -> object:
        """POST to one server, retried on others on failure; the answer of exactly one server: its JSON passed
        through ``parse`` (which raises ``MalformedAnswer`` to have the request sent to another server), or the
        JSON itself. ``cost`` is the tokens the request asks for (load balancing and the answer's size bound)."""
        tried: set[str] = set()
        failures: list[str] = []
        malformed = False
        busy_until = time.monotonic() + self.request_timeout_s  # how long busy servers may keep us waiting
        attempt = -1
        while attempt + 1 < self.retry_policy.attempts:
            attempt += 1
            server = self._acquire(tried, cost)
            tried.add(server.url)
            with self._lock:
                self.stats.requests += 1
                self.stats.retries += attempt > 0
            try:
                sent = post_once(self.http, f"{server.url}{path}", body, self.retry_policy,
                                 timeout_s=self.request_timeout_s, max_bytes=answer_limit(cost), parse=parse)
            finally:
                with self._lock:
                    server.outstanding -= cost
            err, r = sent.error, sent.response
            if isinstance(err, MalformedAnswer):  # a faulty (or hostile) server: ask another one
                self._reject(server, str(err))
                malformed = True
                failures.append(f"{server.url}: malformed answer: {err}")
                continue
            if err is not None:  # refused, reset, deadline passed: the server is gone or stuck
                self._mark_dead(server)
                failures.append(f"{server.url}: {type(err).__name__}: {printable(err)}")
                continue
            if sent.ok:
                return sent.value
            message = error_message(r)
            if r.status_code in (401, 403):
                raise self.http.auth_error(server.url, path, r)
            if r.status_code == 404 and body.get("model") in self.adapters:  # restarted without our adapter
                if not self.adapter_sync.bring_up_to_date(server.url):
                    self._mark_dead(server)
                failures.append(f"{server.url}: {message}")
                continue
            if r.status_code == 404 and body.get("model") in self.adapter_sync.ever_loaded:  # retired in flight
                raise StaleVersion(f"{body['model']} was unloaded while the request was in flight ({server.url})")
            if 400 <= r.status_code < 500:
                raise ServerRequestError(f"{server.url}{path} refused the request ({r.status_code}): {message}")
            failures.append(f"{server.url}: {r.status_code} {message}")  # 5xx: another server
            wait = sent.retry_after_s if r.status_code == 503 else None
            if wait is not None and time.monotonic() + wait < busy_until:  # busy, not broken: not an attempt
                with self._lock:
                    self.stats.answers_busy += 1
                attempt -= 1
                if not [s for s in self.live() if s.url not in tried]:  # every server tried: give them time
                    time.sleep(wait)
                    tried.clear()
                continue
            if r.status_code == 503:
                self._mark_dead(server)
        error = BadAnswerError if malformed else NoServerError
        raise error(f"{path} failed on {self.retry_policy.attempts} attempts"
                    f"{' (no server gave a well-formed answer)' if malformed else ''}: {'; '.join(failures[-8:])}")

    def post_many(self, path: str, bodies: list[dict], costs: list[int],
                  parse: list[Callable[[object], object]] | None = None) -> list[object]:
        """Several requests concurrently (each whole to one server); answers in order."""
        parse = parse or [None] * len(bodies)
        futures = [self._executor.submit(self.post, path, b, c, p) for b, c, p in zip(bodies, costs, parse)]
        return [f.result() for f in futures]

    # --- adapters (rlvr.rollout.adapter_sync) ---------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> float:
        """Load on every live server, all or nothing; returns the seconds it took. A server that refuses the
        adapter fails the load (and it is unloaded from the others); one that cannot be reached is marked dead
        and gets the adapter when it rejoins (if none is reachable, this waits up to ``no_server_wait_s``)."""
        with self.adapter_sync.lock:
            started = time.perf_counter()
            self._revive_due()
            loaded = self.adapter_sync.load_everywhere(name, path, self.live(), self._mark_dead)
            if not loaded:  # every server is down right now: wait for one to come back with it
                deadline = time.monotonic() + self.no_server_wait_s
                while not self.live():
                    if time.monotonic() > deadline:
                        del self.adapters[name]
                        raise NoServerError(f"no rollout server reachable for {self.no_server_wait_s:.0f} s to "
                                            f"load adapter {name} on: {', '.join(s.url for s in self.servers)}")
                    time.sleep(min(1.0, self.probe_interval_s))
                    self._revive_due()
            return time.perf_counter() - started

    def unload_adapter(self, name: str) -> None:
        with self.adapter_sync.lock:
            self.adapter_sync.unload_everywhere(name, self.live(), self._mark_dead)
