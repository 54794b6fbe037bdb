"""A retried POST: one exchange through rlvr's HTTP client (a deadline for the whole of it, a bound on the answer's
size), asked again under a ``RetryPolicy``: which statuses and errors are retried, how many times, and after what
wait (exponential backoff with jitter, or longer when the server's Retry-After asks, bounded). The LLM judge's and
the served reward model's clients post through ``RetriedPoster``; the server pool, which sends each attempt to
another server, runs ``post_once`` under its own policy."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from rlvr.rollout.http_client import HttpClient, read_json, retry_after
from rlvr.rollout.server_errors import MalformedAnswer, PoolClosed

RETRIED_STATUSES = frozenset({408, 429, *range(500, 600)})  # a timeout, rate limiting, a server's fault
EXCHANGE_ERRORS = (httpx.TransportError, MalformedAnswer)  # what one exchange can fail with


@dataclass(frozen=True)
class RetryPolicy:
    """How a request is asked again: ``attempts`` in all. Before retry k (0 for the first) it waits ``backoff_s *
    2**k * (1 + jitter * u)`` (u uniform in [0, 1)), at most ``max_backoff_s``, or longer when the server's
    Retry-After asks (honoured from 0.1 s up to ``max_retry_after_s``). Retried: answers with one of ``statuses``
    and exchanges that raised one of ``errors`` (by default timeouts and refused or dropped connections; add
    ``MalformedAnswer`` to ask again after a garbled answer)."""

    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    jitter: float = 0.25
    max_retry_after_s: float = 10.0
    statuses: frozenset[int] = RETRIED_STATUSES
    errors: tuple[type[Exception], ...] = (httpx.TransportError,)

    def __post_init__(self) -> None:
        if self.attempts < 1 or min(self.backoff_s, self.max_backoff_s, self.jitter) < 0 \
                or self.max_retry_after_s < 0.1:
            raise ValueError("retry policy: attempts >= 1, backoffs and jitter >= 0, max_retry_after_s >= 0.1")

    def backoff(self, retry: int, rng: Callable[[], float] = random.random) -> float:
        """Seconds to wait before retry ``retry`` (0 for the first) when the server asked for no wait."""
        return min(self.backoff_s * 2.0 ** min(retry, 64) * (1 + self.jitter * rng()), self.max_backoff_s)

    def wait(self, retry: int, asked_s: float | None, rng: Callable[[], float] = random.random) -> float:
        """The backoff before retry ``retry``, or the server's (bounded) Retry-After ``asked_s`` when longer."""
        return max(self.backoff(retry, rng), asked_s or 0.0)


@dataclass(frozen=True)
class Attempt:
    """One exchange: the answer (None when the exchange raised ``error``), a 200's JSON passed through the caller's
    ``parse`` (``value``; a ``MalformedAnswer`` from it is the ``error``), whether the policy asks again, after at
    least ``retry_after_s`` when the server said so, and the seconds it took."""

    response: httpx.Response | None
    value: object = None
    error: Exception | None = None
    retry: bool = False
    retry_after_s: float | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """A 200 whose answer passed ``parse``."""
        return self.error is None and self.response is not None and self.response.status_code == 200


@dataclass(frozen=True)
class Outcome:
    """What a retried POST came to: its last attempt, the retries it took, the seconds of all its exchanges."""

    last: Attempt
    retries: int
    seconds: float

    @property
    def attempts(self) -> int:
        """Requests sent, the first one included."""
        return self.retries + 1


def post_once(http: HttpClient, url: str, body: object, policy: RetryPolicy, *, timeout_s: float, max_bytes: int,
              parse: Callable[[object], object] | None = None) -> Attempt:
    """POST ``body`` to ``url`` once (within ``timeout_s`` and ``max_bytes``); a failed exchange is reported in the
    ``Attempt``, not raised (``PoolClosed`` and errors of ``parse`` other than ``MalformedAnswer`` are raised)."""
    started, r = time.monotonic(), None
    try:
        r = http.request("POST", url, timeout_s=timeout_s, json_body=body, max_bytes=max_bytes)
        value = (parse or _unchanged)(read_json(r)) if r.status_code == 200 else None
    except EXCHANGE_ERRORS + policy.errors as err:
        return Attempt(r, error=err, retry=isinstance(err, policy.errors), seconds=time.monotonic() - started)
    retry = r.status_code in policy.statuses
    asked = retry_after(r, policy.max_retry_after_s) if retry else None
    return Attempt(r, value, retry=retry, retry_after_s=asked, seconds=time.monotonic() - started)


def post_retried(http: HttpClient, url: str, body: object, policy: RetryPolicy, *, timeout_s: float, max_bytes: int,
                 parse: Callable[[object], object] | None = None, sleep: Callable[[float], None] = time.sleep,
                 rng: Callable[[], float] = random.random) -> Outcome:
    """``post_once`` until an attempt succeeds, fails in a way the policy does not retry, or the attempts are spent,
    waiting between attempts as the policy says (no wait after the last)."""
    seconds = 0.0
    for retry in range(policy.attempts):
        attempt = post_once(http, url, body, policy, timeout_s=timeout_s, max_bytes=max_bytes, parse=parse)
        seconds += attempt.seconds
        if attempt.ok or not attempt.retry or retry + 1 == policy.attempts:
            return Outcome(attempt, retry, seconds)
        sleep(policy.wait(retry, attempt.retry_after_s, rng))
    raise AssertionError("unreachable: attempts >= 1")


class RetriedPoster:
    """Retried POSTs from ``threads`` worker threads through one HTTP client (with ``api_key``); both start at the
    first call and stop at ``close`` (a later call starts them again)."""

    def __init__(self, policy: RetryPolicy, api_key: str | None, connect_timeout_s: float, threads: int, name: str,
                 sleep: Callable[[float], None] = time.sleep):
        self.policy, self.api_key, self.connect_timeout_s = policy, api_key, connect_timeout_s
        self.threads, self.name, self.sleep = threads, name, sleep
        self._http: HttpClient | None = None
        self._workers: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _started(self) -> tuple[HttpClient, ThreadPoolExecutor]:
        """The HTTP client and the worker threads, started if they are not."""
        with self._lock:
            if self._http is None or self._workers is None:
                self._http = HttpClient(self.api_key, self.connect_timeout_s)
                self._workers = ThreadPoolExecutor(self.threads, thread_name_prefix=self.name)
            return self._http, self._workers

    def http(self) -> HttpClient:
        """The HTTP client (for the caller's own exchanges), started if it is not."""
        return self._started()[0]

    def map(self, fn: Callable[..., object], *items: Iterable) -> list:
        """``fn`` over ``items`` on the worker threads (at most ``threads`` at once), results in order."""
        return list(self._started()[1].map(fn, *items))

    def post(self, url: str, body: object, *, timeout_s: float, max_bytes: int,
             parse: Callable[[object], object] | None = None) -> Outcome:
        """``post_retried`` under this poster's policy; ``PoolClosed`` once it is closed."""
        http = self._http
        if http is None:
            raise PoolClosed(f"{self.name}: the HTTP client is closed")
        return post_retried(http, url, body, self.policy, timeout_s=timeout_s, max_bytes=max_bytes, parse=parse,
                            sleep=self.sleep)

    def close(self) -> None:
        """Stop the worker threads (after their calls) and the HTTP client."""
        with self._lock:
            workers, http, self._workers, self._http = self._workers, self._http, None, None
        if workers is not None:
            workers.shutdown(wait=True)
        if http is not None:
            http.close()


def _unchanged(value: object) -> object:
    return value
