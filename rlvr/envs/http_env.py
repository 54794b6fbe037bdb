"""A client for environments served over HTTP in the OpenEnv style, shaped like ``EpisodeEnv`` for the sampler.

Protocol (openenv-core 0.3.0, ``openenv/core/env_server/http_server.py`` and ``types.py``; the server is
``create_app`` / ``create_fastapi_app(EnvClass, ActionClass, ObservationClass, max_concurrent_envs=N)`` under
uvicorn):

- ``POST /reset`` with a JSON object (``seed``, ``episode_id`` and any other field; the server passes on those
  that the environment's ``reset`` accepts) -> ``{"observation": {...}, "reward": float | null, "done": bool}``.
- ``POST /step`` with ``{"action": {...}, "timeout_s": float}`` -> the same shape; an action that fails the
  environment's Action model is HTTP 422.
- ``GET /health``, ``GET /state``, ``GET /schema``, ``GET /metadata`` (not used here).
- ``/ws``, a WebSocket: one environment instance per connection, messages ``{"type": "reset", "data": {...}}``,
  ``{"type": "step", "data": action}``, ``{"type": "close"}``, answered by ``{"type": "observation", "data":
  <the shape above>}`` or ``{"type": "error", "data": {"message", "code"}}``. This is what openenv's own
  ``EnvClient`` speaks.

In openenv-core since its WebSocket change (OpenEnv PR #239), HTTP ``/reset`` and ``/step`` make a new
environment from the factory for every request and close it after: state does not survive from one request
to the next unless the server's factory returns one shared instance. So ``transport="ws"`` (the default) is
the one for a stock openenv-core server, one connection per episode; ``transport="http"`` is for servers that
keep one episode per server (a shared instance, older openenv, hand-written servers).

The model's turn becomes the action through ``action`` (default ``message_action``: ``{"message": text}``, the
field of OpenEnv's echo and chat-style text environments); the observation object becomes the text the model
reads through ``observation_to_text`` (default ``observation_text``); the dataset row becomes the reset fields
through ``reset_payload`` (default ``row_payload``). There are no tool calls: every model turn is one action.

Validated (a hostile or broken server): the request size, the answer's size (``max_response_bytes``: the
declared length, then the bytes read, inflated at most that far: gzip and deflate only, though rlvr asks for
none), one deadline per request (connecting, the headers, the whole body; a WebSocket's handshake and answer),
no redirects (a WebSocket redirect is refused before any connection to its target), JSON that parses, an object with an
``observation`` object, ``reward`` null or a finite number, ``done`` a boolean; text over ``max_chars`` is cut.
A failure is ``HttpEnvError`` (an ``EpisodeError``), one line naming the server, the request and what was wrong.
What the model caused is not an error: an action the server rejects (HTTP 422, WebSocket ``VALIDATION_ERROR``)
is a ``bad_arguments`` observation and the episode goes on; a step past its deadline is counted as a ``timeout``
in ``stats`` and ends the episode (the server may still apply the action).

NOT protected: the server is trusted with what it says (rewards included) and sees the whole row and every
model turn; the API key is sent to whatever ``base_url`` names, in clear text over plain http; TLS and proxies
are httpx's and websockets' defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from rlvr.envs.environment import EpisodeError
from rlvr.envs.tools import MAX_RESULT_CHARS, Observation, ToolStats
from rlvr.platform.numbers import finite_float32

MAX_RESPONSE_BYTES = 1 << 20
MAX_REQUEST_BYTES = 1 << 20
SHOWN = 300  # characters of a server's error text put in a message


class HttpEnvError(EpisodeError):
    """The environment server failed or answered something unusable: one line naming the server and request."""


def message_action(text: str) -> dict:
    """The default action: the whole model turn as ``{"message": text}``."""
    return {"message": text}


def observation_text(observation: Mapping[str, Any]) -> str:
    """The default observation text: the only field when the observation has one string field, else the
    observation as compact JSON (field order kept)."""
    if len(observation) == 1:
        (value,) = observation.values()
        if isinstance(value, str):
            return value
    return json.dumps(observation, ensure_ascii=False, separators=(",", ":"), default=str)


def row_payload(row: Mapping[str, Any]) -> dict:
    """The default reset fields: every column of the row that is plain JSON (others are left out)."""
    payload = {}
    for key, value in row.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            continue
        payload[str(key)] = value
    return payload


def _short(text: str) -> str:
    """A server's text fit for a message: one line, control characters (terminal escapes) as ``?``, bounded."""
    line = " ".join(text[: SHOWN * 4].split())
    line = "".join(c if c.isprintable() else "?" for c in line)
    return line if len(line) <= SHOWN else line[:SHOWN] + "..."


_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None  # (pid, loop): a forked child starts its own
_LOOP_LOCK = threading.Lock()


def _wire_loop() -> asyncio.AbstractEventLoop:
    """The event loop every HTTP exchange runs on (a daemon thread, started on first use), so that one
    ``asyncio.timeout`` bounds the whole exchange: httpx's own timeouts apply to each read, and a server
    trickling its headers a byte at a time would never time out."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rlvr-env-http", daemon=True).start()
            _LOOP = (os.getpid(), loop)
        return _LOOP[1]


class BoundedBody:
    """An answer's body read chunk by chunk, never more than ``limit`` bytes once inflated: identity, or gzip /
    deflate inflated at most ``limit`` + 1 bytes at a time (a 64 KiB gzip answer can inflate to 64 MiB). Other
    encodings (br, zstd) are refused unread: rlvr asks for none."""

    def __init__(self, encoding: str, limit: int, where: str) -> None:
        name = encoding.strip().lower()
        self.limit, self.where, self.buf = limit, where, bytearray()
        if name in ("", "identity"):
            self._inflater = None
        elif name in ("gzip", "x-gzip", "deflate"):
            self._inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if "gzip" in name else zlib.MAX_WBITS)
        else:
            raise HttpEnvError(f"{where}: the answer is compressed ({_short(name)!r}), which rlvr did not ask for "
                               "and does not read; make the server answer plain JSON")

    def add(self, chunk: bytes) -> None:
        if self._inflater is None:
            self.buf += chunk
        try:
            while chunk and self._inflater is not None and len(self.buf) <= self.limit:
                self.buf += self._inflater.decompress(chunk, self.limit + 1 - len(self.buf))
                chunk = self._inflater.unconsumed_tail
        except zlib.error:
            raise HttpEnvError(f"{self.where}: the answer's compressed stream is broken") from None
        if len(self.buf) > self.limit:
            inflated = " once inflated" if self._inflater is not None else ""
            raise HttpEnvError(f"{self.where}: the answer is over {self.limit} bytes{inflated}")

    def finish(self) -> bytes:
        if self._inflater is not None and not self._inflater.eof:
            raise HttpEnvError(f"{self.where}: the answer's compressed stream is cut short")
        return bytes(self.buf)


class HttpEnvironment:
    """One episode against an environment server: ``reset(row)`` once, ``step(text, timeout_s)`` per model
    turn, ``reward()``, ``release()`` - the names of ``EpisodeEnv``. Not for use from two threads at once."""

    def __init__(self, base_url: str, *, transport: str = "ws", api_key: str | None = None,
                 action: Callable[[str], dict] = message_action,
                 observation_to_text: Callable[[Mapping[str, Any]], str] = observation_text,
                 reset_payload: Callable[[Mapping[str, Any]], dict] = row_payload,
                 timeout_s: float = 30.0, max_response_bytes: int = MAX_RESPONSE_BYTES,
                 max_request_bytes: int = MAX_REQUEST_BYTES, max_chars: int = MAX_RESULT_CHARS,
                 name: str = "openenv") -> None:
        if transport not in ("ws", "http"):
            raise ValueError(f"transport must be 'ws' or 'http', got {transport!r}")
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.transport = transport
        self.name = name  # the tool name in ``stats``
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._action, self._to_text, self._reset_payload = action, observation_to_text, reset_payload
        self.timeout_s = timeout_s  # reset, and steps given no timeout
        self.max_response_bytes, self.max_request_bytes, self.max_chars = (max_response_bytes, max_request_bytes,
                                                                           max_chars)
        self.stats = ToolStats()
        self.turns = 0
        self.seconds = 0.0
        self.observation: str | None = None  # the text of the last observation (reset's, then each step's)
        self.rewards: list[float | None] = []  # every reward reported, reset's first
        self.done = False
        self._started = self._ended = self._released = False
        self._http: httpx.AsyncClient | None = None
        self._ws: Any = None

    @property
    def instance(self) -> HttpEnvironment:
        """What reward functions get as one of ``environments`` (the client itself: ``observation``, ``rewards``)."""
        return self

    # --- the EpisodeEnv interface ---

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Start the episode with the row's fields; the observation text to add to the prompt, or None when the
        observation is empty."""
        if self._started:
            raise HttpEnvError(f"{self.base_url}: reset called twice for one episode; make a new HttpEnvironment")
        self._started = True
        try:
            payload = self._reset_payload(row)
        except Exception as err:  # noqa: BLE001 (the user's reset_payload)
            raise HttpEnvError(f"{self.base_url}: reset_payload raised {type(err).__name__}: {err}") from None
        kind, answer = self._request("reset", payload, self.timeout_s)
        if kind != "ok":  # not reached: only a step is rejected or times out
            raise HttpEnvError(f"{self._where('reset')}: {kind}")
        observation, self.done = self._take(answer, "reset")
        text = self._cut(self._text(observation))[0] if observation else None
        self.observation = text
        return text

    def step(self, text: str, timeout_s: float) -> list[Observation]:
        """Send the model's turn as one action; its observation, or [] when the episode is over: the server said
        ``done`` (the final observation is then in ``observation``), reset said it, or the step timed out (counted in
        ``stats``). ``timeout_s`` <= 0: the client's ``timeout_s``."""
        if not self._started:
            raise HttpEnvError(f"{self.base_url}: step before reset")
        if self._ended:
            raise HttpEnvError(f"{self.base_url}: step after the episode ended")
        self.turns += 1
        if self.done:  # reset said so: this turn ends the episode
            self._ended = True
            return []
        try:
            action = self._action(text)
        except Exception as err:  # noqa: BLE001 (the user's action builder)
            raise HttpEnvError(f"{self.base_url}: the action builder raised {type(err).__name__}: {err}") from None
        if not isinstance(action, dict):
            raise HttpEnvError(f"{self.base_url}: the action builder returned {type(action).__name__}; return a dict")
        timeout = timeout_s if timeout_s > 0 else self.timeout_s
        start = time.perf_counter()
        kind, answer = self._request("step", action, timeout)
        seconds = time.perf_counter() - start
        if kind == "timeout":
            self.done = True  # the server may still apply the action: the episode cannot go on
            obs = Observation(self.name, "timeout", f"error: the environment did not answer within {timeout:g} s",
                              seconds)
            self.observation = obs.text
        elif kind == "rejected":
            obs = Observation(self.name, "bad_arguments", f"error: the environment rejected the action: {answer}",
                              seconds)
        else:
            observation, self.done = self._take(answer, "step")
            body, cut = self._cut(self._text(observation))
            self.observation = body
            obs = Observation(self.name, "ok", body, seconds, cut)
        self.stats.record(obs)
        if self.done:
            self._ended = True
            return []
        return [obs]

    def reward(self) -> float | None:
        """The last reward the server reported that was not null (None when none was)."""
        return next((r for r in reversed(self.rewards) if r is not None), None)

    def release(self) -> None:
        """Close the episode's connection (a WebSocket gets ``{"type": "close"}`` first). Idempotent."""
        if self._released:
            return
        self._released = True
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):  # best effort: the connection may be gone already
                ws.send(json.dumps({"type": "close"}))
            ws.close()
        http, self._http = self._http, None
        if http is not None:
            with contextlib.suppress(Exception):  # best effort: connections close with the process anyway
                asyncio.run_coroutine_threadsafe(http.aclose(), _wire_loop()).result(5)

    # --- the wire ---

    def _where(self, what: str) -> str:
        """The request, as messages name it: ``POST http://host/step`` or ``ws://host/ws step``."""
        if self.transport == "http":
            return f"POST {self.base_url}/{what}"
        return f"ws{self.base_url.removeprefix('http')}/ws {what}"

    def _text(self, observation: Mapping[str, Any]) -> str:
        try:
            text = self._to_text(observation)
        except Exception as err:  # noqa: BLE001 (the user's observation_to_text)
            raise HttpEnvError(f"{self.base_url}: observation_to_text raised {type(err).__name__}: "
                               f"{_short(str(err))}") from None
        if not isinstance(text, str):
            raise HttpEnvError(f"{self.base_url}: observation_to_text returned {type(text).__name__}; return a str")
        return text

    def _cut(self, text: str) -> tuple[str, int]:
        """``text`` bounded by ``max_chars`` (a note says how much was cut), and the characters cut."""
        cut = max(0, len(text) - self.max_chars)
        return (text[: self.max_chars] + f"\n[truncated: {cut} more characters]", cut) if cut else (text, 0)

    def _take(self, answer: Any, what: str) -> tuple[dict, bool]:
        """Check one ``{"observation", "reward", "done"}`` object; record the reward."""
        where = self._where(what)
        if not isinstance(answer, dict):
            raise HttpEnvError(f"{where}: expected a JSON object, got {type(answer).__name__}")
        observation = answer.get("observation")
        if not isinstance(observation, dict):
            got = "nothing" if "observation" not in answer else type(observation).__name__
            raise HttpEnvError(f"{where}: \"observation\" must be an object, got {got}")
        reward = answer.get("reward")
        if reward is not None:
            if not isinstance(reward, (int, float)):  # bool too: OpenEnv's Observation.reward allows it
                raise HttpEnvError(f"{where}: \"reward\" must be a number or null, got "
                                   f"{type(reward).__name__}")
            finite = finite_float32(float(reward) if isinstance(reward, bool) else reward)  # 10**400, 1e300: refused
            if finite is None:
                raise HttpEnvError(f"{where}: \"reward\" is {str(reward)[:40]}; rewards must be finite in float32")
            reward = finite
        done = answer.get("done", False)
        if not isinstance(done, bool):
            raise HttpEnvError(f"{where}: \"done\" must be true or false, got {type(done).__name__}")
        self.rewards.append(reward)
        return observation, done

    def _encode(self, body: dict, what: str) -> str:
        try:
            content = json.dumps(body, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as err:
            raise HttpEnvError(f"{self._where(what)}: the request is not JSON ({_short(str(err))})") from None
        if len(content.encode()) > self.max_request_bytes:
            raise HttpEnvError(f"{self._where(what)}: the request is over {self.max_request_bytes} bytes")
        return content

    def _decode(self, raw: bytes | str, what: str) -> Any:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as err:  # bad JSON, bad UTF-8, an int over Python's digit limit
            raise HttpEnvError(f"{self._where(what)}: the answer is not JSON ({_short(str(err))})") from None

    def _request(self, what: str, body: dict, timeout: float) -> tuple[str, Any]:
        """("ok", the observation object), ("rejected", why) or ("timeout", None); raises HttpEnvError."""
        start = time.perf_counter()
        try:
            return self._ws_request(what, body, timeout) if self.transport == "ws" else \
                self._http_request(what, body, timeout)
        finally:
            self.seconds += time.perf_counter() - start

    def _http_request(self, what: str, body: dict, timeout: float) -> tuple[str, Any]:
        url, where = f"{self.base_url}/{what}", self._where(what)
        if what == "step":
            body = {"action": body, "timeout_s": timeout}
        content = self._encode(body, what)
        if self._http is None:
            self._http = httpx.AsyncClient(headers={**self._headers, "accept-encoding": "identity"},
                                           follow_redirects=False)
        future = asyncio.run_coroutine_threadsafe(self._exchange(url, where, content, timeout), _wire_loop())
        try:
            status, raw = future.result(timeout + 10)  # the loop enforces the deadline; this is a backstop
        except (TimeoutError, httpx.TimeoutException):
            future.cancel()
            if what == "step":
                return "timeout", None
            raise HttpEnvError(f"{where}: no answer within {timeout:g} s") from None
        except httpx.HTTPError as err:
            raise HttpEnvError(f"{where}: cannot reach the server ({type(err).__name__}: {_short(str(err))})") from None
        text = raw.decode("utf-8", "replace")
        if status == 422 and what == "step":
            return "rejected", _short(text)
        if status != 200:
            hint = " (check api_key)" if status in (401, 403) else ""
            raise HttpEnvError(f"{where}: HTTP {status}{hint}: {_short(text) or '(empty)'}")
        return "ok", self._decode(raw, what)

    async def _exchange(self, url: str, where: str, content: str, timeout: float) -> tuple[int, bytes]:
        """Status and body of one POST, all of it (connect, headers, body) within ``timeout`` seconds and the body
        within ``max_response_bytes`` once inflated."""
        async with asyncio.timeout(timeout):
            async with self._http.stream("POST", url, content=content, timeout=timeout,
                                         headers={"content-type": "application/json"}) as response:
                declared = response.headers.get("content-length", "")
                if declared.isascii() and declared.isdigit() and int(declared[:20]) > self.max_response_bytes:
                    raise HttpEnvError(f"{where}: the answer is {declared} bytes, over {self.max_response_bytes}")
                body = BoundedBody(response.headers.get("content-encoding", ""), self.max_response_bytes, where)
                async for chunk in response.aiter_raw():
                    body.add(chunk)
                return response.status_code, body.finish()

    def _ws_request(self, what: str, body: dict, timeout: float) -> tuple[str, Any]:
        url, where = "ws" + self.base_url.removeprefix("http") + "/ws", self._where(what)
        content = self._encode({"type": what, "data": body}, what)
        try:
            from websockets.exceptions import ConnectionClosed, WebSocketException
            from websockets.sync.client import connect
        except ImportError:
            raise HttpEnvError(f"{where}: transport='ws' needs the websockets package (pip install websockets); "
                               "or use transport='http' with a server that keeps state across requests") from None
        deadline = time.monotonic() + timeout
        try:
            if self._ws is None:
                self._ws = self._ws_connect(url, where, timeout, connect)
            self._ws.send(content)
            raw = self._ws.recv(timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            if what == "step":
                self._drop()
                return "timeout", None
            raise HttpEnvError(f"{where}: no answer within {timeout:g} s") from None
        except ConnectionClosed as err:
            self._drop()
            too_big = err.rcvd is not None and err.rcvd.code == 1009 or err.sent is not None and err.sent.code == 1009
            why = f"the answer is over {self.max_response_bytes} bytes" if too_big else f"the connection closed ({err})"
            raise HttpEnvError(f"{where}: {why}") from None
        except (OSError, WebSocketException) as err:
            self._drop()
            raise HttpEnvError(f"{where}: cannot reach the server ({type(err).__name__}: "
                               f"{_short(str(err))})") from None
        message = self._decode(raw, what)
        if not isinstance(message, dict) or not isinstance(message.get("data"), dict):
            raise HttpEnvError(f"{where}: expected {{\"type\", \"data\": {{...}}}}, got {_short(str(message))}")
        if message.get("type") == "error":
            data = message["data"]
            detail = _short(str(data.get("message", ""))) + (f" {_short(str(data['errors']))}" if "errors" in data
                                                              else "")
            if what == "step" and data.get("code") == "VALIDATION_ERROR":
                return "rejected", detail
            raise HttpEnvError(f"{where}: server error {_short(str(data.get('code', '')))}: {detail}")
        if message.get("type") != "observation":
            raise HttpEnvError(f"{where}: expected an observation, got type {_short(str(message.get('type')))}")
        return "ok", message["data"]

    def _ws_connect(self, url: str, where: str, timeout: float, connect):
        """The WebSocket, on a TCP connection opened here to base_url's own address: websockets follows a redirect by
        opening a connection of its own, which it cannot do from a socket it was given, so a redirect ends here -
        no connection is made to the address a server names, and no row is sent anywhere."""
        from websockets.uri import parse_uri

        asked = parse_uri(url)
        sock = socket.create_connection((asked.host, asked.port), timeout=timeout)
        try:
            return connect(url, sock=sock, open_timeout=timeout, max_size=self.max_response_bytes, close_timeout=1,
                           additional_headers=self._headers or None)
        except ValueError as err:
            sock.close()
            if "redirect" not in str(err):
                raise
            target = str(err).split(" to ", 1)[-1].split(" with ", 1)[0]
            raise HttpEnvError(f"{where}: the server redirected the connection to {_short(target)}; rlvr follows no "
                               "redirects (the row would go there): give base_url the final address") from None
        except BaseException:
            sock.close()
            raise

    def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.close()


class HttpEnvSpec:
    """``EnvironmentSpec``'s interface for the episode sampler over an environment server: one ``HttpEnvironment``
    per episode (``kwargs`` go to it), no tools (every model turn is one action), the server's last reward as the
    environment's reward."""

    tool_names: tuple[str, ...] = ()
    has_reward = True

    def __init__(self, base_url: str, **kwargs: Any) -> None:
        self.base_url, self.kwargs = base_url, kwargs
        self.name = kwargs.get("name", "openenv")
        HttpEnvironment(base_url, **kwargs)  # the settings are checked now, before any episode

    def episode(self) -> HttpEnvironment:
        return HttpEnvironment(self.base_url, **self.kwargs)

    def schemas(self) -> list[dict]:
        return []
