"""The HTTP side of an LLM judge: one chat-completion call per question to an OpenAI-compatible endpoint (``rlvr
serve``, vLLM, any provider), with a concurrency limit, a deadline per call, bounded retries with backoff, a cache and
counters. A call that cannot be answered returns None - the judge scores it None, never 0.

Retried (rlvr.rollout.retry): timeouts, dropped connections, garbled answers, 408, 429 and 5xx (a Retry-After
honoured, bounded to 10 s); never retried: other 4xx. 401, 403 and 404 are the run's configuration (a wrong key,
model name or URL), so they raise ``JudgeConfigError`` instead of scoring every completion None. Every answer is
read through rlvr's HTTP client: a deadline for the whole exchange, a bound on its size, redirects not followed, its
JSON checked field by field.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import httpx

from rlvr.platform.numbers import finite_float32
from rlvr.rewards.base import RewardConfigError
from rlvr.rollout.http_client import answer_limit, error_message, printable
from rlvr.rollout.retry import RetriedPoster, RetryPolicy
from rlvr.rollout.server_errors import MalformedAnswer, PoolClosed

T = TypeVar("T")
CACHE_BYTES = 4 << 20  # the cache's bound, counted as its entries' JSON (least recently used dropped first)
MAX_GROUP = 4096  # scores in one cached value (a group judge's), at most


class JudgeConfigError(RewardConfigError):
    """The judge's endpoint refused the run's configuration (401, 403, 404): every call would fail the same way."""


@dataclass(frozen=True)
class Answer:
    """What a judge call returned: the reply's text and, when asked, the first token's top log-probs."""

    text: str
    top_logprobs: tuple[tuple[str, float], ...] = ()


Read = Callable[[Answer], T | None]  # what a judge makes of an answer (its score), None when it finds none


@dataclass
class JudgeStats:
    """Counters since the last ``drain`` (thread-safe): what the step's metrics report under ``judge/``."""

    calls: int = 0  # HTTP requests sent, retries included
    retries: int = 0
    failures: int = 0  # questions with no usable answer (scored None)
    unparsed: int = 0  # of which: answered, but not in the expected format
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0  # summed over calls
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: float) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def drain(self) -> dict[str, float]:
        """The counters (latency as the mean per call) and zero them."""
        with self.lock:
            names = ("calls", "retries", "failures", "unparsed", "cache_hits", "prompt_tokens", "completion_tokens")
            out = {name: float(getattr(self, name)) for name in names}
            out["latency_s"] = self.latency_s / self.calls if self.calls else 0.0
            for name in names:
                setattr(self, name, 0)
            self.latency_s = 0.0
        return out


@dataclass(frozen=True)
class Endpoint:
    """Where and how a judge asks: ``base_url`` (…/v1), the model name, the API key (from the environment), the
    limits."""

    base_url: str
    model: str
    api_key: str | None = None
    api: str = "chat"  # chat: /chat/completions (messages); completions: /completions (a prompt, for base models)
    concurrency: int = 8
    call_timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 0.5
    cache_bytes: int = CACHE_BYTES  # the answer cache's bound (0: no cache)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must be an http(s) URL (…/v1); got {self.base_url!r}")
        if self.api not in ("chat", "completions"):
            raise ValueError(f"judge api must be chat or completions; got {self.api!r}")
        if self.concurrency < 1 or self.retries < 0 or self.call_timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("judge: concurrency >= 1, retries >= 0, call_timeout_s > 0 and backoff_s >= 0")
        if type(self.cache_bytes) is not int or self.cache_bytes < 0:
            raise ValueError(f"judge: cache_bytes is a whole number of bytes >= 0; got {self.cache_bytes!r}")


class JudgeClient:
    """Asks an endpoint many questions at once (at most ``concurrency`` in flight); see the module docstring."""

    def __init__(self, endpoint: Endpoint, stats: JudgeStats, sleep: Callable[[float], None] = time.sleep):
        self.endpoint = endpoint
        self.stats = stats
        self.url = endpoint.base_url.rstrip("/") + ("/chat/completions" if endpoint.api == "chat" else "/completions")
        policy = RetryPolicy(attempts=endpoint.retries + 1, backoff_s=endpoint.backoff_s,
                             errors=(httpx.TransportError, MalformedAnswer))  # a garbled answer may be a passing fault
        self.poster = RetriedPoster(policy, endpoint.api_key, min(10.0, endpoint.call_timeout_s), endpoint.concurrency,
                                    "rlvr-judge", sleep)
        self._cache: OrderedDict[str, object] = OrderedDict()  # key -> what read made of its answer
        self._cache_size = 0  # bytes: sum of entry_bytes over the cache
        self.cache_bytes = endpoint.cache_bytes
        self._lock = threading.Lock()

    def key(self, body: dict) -> str:
        """The cache key of a request body: a digest of the URL, the model and the body."""
        return hashlib.sha256((self.url + "\0" + json.dumps({"model": self.endpoint.model, **body},
                                                            sort_keys=True)).encode()).hexdigest()

    def ask_all(self, bodies: list[dict], read: Read | list[Read], keys: list[str] | None = None) -> list[T | None]:
        """What ``read`` (one for all, or one per body) makes of the answer to each request body (a score; None
        where no answer could be had or ``read`` found none in it), in order. Only what ``read`` returns is cached
        (under ``keys``, default ``key(body)``), never an answer's text (a broken endpoint's oversized replies hold
        no memory), and only when it is not None (an unparsed answer is asked again)."""
        if not bodies:
            return []
        reads = read if isinstance(read, list) else [read] * len(bodies)
        keys = [self.key(b) for b in bodies] if keys is None else keys
        bodies = [{"model": self.endpoint.model, **b} for b in bodies]
        unique = {k: (b, r) for k, b, r in zip(keys, bodies, reads)}  # a question asked twice is asked once
        self.stats.add(cache_hits=len(keys) - len(unique))
        values = dict(zip(unique, self.poster.map(self._ask, unique.keys(), unique.values())))
        return [values[k] for k in keys]

    def _ask(self, key: str, asked: tuple[dict, Read]) -> T | None:
        body, read = asked
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats.add(cache_hits=1)
                return self._cache[key]
        answer = self._with_retries(body)
        if answer is None:
            self.stats.add(failures=1)
            return None
        value = read(answer)
        if value is not None:
            with self._lock:
                self._remember(key, value)
        return value

    def _remember(self, key: str, value: object) -> None:
        """Cache ``value`` under ``key``, dropping the least recently used entries past ``cache_bytes`` (the caller
        holds the lock)."""
        if key in self._cache:
            self._cache_size -= entry_bytes(key, self._cache.pop(key))
        self._cache[key] = value
        self._cache_size += entry_bytes(key, value)
        while self._cache_size > self.cache_bytes and self._cache:
            old_key, old = self._cache.popitem(last=False)
            self._cache_size -= entry_bytes(old_key, old)

    def cache_entries(self) -> list[list]:
        """The cache as ``[key, value]`` pairs, least recently used first (what a checkpoint keeps)."""
        with self._lock:
            return [[k, v] for k, v in self._cache.items()]

    def restore_cache(self, entries: object) -> int:
        """Load ``cache_entries()``'s pairs, from a checkpoint (untrusted: every pair is checked - a 64-digit hex
        key, a score in [0, 1] or a list of at most MAX_GROUP of them - and ``cache_bytes`` bounds what is kept);
        returns the entries kept. Raises ValueError on a malformed list."""
        if not isinstance(entries, list) or not all(_cache_pair(e) for e in entries):
            raise ValueError("a judge cache is a list of [64-digit hex key, score in [0, 1] or a list of scores]")
        with self._lock:
            for key, value in entries:
                self._remember(key, [float(v) for v in value] if isinstance(value, list) else float(value))
            return len(self._cache)

    def _with_retries(self, body: dict) -> Answer | None:
        """The answer to one request body, retried under the policy (None when there is none)."""
        limit = answer_limit(int(body.get("max_tokens") or 0) * max(1, int(body.get("top_logprobs") or 0)))
        try:
            out = self.poster.post(self.url, body, timeout_s=self.endpoint.call_timeout_s, max_bytes=limit,
                                   parse=self._answer)
        except PoolClosed:
            return None
        self.stats.add(calls=out.attempts, retries=out.retries, latency_s=out.seconds)
        r = out.last.response
        if out.last.ok:
            return out.last.value
        if out.last.error is None and r.status_code in (401, 403, 404):
            what = {401: "refused the API key (or its absence)", 403: "refused the API key",
                    404: "does not serve that model or route"}[r.status_code]
            raise JudgeConfigError(f"judge endpoint {self.url} {what} ({r.status_code}: {error_message(r)}); "
                                   "check the judge's base_url, model and api_key_env")
        return None  # retries spent, or another 4xx: asking again would get the same answer

    def _answer(self, payload: object) -> Answer:
        """The first choice's text (and first token's top log-probs) from a (chat) completion answer, checked."""
        chat = self.endpoint.api == "chat"
        try:
            choice = payload["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
        except (TypeError, KeyError, IndexError):
            raise MalformedAnswer("an answer without choices[0]'s text") from None
        if not isinstance(text, str):
            raise MalformedAnswer("a non-string answer text")
        usage = payload.get("usage") if isinstance(payload, dict) else None
        if isinstance(usage, dict):
            tokens = [usage.get(k) for k in ("prompt_tokens", "completion_tokens")]
            if all(isinstance(t, int) and 0 <= t < 1 << 31 for t in tokens):
                self.stats.add(prompt_tokens=tokens[0], completion_tokens=tokens[1])
        logprobs = choice.get("logprobs")
        return Answer(text, _first_top_logprobs(logprobs) if chat else _first_top_completion_logprobs(logprobs))

    def close(self) -> None:
        """Stop the worker threads and the HTTP client (a later call starts them again)."""
        self.poster.close()


def entry_bytes(key: str, value: object) -> int:
    """A cache entry's size as a checkpoint stores it: its JSON pair."""
    return len(json.dumps([key, value]))


def _score(value: object) -> bool:
    x = finite_float32(value)
    return x is not None and 0.0 <= x <= 1.0


def _cache_pair(entry: object) -> bool:
    if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and len(entry[0]) == 64):
        return False
    key, value = entry
    if not all(c in "0123456789abcdef" for c in key):
        return False
    if isinstance(value, list):
        return 0 < len(value) <= MAX_GROUP and all(_score(v) for v in value)
    return _score(value)


def _checked(pairs: list, limit: int = 64) -> tuple[tuple[str, float], ...]:
    """(token, logprob) pairs, each a string and a finite log-prob <= 0 (-inf: dropped, probability 0)."""
    out = []
    for token, lp in pairs[:limit]:
        if lp == -math.inf:
            continue
        value = finite_float32(lp)  # -1e300 or a 401-digit integer: malformed, like NaN
        if not isinstance(token, str) or value is None or value > 1e-6:
            raise MalformedAnswer(f"a top log-prob not (token, finite logprob <= 0): {printable((token, lp), 80)}")
        out.append((token, value))
    return tuple(out)


def _first_top_completion_logprobs(logprobs: object) -> tuple[tuple[str, float], ...]:
    """The first token's alternatives from /completions' ``logprobs`` (``top_logprobs``: one {token: logprob} a
    token); () without."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("top_logprobs"), list) \
            or not logprobs["top_logprobs"]:
        return ()
    first = logprobs["top_logprobs"][0]
    if not isinstance(first, dict):
        raise MalformedAnswer("logprobs.top_logprobs[0] is not an object")
    return _checked(list(first.items()))


def _first_top_logprobs(logprobs: object) -> tuple[tuple[str, float], ...]:
    """The first generated token's alternatives, [(text, logprob)], from OpenAI's chat ``logprobs`` (() without)."""
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("content"), list) or not logprobs["content"]:
        return ()
    first = logprobs["content"][0]
    top = first.get("top_logprobs") if isinstance(first, dict) else None
    if not isinstance(top, list):
        raise MalformedAnswer("logprobs.content[0] without a top_logprobs list")
    return _checked([(e.get("token"), e.get("logprob")) if isinstance(e, dict) else (None, None) for e in top])
