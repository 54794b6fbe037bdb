"""Security review (issue 39), the OpenEnv client against hostile servers on loopback: plain sockets that write
exactly the bytes a test scripts (headers trickled a byte at a time, a brotli or gzip bomb, terminal escapes in an
error, a redirect), and a real WebSocket server behind the redirect. Nothing is timed: the trickle lasts five
times the client's deadline, so only a client that enforces one deadline for the whole exchange sees a timeout."""

from __future__ import annotations

import gzip
import socket
import threading
import time
import tracemalloc

import brotli
import pytest

from rlvr.envs.http_env import HttpEnvError, HttpEnvironment

GOOD = b'{"observation": {"text": "fine"}, "reward": null, "done": false}'


class RawServer:
    """Accepts connections on 127.0.0.1 and answers each request (read up to its blank line and body) with
    ``answer(conn)``, which writes what it likes. ``stop`` closes the listener and joins every thread."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.stopping = False
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests: list[bytes] = []
        self.threads: list[threading.Thread] = []
        self.accepting = threading.Thread(target=self._accept, daemon=True)
        self.accepting.start()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + body)
                self.answer(conn)
            except OSError:  # the client hung up, as a client with a deadline does
                pass

    def stop(self) -> None:
        self.stopping = True
        self.accepting.join(5)
        self.sock.close()
        for thread in self.threads:
            thread.join(15)
        assert not any(t.is_alive() for t in [self.accepting, *self.threads])


@pytest.fixture
def serve():
    servers = []

    def start(answer) -> RawServer:
        servers.append(RawServer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def answer_with(body: bytes, status: str = "200 OK", headers: str = ""):
    def answer(conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n{headers}connection: close\r\n\r\n"
                     .encode() + body)
    return answer


TRICKLED: list[str] = []  # per answer: "whole" when every byte went out, "cut off" when the client left first


def trickle(conn: socket.socket) -> None:
    """A valid answer whose headers take 23 x 0.25 s (about 6 s) to arrive, a byte at a time."""
    try:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        for byte in b"x-pad: ..............\r\n":
            conn.sendall(bytes([byte]))
            time.sleep(0.25)
        conn.sendall(f"content-length: {len(GOOD)}\r\nconnection: close\r\n\r\n".encode() + GOOD)
    except OSError:
        TRICKLED.append("cut off")
        raise
    TRICKLED.append("whole")


def test_trickled_headers_hit_the_one_deadline(serve):
    TRICKLED.clear()
    server = serve(trickle)
    env = HttpEnvironment(server.url, transport="http", timeout_s=1)
    with pytest.raises(HttpEnvError, match=r"^POST http://127\.0\.0\.1:\d+/reset: no answer within 1 s$"):
        env.reset({})
    env = HttpEnvironment(server.url, transport="http", timeout_s=1)
    env._started = True  # a step against the same server: the model's turn times out, the episode ends
    assert env.step("hi", timeout_s=1) == []
    assert env.stats.errors == {("openenv", "timeout"): 1}
    env.release()
    server.stop()
    assert TRICKLED == ["cut off", "cut off"]  # the client left mid-headers; before the fix it read them all


def test_a_brotli_bomb_is_refused_unread(serve):
    bomb = brotli.compress(b"\0" * (16 << 20), quality=5)  # a few hundred bytes -> 16 MiB
    server = serve(answer_with(bomb, headers="content-encoding: br\r\n"))
    env = HttpEnvironment(server.url, transport="http", max_response_bytes=1 << 16)
    tracemalloc.start()
    try:
        with pytest.raises(HttpEnvError, match=r"/reset: the answer is compressed \('br'\), which rlvr did not ask "
                                               r"for and does not read; make the server answer plain JSON$"):
            env.reset({})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert b"accept-encoding: identity" in server.requests[0].lower()


def test_a_gzip_bomb_is_inflated_only_up_to_the_bound(serve):
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)  # ~64 KiB -> 64 MiB
    server = serve(answer_with(bomb, headers="content-encoding: gzip\r\n"))
    env = HttpEnvironment(server.url, transport="http", max_response_bytes=1 << 17)
    tracemalloc.start()
    try:
        with pytest.raises(HttpEnvError, match=r"/reset: the answer is over 131072 bytes once inflated$"):
            env.reset({})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # 64 MiB before the fix


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_small_compressed_answer_still_reads(serve, encoding):
    import zlib

    body = gzip.compress(GOOD) if encoding == "gzip" else zlib.compress(GOOD)
    server = serve(answer_with(body, headers=f"content-encoding: {encoding}\r\n"))
    assert HttpEnvironment(server.url, transport="http").reset({}) == "fine"


def test_a_servers_error_text_reaches_messages_without_control_characters(serve):
    server = serve(answer_with(b"\x1b[2J\x1b]0;owned\x07bad\rrow\x00", status="500 Internal Server Error"))
    with pytest.raises(HttpEnvError) as caught:
        HttpEnvironment(server.url, transport="http").reset({})
    assert str(caught.value).endswith(": HTTP 500: ?[2J?]0;owned?bad row?")


def test_a_websocket_redirected_to_another_host_gets_nothing(serve):
    sync_server = pytest.importorskip("websockets.sync.server")
    received, connected = [], []

    def handler(connection) -> None:
        connected.append(1)
        received.extend(connection)

    with sync_server.serve(handler, "127.0.0.1", 0) as elsewhere:
        port = elsewhere.socket.getsockname()[1]
        thread = threading.Thread(target=elsewhere.serve_forever, daemon=True)
        thread.start()
        redirect = serve(answer_with(b"", status="302 Found", headers=f"location: ws://127.0.0.1:{port}/ws\r\n"))
        env = HttpEnvironment(redirect.url, timeout_s=5)
        with pytest.raises(HttpEnvError, match=rf"/ws reset: the server redirected the connection to "
                                               rf"ws://127\.0\.0\.1:{port}/ws; rlvr follows no redirects"):
            env.reset({"question": "the secret row"})
        env.release()
        elsewhere.shutdown()
        thread.join(10)
    assert received == [] and connected == []  # not even a connection to the address the server named
