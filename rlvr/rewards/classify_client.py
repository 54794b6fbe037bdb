"""The client of a served reward model: ``POST /classify`` as vLLM (0.32) serves sequence-classification models, and
``rlvr serve`` does on CPUs.

The request, per conversation (chat): ``{"model", "messages": prompt + [assistant completion],
"use_activation": false, "truncate_prompt_tokens": N, "truncation_side": "left"}``; the server applies the model's
chat template (``add_generation_prompt`` false, no added special tokens). With ``chat: false``, one request holds
``batch_size`` texts: ``{"input": [prompt + completion, ...], ...}`` (special tokens added). ``use_activation:
false`` asks for the raw score: vLLM's default applies the pooler's activation, a sigmoid for one label.
``N`` is ``max_length``, lowered to the server's ``max_model_len`` (read once from ``GET /v1/models``: vLLM refuses
a larger one). The answer: ``{"data": [{"index", "label", "probs": [score], "num_classes": 1}, ...]}``.

Robustness: every request has ``timeout_s`` for all of it (connect, send, the whole answer) and a bound on the
answer's size (rlvr.rollout.http_client); timeouts, connection errors, 408, 429 and 5xx are retried ``retries``
times (rlvr.rollout.retry), after ``backoff_s`` doubling each time with up to 25 % jitter (at most 10 s), or longer
when the server's Retry-After asks (0.1 to 10 s). Other 4xx are not retried. Every value is checked: a JSON object,
as many items as texts sent, each index once, exactly one finite number each. A request that still fails, or whose
answer fails a check, scores its completions None (counted in ``drain_stats`` and said once per kind of failure on
stderr); a 401, 403 or 404 is an error (a wrong key, model name or URL: no request would ever succeed).
``batch_size`` requests are in flight at once.
"""

from __future__ import annotations

import sys
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx

from rlvr.platform.numbers import finite_float32
from rlvr.rewards.base import RewardConfigError, plain_text
from rlvr.rollout.http_client import SMALL_ANSWER_BYTES, api_key_from_env, error_message, printable, read_json, show
from rlvr.rollout.retry import RetriedPoster, RetryPolicy
from rlvr.rollout.server_errors import MalformedAnswer

CONNECT_TIMEOUT_S = 10.0


class Failed(Exception):
    """A request that got no usable answer: its completions score None."""


def check_url(base_url: str) -> str:
    """``base_url`` without a trailing ``/`` or ``/v1`` (vLLM serves /classify at the root), or a one-line error."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"reward_model: base_url {printable(base_url, 100)!r} must be http(s)://HOST[:PORT][/PATH]")
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def scores_of(body: object, n: int) -> list[float]:
    """The ``n`` scores of a /classify answer, in the order sent; ``MalformedAnswer`` if anything is off."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or len(data) != n:
        got = len(data) if isinstance(data, list) else "no list of"
        raise MalformedAnswer(f"an answer with {got} items for {n} texts")
    values: list[float | None] = [None] * n
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        probs = item.get("probs") if isinstance(item, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n or values[index] is not None:
            raise MalformedAnswer(f"an item index {show(index)} (expected each of 0..{n - 1} once)")
        if not isinstance(probs, list) or len(probs) != 1:
            raise MalformedAnswer(f"probs {show(probs)}: a reward model has one label, one score")
        value = finite_float32(probs[0])
        if value is None:
            raise MalformedAnswer(f"a score {show(probs[0])} that is not a number finite in float32")
        values[index] = value
    return values  # type: ignore[return-value]


class ClassifyClient:
    def __init__(self, base_url: str, model: str, api_key_env: str, batch_size: int, max_length: int, chat: bool,
                 timeout_s: float, retries: int, backoff_s: float):
        self.url = check_url(base_url)
        if not (timeout_s > 0 and retries >= 0 and backoff_s >= 0):
            raise ValueError("reward_model: timeout_s must be > 0, retries and backoff_s >= 0")
        self.api_key = api_key_from_env(api_key_env)
        if api_key_env and self.api_key is None:
            raise ValueError(f"reward_model: api_key_env names {api_key_env!r}, which is not set (or blank) in the "
                             "environment; export the server's API key there")
        self.model, self.batch_size, self.max_length, self.chat = model, batch_size, max_length, chat
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.poster = RetriedPoster(RetryPolicy(attempts=retries + 1, backoff_s=backoff_s), self.api_key,
                                    CONNECT_TIMEOUT_S, batch_size, "rlvr-reward-model")
        self._truncate: int | None = None
        self._lock = threading.Lock()
        self._stats = {"requests": 0, "retries": 0, "failed": 0, "latency_s": 0.0}
        self._said: set[str] = set()

    # --- one request ---------------------------------------------------------------------------------------
    def _post(self, body: dict, n: int) -> list[float]:
        """The scores of one request, retried as the module docstring says; ``Failed`` when there are none."""
        out = self.poster.post(f"{self.url}/classify", body, timeout_s=self.timeout_s,
                               max_bytes=SMALL_ANSWER_BYTES + 256 * n, parse=lambda answer: scores_of(answer, n))
        self._count(requests=out.attempts, retries=out.retries, latency_s=out.seconds)
        last, r = out.last, out.last.response
        if last.ok:
            return last.value  # type: ignore[return-value]
        if isinstance(last.error, MalformedAnswer):
            raise Failed(f"a malformed answer: {last.error}")
        if last.error is not None:  # timeouts, refused or dropped connections
            why = f"{type(last.error).__name__}: {printable(str(last.error), 200)}"
        elif r.status_code in (401, 403, 404):
            hint = ("check base_url and the model's name (the server's --served-model-name, or the path it was "
                    "started with)" if r.status_code == 404 else "put the server's API key in the environment "
                    "variable named by api_key_env")
            raise RewardConfigError(f"reward_model: {self.url}/classify refused the request ({r.status_code}: "
                              f"{error_message(r)}); {hint}")
        else:
            why = f"HTTP {r.status_code}: {error_message(r)}"
        raise Failed(f"{why} (after {out.attempts} attempts)" if last.retry else why)

    def _count(self, **amounts: float) -> None:
        with self._lock:
            for key, amount in amounts.items():
                self._stats[key] += amount

    def _failed(self, why: str, n: int) -> list[None]:
        self._count(failed=n)
        kind = why.split(":")[0]
        if kind not in self._said:  # each kind of failure said once
            self._said.add(kind)
            print(f"rlvr: reward_model at {self.url}: {n} completion(s) scored None: {why}", file=sys.stderr,
                  flush=True)
        return [None] * n

    def _one(self, body: dict, n: int) -> list[float | None]:
        try:
            return self._post(body, n)
        except Failed as err:
            return self._failed(str(err), n)

    # --- a call of the reward function -------------------------------------------------------------------
    def _start(self) -> None:
        """The HTTP client and worker threads, and the truncation length (``max_length``, at most the server's
        ``max_model_len``), at the first call."""
        http = self.poster.http()
        if self._truncate is None:
            try:
                r = http.request("GET", f"{self.url}/v1/models", timeout_s=self.timeout_s)
            except (httpx.TransportError, MalformedAnswer):
                return  # asked again at the next call; this one truncates at max_length
            if r.status_code in (401, 403):
                raise RewardConfigError(f"reward_model: {self.url}/v1/models refused the request ({r.status_code}); "
                                        "put the server's API key in the environment variable named by api_key_env")
            try:
                listed = read_json(r).get("data") if r.status_code == 200 else None
            except (MalformedAnswer, AttributeError):
                listed = None
            lens = [m.get("max_model_len") for m in listed if isinstance(m, dict) and m.get("id") == self.model] \
                if isinstance(listed, list) else []
            context = next((c for c in lens if isinstance(c, int) and not isinstance(c, bool) and c > 0), None)
            if isinstance(listed, list):  # a model it does not list gets /classify's own error
                self._truncate = min(self.max_length, context) if context is not None else self.max_length

    def score(self, prompts: list, texts: list[str]) -> list[float | None]:
        with self._lock:
            self._start()
        common = {"model": self.model, "use_activation": False,
                  "truncate_prompt_tokens": self._truncate or self.max_length, "truncation_side": "left"}
        if self.chat:
            bodies = [({**common, "messages": _messages(p, t)}, 1) for p, t in zip(prompts, texts)]
        else:
            plain = [plain_text(p, t) for p, t in zip(prompts, texts)]
            bodies = [({**common, "input": plain[i:i + self.batch_size]}, len(plain[i:i + self.batch_size]))
                      for i in range(0, len(plain), self.batch_size)]
        results = self.poster.map(lambda b: self._one(*b), bodies)
        return [v for part in results for v in part]

    def close(self) -> None:
        """Stop the worker threads and the HTTP client (a later call starts them again)."""
        self.poster.close()

    def drain_stats(self) -> dict[str, float]:
        """Since the last drain: requests sent, retries, completions scored None, mean seconds per request."""
        with self._lock:
            s, self._stats = self._stats, {"requests": 0, "retries": 0, "failed": 0, "latency_s": 0.0}
        return {"requests": s["requests"], "retries": s["retries"], "failed": s["failed"],
                "latency_s": s["latency_s"] / s["requests"] if s["requests"] else 0.0}


def _messages(prompt: Any, text: str) -> list[dict]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    return [*messages, {"role": "assistant", "content": text}]
