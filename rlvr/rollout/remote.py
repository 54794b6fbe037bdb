"""Generation on rollout servers over HTTP - ``rlvr serve`` or vLLM, unchanged: the pool and the remote Sampler.

The pool is the "proxy" of the wave-2 design, living inside the learner:
- a request (one prompt, its n = G samples) goes whole to one server, so the prompt is prefilled once and
  its prefix cache is reused; the server is the live one with the fewest outstanding tokens;
- a request that fails (connection refused or reset, deadline passed, 5xx) is sent to another server; its answer
  is taken from exactly one server, so nothing is counted twice; a server that cannot be reached is marked
  dead and probed again (GET /health) every ``probe_interval_s``; when it answers it is brought back to the
  pool's current adapters before it gets work;
- every exchange has a wall-clock deadline for the whole of it (connect, send, headers, body) and a bound on
  the answer's size: httpx's own timeouts apply to each read, so a server trickling bytes would never time out;
- nothing a server answers is trusted: a generation answer is validated (``parse_completions``: n choices with
  indices 0..n-1 each once, token ids in the vocabulary, one finite log-prob <= 0 per token, no more tokens than
  asked, a known finish reason) before anything is built from it; a malformed answer is counted
  (``answers_rejected``) and the request sent to another server; only when every attempt was refused or
  malformed does the request fail (``BadAnswerError``, naming what was wrong);
- a 503 with Retry-After (a full queue, a model still loading) is not a failure: the request goes to another
  server, or waits as asked when every server was tried, for at most ``request_timeout_s`` in all;
- with an API key every request carries ``Authorization: Bearer KEY`` (``rlvr serve --api-key``, vLLM's
  ``--api-key``); a server that refuses it stops the run with an error that says where the key comes from;
- an adapter load goes to every live server, all or nothing: if one server fails to load version v, v is
  unloaded from the servers that took it and the error is raised;
- with no live server left it keeps probing for ``no_server_wait_s``, then raises ``NoServerError``: a run
  never hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import torch

from rlvr.bucket import AdapterBucket
from rlvr.prompts import Prompt, left_pad, prompt_token_ids
from rlvr.rollout.engine import SamplingParams
from rlvr.rollout.episodes import Environment, EpisodeLimits, Episodes, Turn, run_episodes
from rlvr.rollout.groups import Groups, eos_token_ids
from rlvr.rollout.sampler import StaleVersion
from rlvr.seeds import request_seed, turn_seed

log = logging.getLogger("rlvr.pool")

LOGP_ROUNDING = 1e-4
"""A log-prob up to this far above 0 is accepted as float rounding of a probability-1 token (log-softmax in fp32
of a dominant logit) and stored as 0; anything higher is malformed (it would make p > 1)."""
LOGP_FLOOR = -1000.0
"""A sampled token's log-prob below this is malformed: no float format holds a probability under e^-745, so such
a token was not drawn from the distribution the log-prob claims."""
FINISH_REASONS = ("stop", "length")
SMALL_ANSWER_BYTES = 1 << 20  # /health, /v1/models, /stats, adapter loads, error bodies


def answer_limit(tokens: int) -> int:
    """Bytes a generation answer for ``tokens`` requested tokens may take: 1 MiB plus 4 KiB a token (vLLM's
    answer with one log-prob per token takes ~250 bytes a token)."""
    return SMALL_ANSWER_BYTES + 4096 * max(tokens, 0)


class NoServerError(RuntimeError):
    """No rollout server can be reached."""


class BadAnswerError(NoServerError):
    """No server gave a well-formed answer to a request in all its attempts."""


class PoolClosed(NoServerError):
    """The pool was closed while a request waited on it."""


class ServerRequestError(RuntimeError):
    """A server refused a request (4xx): retrying elsewhere would not help."""


class ServerAuthError(ServerRequestError):
    """A server refused the pool's API key, or the lack of one (401 / 403)."""


class AdapterSyncError(RuntimeError):
    """An adapter could not be loaded on every server; it was unloaded from those that took it."""


class MalformedAnswer(ValueError):
    """A server's answer failed validation (the pool sends the request to another server)."""


def api_key_from_env(name: str) -> str | None:
    """The API key in environment variable ``name``, stripped (None when the name is empty or the variable unset
    or blank): the key itself never appears in a config file."""
    key = os.environ.get(name, "").strip() if name else ""
    return key or None


def _printable(text: str, limit: int = 300) -> str:
    """A server's text fit for an error message: control characters (terminal escapes) replaced, length bounded."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def _show(value: object) -> str:
    return _printable(repr(value), 40)


class _Http:
    """The pool's HTTP client: every exchange runs on one event-loop thread under ``asyncio.timeout``, so its
    deadline covers connecting, sending, the headers and the whole body, and its answer is read up to a byte
    bound; callers (any thread) block on the result. Redirects are not followed (the key stays with the servers
    it was meant for) and compressed answers are not asked for (the bound is on what is read)."""

    def __init__(self, headers: dict[str, str], connect_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rlvr-pool-http", daemon=True)
        self.thread.start()
        self._closed = False
        self._lock = threading.Lock()

        async def make() -> httpx.AsyncClient:
            return httpx.AsyncClient(headers={**headers, "accept-encoding": "identity"}, follow_redirects=False,
                                     limits=httpx.Limits(max_connections=128, max_keepalive_connections=32))

        self.client = asyncio.run_coroutine_threadsafe(make(), self.loop).result()

    def request(self, method: str, url: str, *, timeout_s: float, json_body: object = None,
                max_bytes: int = SMALL_ANSWER_BYTES) -> httpx.Response:
        """The whole answer within ``timeout_s`` seconds (else ``httpx.ReadTimeout``) and ``max_bytes`` bytes (else
        ``MalformedAnswer``); transport errors are raised as httpx raises them."""
        with self._lock:
            if self._closed:
                raise PoolClosed("the server pool is closed")
            future = asyncio.run_coroutine_threadsafe(self._exchange(method, url, json_body, timeout_s, max_bytes),
                                                      self.loop)
        try:
            return future.result(timeout=timeout_s + 10)  # the loop enforces the deadline; this is a backstop
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise httpx.ReadTimeout(f"no complete answer within {timeout_s:g} s") from None
        except concurrent.futures.CancelledError:
            raise PoolClosed("the server pool was closed while a request was in flight") from None

    async def _exchange(self, method: str, url: str, json_body: object, timeout_s: float,
                        max_bytes: int) -> httpx.Response:
        timeout = httpx.Timeout(timeout_s, connect=min(self.connect_timeout_s, timeout_s))
        try:
            async with asyncio.timeout(timeout_s):
                async with self.client.stream(method, url, json=json_body, timeout=timeout) as r:
                    if r.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
                        raise MalformedAnswer(f"a compressed answer ({_show(r.headers['content-encoding'])}), "
                                              "which was not asked for")
                    body, size = [], 0
                    async for chunk in r.aiter_raw():
                        size += len(chunk)
                        if size > max_bytes:
                            raise MalformedAnswer(f"an answer larger than {max_bytes} bytes")
                        body.append(chunk)
                    kept = {k: r.headers[k] for k in ("content-type", "retry-after") if k in r.headers}
                    return httpx.Response(r.status_code, content=b"".join(body), headers=kept)
        except TimeoutError:
            raise httpx.ReadTimeout(f"no complete answer within {timeout_s:g} s") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def shutdown() -> None:
            in_flight = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in in_flight:
                task.cancel()  # requests still in flight: their callers get PoolClosed
            await asyncio.gather(*in_flight, return_exceptions=True)
            await self.client.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            if not self.thread.is_alive():
                self.loop.close()


def _json(r: httpx.Response) -> object:
    try:
        return json.loads(r.content)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than Python's stack
        raise MalformedAnswer(f"an answer that is not JSON (status {r.status_code})") from None


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
        if api_key is not None and (not api_key.isascii() or not api_key.isprintable() or " " in api_key):
            raise ValueError("the API key must be printable ASCII without spaces")
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.api_key = api_key
        self.http = _Http({"authorization": f"Bearer {api_key}"} if api_key else {}, connect_timeout_s)
        self.request_timeout_s = request_timeout_s
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
        self.http.close()

    def get(self, url: str, timeout_s: float = 5.0) -> httpx.Response | None:
        """GET a small answer (None if the server cannot be reached, is too slow, or answers too much)."""
        try:
            return self.http.request("GET", url, timeout_s=timeout_s)
        except (httpx.HTTPError, MalformedAnswer):
            return None

    def _post_small(self, url: str, body: dict) -> httpx.Response:
        return self.http.request("POST", url, json_body=body, timeout_s=self.request_timeout_s)

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
                raise self._auth_error(server.url, "/v1/models", r)

    def _auth_error(self, url: str, path: str, r: httpx.Response) -> ServerAuthError:
        hint = ("the server does not accept the pool's API key: give the servers and the pool the same key (the "
                "pool reads it from the environment variable named by rollout.api_key_env, default RLVR_API_KEY)"
                if self.api_key else
                "the server requires an API key and the pool sent none: put the key in the environment variable "
                "named by rollout.api_key_env (default RLVR_API_KEY)")
        return ServerAuthError(f"{url}{path} refused the request ({r.status_code}: {_error_message(r)}); {hint}")

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
        r = self.get(f"{server.url}/v1/models", timeout_s=10)
        if r is None:
            return False
        try:
            held = _model_ids(r) if r.status_code == 200 else set()
        except MalformedAnswer:
            return False
        try:
            for name in held & (self._ever_loaded - set(self.adapters)):
                self._post_small(f"{server.url}/v1/unload_lora_adapter", {"lora_name": name})
            for name, path in list(self.adapters.items()):
                r = self._post_small(f"{server.url}/v1/load_lora_adapter",
                                     {"lora_name": name, "lora_path": path, "load_inplace": True})
                if r.status_code != 200:
                    return False
        except (httpx.HTTPError, MalformedAnswer):
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

    def post(self, path: str, body: dict, cost: int = 1, parse: Callable[[object], object] | None = None) -> object:
        """POST to one server, retried on others on failure; the answer of exactly one server: its JSON passed
        through ``parse`` (which raises ``MalformedAnswer`` to have the request sent to another server), or the
        JSON itself. ``cost`` is the tokens the request asks for (load balancing and the answer's size bound)."""
        tried: set[str] = set()
        failures: list[str] = []
        malformed = False
        busy_until = time.monotonic() + self.request_timeout_s  # how long busy servers may keep us waiting
        attempt = -1
        while attempt + 1 < self.max_attempts:
            attempt += 1
            server = self._acquire(tried, cost)
            tried.add(server.url)
            with self._lock:
                self.stats.requests += 1
                self.stats.retries += attempt > 0
            try:
                r = self.http.request("POST", f"{server.url}{path}", json_body=body, timeout_s=self.request_timeout_s,
                                      max_bytes=answer_limit(cost))
                answer = (parse or (lambda x: x))(_json(r)) if r.status_code == 200 else None
            except httpx.TransportError as err:  # refused, reset, deadline passed: the server is gone or stuck
                self._mark_dead(server)
                failures.append(f"{server.url}: {type(err).__name__}: {_printable(err)}")
                continue
            except MalformedAnswer as err:  # a faulty (or hostile) server: ask another one
                self._reject(server, str(err))
                malformed = True
                failures.append(f"{server.url}: malformed answer: {err}")
                continue
            finally:
                with self._lock:
                    server.outstanding -= cost
            if r.status_code == 200:
                return answer
            message = _error_message(r)
            if r.status_code in (401, 403):
                raise self._auth_error(server.url, path, r)
            if r.status_code == 404 and body.get("model") in self.adapters:  # restarted without our adapter
                if not self._sync_server(server):
                    self._mark_dead(server)
                failures.append(f"{server.url}: {message}")
                continue
            if r.status_code == 404 and body.get("model") in self._ever_loaded:  # retired while in flight
                raise StaleVersion(f"{body['model']} was unloaded while the request was in flight ({server.url})")
            if 400 <= r.status_code < 500:
                raise ServerRequestError(f"{server.url}{path} refused the request ({r.status_code}): {message}")
            failures.append(f"{server.url}: {r.status_code} {message}")  # 5xx: another server
            wait = _retry_after(r) if r.status_code == 503 else None
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
        raise error(f"{path} failed on {self.max_attempts} attempts"
                    f"{' (no server gave a well-formed answer)' if malformed else ''}: {'; '.join(failures[-8:])}")

    def post_many(self, path: str, bodies: list[dict], costs: list[int],
                  parse: list[Callable[[object], object]] | None = None) -> list[object]:
        """Several requests concurrently (each whole to one server); answers in order."""
        parse = parse or [None] * len(bodies)
        futures = [self._executor.submit(self.post, path, b, c, p) for b, c, p in zip(bodies, costs, parse)]
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
                r = self._post_small(f"{server.url}/v1/load_lora_adapter", body)
            except (httpx.HTTPError, MalformedAnswer):
                self._mark_dead(server)
                return None
            if r.status_code in (401, 403):
                return str(self._auth_error(server.url, "/v1/load_lora_adapter", r))
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
            self._post_small(f"{server.url}/v1/unload_lora_adapter", {"lora_name": name})
        except (httpx.HTTPError, MalformedAnswer):
            self._mark_dead(server)

    def unload_adapter(self, name: str) -> None:
        with self._adapter_lock:
            self.adapters.pop(name, None)
            list(self._executor.map(lambda s: self._unload_on(s, name), self.live()))


def _error_message(r: httpx.Response) -> str:
    try:
        body = json.loads(r.content)
    except (ValueError, RecursionError):
        return _printable(r.content.decode("utf-8", "replace"))
    if isinstance(body, dict):
        err = body.get("error", body)
        return _printable(err.get("message", err) if isinstance(err, dict) else err)
    return _printable(body)


def _retry_after(r: httpx.Response) -> float | None:
    """Seconds a 503's Retry-After asks for, bounded to [0.1, 10] (None without a usable one)."""
    try:
        seconds = float(r.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(seconds, 0.1), 10.0) if math.isfinite(seconds) else None


def _model_ids(r: httpx.Response) -> set[str]:
    body = _json(r)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise MalformedAnswer("/v1/models without a list of models")
    return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}


# --- what a generation answer must be ---------------------------------------------------------------------
@dataclass
class Completion:
    """One validated choice of a /v1/completions answer."""

    token_ids: list[int]
    logprobs: list[float]  # one per token, finite, <= 0
    truncated: bool  # finish_reason == "length"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_completions(answer: object, n: int, max_tokens: int | None, vocab_size: int) -> list[Completion]:
    """The n choices of a /v1/completions answer for one prompt, in index order, or ``MalformedAnswer`` saying
    what is wrong: exactly n choices with indices 0..n-1 each once; per choice 1..max_tokens token ids, each in
    [0, vocab_size); exactly one log-prob per token, each a finite number in [LOGP_FLOOR, 0] (up to
    LOGP_ROUNDING above 0 is rounding, stored as 0); finish_reason stop or length. The server's text is not
    used (the learner decodes the token ids itself)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        raise MalformedAnswer("no list of choices")
    if len(choices) != n:
        raise MalformedAnswer(f"{len(choices)} choices for n = {n}")
    out: list[Completion | None] = [None] * n
    for c in choices:
        i = c.get("index") if isinstance(c, dict) else None
        if not _is_int(i) or not 0 <= i < n:
            raise MalformedAnswer(f"a choice index {_show(i)} outside 0..{n - 1}")
        if out[i] is not None:
            raise MalformedAnswer(f"choice index {i} appears twice")
        out[i] = _parse_choice(c, i, max_tokens, vocab_size)
    return out


def _parse_choice(c: dict, i: int, max_tokens: int | None, vocab_size: int) -> Completion:
    ids, lp = c.get("token_ids"), c.get("logprobs")
    logps = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if ids is None or logps is None:
        raise MalformedAnswer(f"choice {i} has no token ids or log-probs (the server must support return_token_ids "
                              "and logprobs: rlvr serve, or vLLM >= 0.10)")
    if not isinstance(ids, list) or not isinstance(logps, list):
        raise MalformedAnswer(f"choice {i}: token ids or log-probs that are not lists")
    if not ids:
        raise MalformedAnswer(f"choice {i} has no tokens")
    if max_tokens is not None and len(ids) > max_tokens:
        raise MalformedAnswer(f"choice {i} has {len(ids)} tokens, more than max_tokens = {max_tokens}")
    if len(logps) != len(ids):
        raise MalformedAnswer(f"choice {i} has {len(logps)} log-probs for {len(ids)} tokens")
    for t in ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise MalformedAnswer(f"choice {i}: token id {_show(t)} outside the vocabulary (0..{vocab_size - 1})")
    clean = []
    for x in logps:
        if not _is_number(x) or not LOGP_FLOOR <= x <= LOGP_ROUNDING:  # NaN fails the comparison too
            raise MalformedAnswer(f"choice {i}: log-prob {_show(x)} is not a finite number in [{LOGP_FLOOR:g}, 0]")
        clean.append(min(float(x), 0.0))
    reason = c.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise MalformedAnswer(f"choice {i}: finish_reason {_show(reason)} is not one of {', '.join(FINISH_REASONS)}")
    return Completion(list(ids), clean, reason == "length")


def vocab_size(model, tokenizer) -> int:
    """Token ids the trainer can take: the rows of the model's input embedding (the tokenizer's length if the
    model has none)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(getattr(embedding, "num_embeddings", 0) or len(tokenizer))


class RemoteSampler:
    """The Sampler over a server pool. ``sync(v)`` publishes the trainer's LoRA adapter as version v to the
    bucket, loads it on every server as ``{prefix}-v{v}`` (each version its own name, since servers key their
    prefix caches by adapter name), and unloads versions older than the last ``keep_versions``."""

    def __init__(self, pool: ServerPool, tokenizer, model, bucket: AdapterBucket, *, keep_versions: int = 2,
                 prefix: str = "policy", version: int = 0):
        self.pool, self.tokenizer, self.model, self.bucket = pool, tokenizer, model, bucket
        self.keep_versions, self.prefix, self.version = max(keep_versions, 1), prefix, version
        self.vocab_size = vocab_size(model, tokenizer)
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
            r = self.pool.get(f"{server.url}/stats")
            if r is None or r.status_code != 200:
                continue
            try:
                busy = _json(r).get("busy_s")
            except (MalformedAnswer, AttributeError):
                continue
            if _is_number(busy) and math.isfinite(busy) and busy >= 0:
                out[server.url] = float(busy)
        return out

    def stats(self) -> dict[str, float]:
        s = self.pool.stats
        return {**self.last_sync, "servers_live": len(self.pool.live()), "requests": s.requests,
                "requests_retried": s.retries, "servers_lost": s.servers_lost, "servers_revived": s.servers_revived,
                "answers_rejected": s.answers_rejected, "answers_busy": s.answers_busy}

    def close(self) -> None:
        self.pool.close()

    def _body(self, ids: list[int], n: int, params: SamplingParams, seed: int, version: int) -> dict:
        body = {"model": self.adapter_name(version), "prompt": ids, "n": n, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "seed": seed, "logprobs": 0,
                "return_token_ids": True, "include_stop_str_in_output": True, "skip_special_tokens": True}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    def sample_episodes(self, prompt_ids: list[list[int]], envs: list[Environment], group_size: int,
                        params: SamplingParams, seed: int, limits: EpisodeLimits) -> Episodes:
        """Episodes driven from here: each model turn is one stateless /v1/completions request whose prompt is the
        episode's token ids so far (n = 1, its own seed), sent to any live server; a server lost mid-episode only
        moves the next turn to another one, which has the same adapter version."""
        version, turn = self.version, [0]

        def parse(answer: object) -> list[Completion]:
            return parse_completions(answer, 1, params.max_new_tokens, self.vocab_size)

        def turns(contexts: list[list[int]], episodes: list[int]) -> list[Turn]:
            bodies = [self._body(ids, 1, params, turn_seed(seed, i, turn[0]), version)
                      for ids, i in zip(contexts, episodes)]
            turn[0] += 1
            answers = self.pool.post_many("/v1/completions", bodies, [params.max_new_tokens] * len(bodies),
                                          [parse] * len(bodies))
            return [Turn(a[0].token_ids, a[0].logprobs, a[0].truncated) for a in answers]

        return run_episodes(turns, self.tokenizer, prompt_ids, envs, group_size, params, limits,
                            eos_token_ids(self.model, self.tokenizer), version)

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> Groups:
        prompt_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        version = self.version
        bodies = [self._body(ids, group_size, params, request_seed(seed, i), version)
                  for i, ids in enumerate(prompt_ids)]

        def parse(answer: object) -> list[Completion]:
            return parse_completions(answer, group_size, params.max_new_tokens, self.vocab_size)

        answers = self.pool.post_many("/v1/completions", bodies, [group_size * params.max_new_tokens] * len(bodies),
                                      [parse] * len(bodies))
        return _groups(answers, prompt_ids, group_size, self.tokenizer, version, params.temperature)


def groups_from_completions(answers: list[dict], prompt_ids: list[list[int]], group_size: int, tokenizer,
                            version: int, temperature: float, max_tokens: int | None = None,
                            vocab: int | None = None) -> Groups:
    """Groups from /v1/completions answers (one per prompt, n = group_size choices each, with token ids and
    log-probs), each validated by ``parse_completions`` (``vocab`` defaults to the tokenizer's length)."""
    vocab = vocab or len(tokenizer)
    parsed = [parse_completions(a, group_size, max_tokens, vocab) for a in answers]
    return _groups(parsed, prompt_ids, group_size, tokenizer, version, temperature)


def _groups(answers: list[list[Completion]], prompt_ids: list[list[int]], group_size: int, tokenizer, version: int,
            temperature: float) -> Groups:
    completions = [c for answer in answers for c in answer]
    n, width = len(completions), max((len(c.token_ids) for c in completions), default=0)
    completion_ids = torch.zeros(n, width, dtype=torch.long)
    behaviour = torch.zeros(n, width)
    mask = torch.zeros(n, width, dtype=torch.long)
    for r, c in enumerate(completions):
        completion_ids[r, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        behaviour[r, : len(c.logprobs)] = torch.tensor(c.logprobs)
        mask[r, : len(c.token_ids)] = 1
    ids, pmask = left_pad(prompt_ids, tokenizer.pad_token_id)
    return Groups(
        prompt_ids=ids, prompt_mask=pmask, completion_ids=completion_ids, completion_mask=mask,
        behaviour_logp=behaviour, truncated=torch.tensor([c.truncated for c in completions], dtype=torch.bool),
        texts=tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True),
        group_size=group_size, version=torch.full((n,), version, dtype=torch.long),
        temperature=torch.full((n,), float(temperature)),
    )
