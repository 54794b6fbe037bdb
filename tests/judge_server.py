"""A scripted judge endpoint for tests: a real HTTP server on loopback speaking /v1/chat/completions.

Each request takes the next action of ``script`` (then ``default``): ``("text", s)`` answers s; ``("status", code,
headers)`` an error; ``("slow", seconds)`` answers by ``default`` after sleeping; ``("malformed",)`` a body that is
not JSON; ``("drop",)`` closes the connection without an answer. ``default(body)`` answers from the request: a
text (by default: the length of the tagged response modulo 11, so tests know every score by hand), a whole answer
(a dict), or an action tuple as above (a judge that fails some questions)."""

from __future__ import annotations

import collections
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TAGGED = re.compile(r"<response-(\w+)>\n(.*?)\n</response-\1>", re.DOTALL)


def tagged_responses(body: dict) -> list[str]:
    """The responses a judge request tagged, in the order shown."""
    return [m.group(2) for m in TAGGED.finditer(body["messages"][-1]["content"])]


def length_score(body: dict) -> str:
    """Per completion: len(response) % 11; per group: {"scores": [len % 11, ...]} in the order shown."""
    texts = tagged_responses(body)
    if len(texts) == 1:
        return str(len(texts[0]) % 11)
    return json.dumps({"scores": [len(t) % 11 for t in texts]})


class JudgeServer:
    def __init__(self, default=length_score):
        self.default = default
        self.script: collections.deque = collections.deque()
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    action = server.script.popleft() if server.script else ("default",)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                if action == ("default",):
                    got = server.default(body)
                    action = got if isinstance(got, tuple) else ("answer", got)
                try:
                    self._act(action, body)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _act(self, action: tuple, body: dict) -> None:
                kind = action[0]
                if kind == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if kind == "status":
                    self._send(action[1], {"error": {"message": "scripted", "code": action[1]}},
                               action[2] if len(action) > 2 else {})
                    return
                if kind == "malformed":
                    self._send(200, b"{not json", {})
                    return
                if kind == "slow":
                    time.sleep(action[1])
                text = action[1] if kind in ("text", "answer") else server.default(body)
                self._send(200, chat_answer(text) if isinstance(text, str) else text, {})

            def _send(self, status: int, payload, headers: dict) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its deadline)
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def chat_answer(text: str, top_logprobs: list[tuple[str, float]] | None = None) -> dict:
    """An OpenAI chat-completion answer with ``text`` (and the first token's top log-probs)."""
    logprobs = None
    if top_logprobs is not None:
        logprobs = {"content": [{"token": top_logprobs[0][0], "logprob": top_logprobs[0][1],
                                 "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top_logprobs]}]}
    return {"id": "x", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52}}
