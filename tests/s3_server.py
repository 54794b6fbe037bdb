"""An S3 endpoint for the bucket's tests: moto's standalone server on loopback, as s3fs's own test suite runs it (a
subprocess in its own process group, one per test module, reset before each test, stopped after it: no orphans), and
a loopback proxy in front of it that answers the requests a test picks with a store's bad moments (503 SlowDown, 409
ConditionalRequestConflict, a write stored but its answer lost, a dropped connection), or with a consumer link's
latency and bandwidth (``delay_s``, ``bytes_per_s``).

The tests point s3fs at it the way a user points rlvr at MinIO, R2 or any S3-protocol store: the AWS SDK's own
environment (``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), nothing passed in code.

Standalone, for a benchmark's learners (benchmarks/swarm.py): ``python -m tests.s3_server --delay-ms 100
[--bytes-per-s N]`` starts the server and the proxy, creates a bucket, prints one JSON line ``{"endpoint": URL,
"bucket": NAME}`` and serves until SIGTERM or SIGINT, then stops both."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

BUCKET = "rlvr-test"
_ERROR = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
          '<RequestId>rlvr-proxy</RequestId></Error>')
FAULTS = {  # action: (status, code, message, whether the request reaches the store first)
    "slowdown": (503, "SlowDown", "Please reduce your request rate.", False),
    "conflict": (409, "ConditionalRequestConflict", "A conflicting operation occurred.", False),
    "lost_answer": (503, "SlowDown", "Please reduce your request rate.", True),  # stored, then the answer lost
    "drop": (None, None, None, True),  # stored, then the connection closed without an answer
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1 and a free port, in its own session (process group)."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> None:
        for _ in range(3):  # the free port may be taken between finding it and binding it
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
            deadline = time.monotonic() + timeout_s
            while self.process.poll() is None and time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1).close()
                    return
                except urllib.error.HTTPError:  # it answered
                    return
                except OSError:
                    time.sleep(0.1)
            self.stop()
        raise RuntimeError("moto's S3 server did not start on loopback (is moto[server] installed? make test "
                           "installs it: the test extra)")

    def reset(self) -> None:
        """Forget every bucket and object (moto's own reset)."""
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/reset", method="POST"), timeout=10).close()

    def stop(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and anything it started
            self.process.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None


class FaultyProxy:
    """A loopback HTTP proxy in front of ``upstream`` (an ``http://host:port`` URL): every request is passed on
    unchanged, except those ``fail`` scheduled, which get a fault (FAULTS). ``seen``: (method, path, status) of
    every request, status None for a dropped one; ``relayed``: response body bytes passed back to the client.

    A link in front of the store: ``delay_s`` is added to every request's round trip, half before the request is
    passed on and half before its answer is sent; ``bytes_per_s`` (0: unlimited) holds the request's body for
    len / bytes_per_s before passing it on and the answer's body likewise before sending it. Each request is held
    on its own, as if every client had its own link of that speed: concurrent requests do not share it."""

    def __init__(self, upstream: str, delay_s: float = 0.0, bytes_per_s: float = 0.0):
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.delay_s, self.bytes_per_s = delay_s, bytes_per_s
        self.faults: deque[tuple[str | None, str]] = deque()
        self.seen: list[tuple[str, str, int | None]] = []
        self.relayed = 0
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)

            def finish(self):
                super().finish()
                with proxy._lock:
                    proxy._connections.discard(self.connection)

            def _handle(self):
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def fail(self, times: int, action: str, method: str | None = None) -> None:
        """Answer the next ``times`` requests (of ``method`` only, if given) with ``action`` (a FAULTS key)."""
        with self._lock:
            self.faults.extend([(method, action)] * times)

    def faults_left(self) -> int:
        with self._lock:
            return len(self.faults)

    def _take(self, method: str) -> str | None:
        with self._lock:
            if self.faults and self.faults[0][0] in (None, method):
                return self.faults.popleft()[1]
        return None

    def _body(self, handler) -> bytes:
        if "chunked" in handler.headers.get("Transfer-Encoding", ""):
            chunks = []
            while size := int(handler.rfile.readline().split(b";")[0], 16):
                chunks.append(handler.rfile.read(size))
                handler.rfile.readline()
            while handler.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))

    def _hold(self, size: int) -> None:
        """Half the added round trip and ``size`` bytes on the link."""
        wait = self.delay_s / 2 + (size / self.bytes_per_s if self.bytes_per_s > 0 else 0.0)
        if wait > 0:
            time.sleep(wait)

    def _serve(self, handler) -> None:
        body = self._body(handler)
        self._hold(len(body))
        action = self._take(handler.command)
        status, code, message, forward = FAULTS[action] if action else (None, None, None, True)
        if forward:
            connection = http.client.HTTPConnection(*self.upstream, timeout=30)
            try:
                connection.putrequest(handler.command, handler.path, skip_host=True, skip_accept_encoding=True)
                for name, value in handler.headers.items():
                    if name.lower() != "transfer-encoding":
                        connection.putheader(name, value)
                if "chunked" in handler.headers.get("Transfer-Encoding", ""):
                    connection.putheader("Content-Length", str(len(body)))
                connection.endheaders(body)
                response = connection.getresponse()
                data = response.read()
                headers = response.getheaders()
                upstream_status = response.status
            finally:
                connection.close()
        if action == "drop":
            handler.close_connection = True
            with self._lock:
                self.seen.append((handler.command, handler.path, None))
            return
        if action:
            data = _ERROR.format(code=code, message=message).encode()
            headers = [("Content-Type", "application/xml")]
        else:
            status = upstream_status
        self._hold(0 if handler.command == "HEAD" else len(data))
        with self._lock:  # recorded before the client has its answer
            self.seen.append((handler.command, handler.path, status))
            self.relayed += 0 if handler.command == "HEAD" else len(data)
        handler.send_response(status)
        for name, value in headers:
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                handler.send_header(name, value)
        size = {k.lower(): v for k, v in headers}.get("content-length") if handler.command == "HEAD" else None
        handler.send_header("Content-Length", size or str(len(data)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)

    def close(self) -> None:
        """Stop accepting, and end the kept-alive connections (their threads then return)."""
        self.server.shutdown()
        self.server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=10)


_made_for = None  # the endpoint the cached S3 filesystems were made for


def _forget_filesystems() -> None:
    from s3fs import S3FileSystem

    global _made_for
    S3FileSystem.clear_instance_cache()
    _made_for = None


def _point_s3fs_at(monkeypatch, endpoint: str) -> None:
    """What a user sets for a store other than AWS (the AWS SDK's variables; s3fs reads them through botocore)."""
    global _made_for
    if _made_for != endpoint:  # a filesystem made for another endpoint keeps its client: make new ones
        _forget_filesystems()
        _made_for = endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)


@pytest.fixture(scope="module")
def moto_server():
    pytest.importorskip("s3fs", reason="the s3 extra (s3fs) is not installed: pip install -e '.[test]'")
    pytest.importorskip("moto", reason="moto[server] is not installed: pip install -e '.[test]'")
    server = MotoServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        _forget_filesystems()  # their clients lead to a stopped server


@pytest.fixture
def s3_env(moto_server, monkeypatch, tmp_path):
    """A fresh store with one bucket, ``BUCKET``, and s3fs pointed at it; yields a function that points s3fs at
    another endpoint (a FaultyProxy in front of the server). The filesystem (and its client: a few tenths of a second
    to make) is kept from test to test while the endpoint stays the same."""
    import fsspec

    moto_server.reset()
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # moto takes any keys
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))  # never the developer's own
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    _point_s3fs_at(monkeypatch, moto_server.url)
    fsspec.filesystem("s3", use_listings_cache=False).mkdir(BUCKET)  # the instance the bucket's own code uses
    yield lambda endpoint: _point_s3fs_at(monkeypatch, endpoint)


@pytest.fixture
def s3_url(s3_env) -> str:
    """A job's bucket URL on the moto server: a fresh prefix of ``BUCKET``."""
    return f"s3://{BUCKET}/job-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def proxy(moto_server, s3_env):
    """A FaultyProxy in front of the moto server, with s3fs pointed at it."""
    p = FaultyProxy(moto_server.url)
    s3_env(p.url)
    try:
        yield p
    finally:
        p.close()


def main() -> None:
    """Serve a store behind a slow link until SIGTERM or SIGINT (the module docstring)."""
    parser = argparse.ArgumentParser(description="moto's S3 server behind a proxy with added latency and bandwidth")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every request's round trip")
    parser.add_argument("--bytes-per-s", type=float, default=0.0, help="each request's link speed (0: unlimited)")
    parser.add_argument("--bucket", default=BUCKET)
    args = parser.parse_args()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server = MotoServer()
    proxy = None
    try:
        server.start()
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/{args.bucket}", method="PUT"), timeout=10).close()
        proxy = FaultyProxy(server.url, args.delay_ms / 1000, args.bytes_per_s)
        print(json.dumps({"endpoint": proxy.url, "bucket": args.bucket}), flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        if proxy is not None:
            proxy.close()
        server.stop()


if __name__ == "__main__":
    main()
