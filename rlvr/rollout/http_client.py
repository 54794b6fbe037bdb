"""The server pool's HTTP client: every exchange with a rollout server has a wall-clock deadline for the whole of it
(connect, send, headers, body) and a bound on the answer's size (httpx's own timeouts apply to each read, so a
server trickling bytes would never time out), and with an API key carries ``Authorization: Bearer KEY``
(``rlvr serve --api-key``, vLLM's ``--api-key``). Also here: reading what a server answered (its JSON, its error
message, its Retry-After) without trusting it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import threading

import httpx

from rlvr.rollout.server_errors import MalformedAnswer, PoolClosed, ServerAuthError

API_KEY_ENV = "RLVR_API_KEY"  # where rlvr serve, the servers a run starts and the pool find the API key by default

SMALL_ANSWER_BYTES = 1 << 20  # /health, /v1/models, /stats, adapter loads, error bodies


def answer_limit(tokens: int) -> int:
    """Bytes a generation answer for ``tokens`` requested tokens may take: 1 MiB plus 4 KiB a token (vLLM's
    answer with one log-prob per token takes ~250 bytes a token)."""
    return SMALL_ANSWER_BYTES + 4096 * max(tokens, 0)


def api_key_from_env(name: str) -> str | None:
    """The API key in environment variable ``name``, stripped (None when the name is empty or the variable unset
    or blank): the key itself never appears in a config file."""
    key = os.environ.get(name, "").strip() if name else ""
    return key or None


def printable(text: str, limit: int = 300) -> str:
    """A server's text fit for an error message: control characters (terminal escapes) replaced, length bounded."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def show(value: object) -> str:
    """A value a server sent, fit for an error message: its repr, printable, at most 40 characters."""
    return printable(repr(value), 40)


class HttpClient:
    """Every exchange runs on one event-loop thread under ``asyncio.timeout``, so its deadline covers connecting,
    sending, the headers and the whole body, and its answer is read up to a byte bound; callers (any thread) block
    on the result. Redirects are not followed (the key stays with the servers it was meant for) and compressed
    answers are not asked for (the bound is on what is read)."""

    def __init__(self, api_key: str | None, connect_timeout_s: float):
        if api_key is not None and (not api_key.isascii() or not api_key.isprintable() or " " in api_key):
            raise ValueError("the API key must be printable ASCII without spaces")
        self.api_key = api_key
        self.connect_timeout_s = connect_timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rlvr-pool-http", daemon=True)
        self.thread.start()
        self._closed = False
        self._lock = threading.Lock()
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

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
                        raise MalformedAnswer(f"a compressed answer ({show(r.headers['content-encoding'])}), "
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

    def auth_error(self, url: str, path: str, r: httpx.Response) -> ServerAuthError:
        """The error for a 401 / 403 from ``url``: it says where the key comes from."""
        hint = ("the server does not accept the pool's API key: give the servers and the pool the same key (the "
                f"pool reads it from the environment variable named by rollout.api_key_env, default {API_KEY_ENV})"
                if self.api_key else
                "the server requires an API key and the pool sent none: put the key in the environment variable "
                f"named by rollout.api_key_env (default {API_KEY_ENV})")
        return ServerAuthError(f"{url}{path} refused the request ({r.status_code}: {error_message(r)}); {hint}")

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


def read_json(r: httpx.Response) -> object:
    """The answer's JSON, or ``MalformedAnswer``."""
    try:
        return json.loads(r.content)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than Python's stack
        raise MalformedAnswer(f"an answer that is not JSON (status {r.status_code})") from None


def error_message(r: httpx.Response) -> str:
    """What an error answer says (OpenAI's ``{"error": {"message": ...}}``, or its body), printable."""
    try:
        body = json.loads(r.content)
    except (ValueError, RecursionError):
        return printable(r.content.decode("utf-8", "replace"))
    if isinstance(body, dict):
        err = body.get("error", body)
        return printable(err.get("message", err) if isinstance(err, dict) else err)
    return printable(body)


def retry_after(r: httpx.Response, most_s: float = 10.0) -> float | None:
    """Seconds an answer's Retry-After asks for, bounded to [0.1, ``most_s``] (None without a usable one)."""
    try:
        seconds = float(r.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(seconds, 0.1), most_s) if math.isfinite(seconds) else None
