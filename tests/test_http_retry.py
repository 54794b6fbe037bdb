"""The retried POST (rlvr.rollout.retry) against real HTTP servers on loopback (tests/judge_server.py, and a server
that trickles its answer): which statuses and errors are retried, Retry-After honoured and bounded, the backoff with
its jitter, the deadline over the whole exchange and the bound on the answer's size. Waits are recorded by a sleep
that does not sleep, except where a real wait is the point."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rlvr.rollout.http_client import HttpClient
from rlvr.rollout.retry import RetriedPoster, RetryPolicy, post_retried
from rlvr.rollout.server_errors import MalformedAnswer, PoolClosed
from tests.judge_server import JudgeServer, chat_answer

BODY = {"model": "judge", "messages": [{"role": "user", "content": "q"}]}


@pytest.fixture(scope="module")
def shared_server():
    s = JudgeServer()
    yield s
    s.close()


@pytest.fixture
def server(shared_server):
    """The module's judge server, its script and records emptied for each test."""
    shared_server.script.clear()
    shared_server.requests.clear()
    return shared_server


@pytest.fixture(scope="module")
def http():
    client = HttpClient(None, connect_timeout_s=2.0)
    yield client
    client.close()


def _post(http, server, policy, waits=None, **kwargs):
    """``post_retried`` to ``server`` with a 5 s deadline and a 1 MiB bound; waits go to ``waits`` (not slept)."""
    settings = {"timeout_s": 5.0, "max_bytes": 1 << 20, "sleep": (waits if waits is not None else []).append,
                **kwargs}
    return post_retried(http, server.url + "/chat/completions", BODY, policy, **settings)


def test_the_backoff_doubles_with_bounded_jitter_up_to_its_maximum():
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3.0, jitter=0.25)
    assert [policy.backoff(k, lambda: 0.0) for k in range(4)] == [0.5, 1.0, 2.0, 3.0]  # 4.0 capped to 3.0
    assert [policy.backoff(k, lambda: 1.0) for k in range(4)] == [0.625, 1.25, 2.5, 3.0]  # the most jitter adds
    seeded = [policy.backoff(k, random.Random(0).random) for k in range(3)]
    assert seeded == [policy.backoff(k, random.Random(0).random) for k in range(3)]  # a seed repeats it
    assert all(0.5 * 2 ** k <= w <= 0.625 * 2 ** k for k, w in enumerate(seeded))
    assert policy.wait(0, 2.0) == 2.0 and policy.wait(0, 0.1, lambda: 0.0) == 0.5  # the longer of the two
    assert RetryPolicy(backoff_s=1.0).backoff(10_000, lambda: 0.0) == 10.0  # no overflow on a long run
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)


@pytest.mark.parametrize("status, retried", [(408, True), (429, True), (500, True), (502, True), (503, True),
                                             (504, True), (599, True), (400, False), (401, False), (403, False),
                                             (404, False), (409, False), (422, False)])
def test_which_statuses_are_retried(http, server, status, retried):
    server.script.extend([("status", status), ("text", "ok")])
    out = _post(http, server, RetryPolicy(attempts=2, backoff_s=0.0))
    assert len(server.requests) == out.attempts == (2 if retried else 1)
    if retried:
        assert out.last.ok and out.last.value == chat_answer("ok")  # the second answer's JSON
    else:
        assert not out.last.ok and not out.last.retry and out.last.response.status_code == status


def test_the_callers_statuses_replace_the_default(http, server):
    server.script.extend([("status", 501), ("status", 429)])
    out = _post(http, server, RetryPolicy(attempts=3, backoff_s=0.0, statuses=frozenset({501})))
    assert (out.retries, out.last.response.status_code, out.last.retry) == (1, 429, False)


def test_retries_spent_leave_the_last_answer_and_no_wait_after_it(http, server):
    server.script.extend([("status", 500)] * 3)
    waits: list[float] = []
    out = _post(http, server, RetryPolicy(attempts=3, backoff_s=0.1, jitter=0.0), waits)
    assert (out.attempts, out.retries, out.last.retry, out.last.response.status_code) == (3, 2, True, 500)
    assert waits == [0.1, 0.2]  # before retries 1 and 2, none after the last attempt


def test_the_waits_follow_the_backoff_with_its_jitter(http, server):
    server.script.extend([("status", 500)] * 3)
    waits: list[float] = []
    jitter = iter([0.0, 0.5, 1.0]).__next__  # u for each wait
    out = _post(http, server, RetryPolicy(attempts=4, backoff_s=0.1, jitter=0.5), waits, rng=jitter)
    assert out.last.ok and out.retries == 3
    assert waits == pytest.approx([0.1 * 1 * 1.0, 0.1 * 2 * 1.25, 0.1 * 4 * 1.5])


def test_retry_after_is_honoured_and_bounded(http, server):
    server.script.extend([("status", 429, {"retry-after": "3"}), ("status", 503, {"retry-after": "600"}),
                          ("status", 503, {"retry-after": "0"}), ("status", 500, {"retry-after": "soon"}),
                          ("status", 400, {"retry-after": "2"})])
    waits: list[float] = []
    policy = RetryPolicy(attempts=6, backoff_s=0.5, jitter=0.0, max_retry_after_s=5.0)
    out = _post(http, server, policy, waits)
    # 3 s asked (> 0.5 backoff); 600 bounded to 5; 0 raised to 0.1, below the 2 s backoff; no usable value: 4 s
    assert waits == [3.0, 5.0, 2.0, 4.0]
    assert out.retries == 4 and out.last.response.status_code == 400 and out.last.retry_after_s is None


def test_retry_after_is_really_waited_for(http, server):
    server.script.append(("status", 503, {"retry-after": "0.2"}))
    started = time.monotonic()
    out = _post(http, server, RetryPolicy(attempts=2, backoff_s=0.0), sleep=time.sleep)
    assert out.last.ok and time.monotonic() - started >= 0.2


def test_dropped_connections_are_retried_garbled_answers_only_when_asked(http, server):
    server.script.extend([("drop",), ("malformed",)])
    out = _post(http, server, RetryPolicy(attempts=5, backoff_s=0.0))
    assert out.retries == 1 and isinstance(out.last.error, MalformedAnswer) and not out.last.retry
    assert out.last.response.status_code == 200  # the answer came, its body was not JSON
    server.script.extend([("drop",), ("malformed",)])
    out = _post(http, server, RetryPolicy(attempts=5, backoff_s=0.0, errors=(httpx.TransportError, MalformedAnswer)))
    assert out.retries == 2 and out.last.ok


def test_the_callers_parse_gives_the_value_and_its_complaints_are_garbled_answers(http, server):
    def content(answer):
        text = answer["choices"][0]["message"]["content"]
        if text == "bad":
            raise MalformedAnswer("a bad text")
        return text

    server.script.extend([("text", "bad"), ("text", "good")])
    out = _post(http, server, RetryPolicy(attempts=1), parse=content)
    assert not out.last.ok and str(out.last.error) == "a bad text"
    out = _post(http, server, RetryPolicy(attempts=1), parse=content)
    assert out.last.ok and out.last.value == "good"


def test_the_answer_size_is_bounded(http, server):
    size = len(json.dumps(chat_answer("x" * 5000)).encode())  # what judge_server sends for this text
    server.script.extend([("text", "x" * 5000)] * 3)
    assert _post(http, server, RetryPolicy(attempts=1), max_bytes=size).last.ok  # exactly at the bound
    out = _post(http, server, RetryPolicy(attempts=1), max_bytes=size - 1)
    assert isinstance(out.last.error, MalformedAnswer) and f"larger than {size - 1} bytes" in str(out.last.error)


class Trickle:
    """A loopback server whose answer's headers come at once and its 40 body bytes one every 0.1 s: no single read
    waits long, the whole answer takes 4 s."""

    def __init__(self):
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(200)
                self.send_header("content-length", "40")
                self.end_headers()
                try:
                    for _ in range(40):
                        if outer.stop.wait(0.1):
                            return
                        self.wfile.write(b" ")
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client's deadline passed
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def test_the_deadline_covers_the_whole_exchange_of_each_attempt(http):
    server = Trickle()
    try:
        waits: list[float] = []
        out = _post(http, server, RetryPolicy(attempts=2, backoff_s=0.0), waits, timeout_s=0.5)
        assert isinstance(out.last.error, httpx.ReadTimeout) and out.last.retry and out.retries == 1
        assert out.seconds < 4.0  # neither attempt waited for the whole trickled answer
    finally:
        server.close()


def test_the_poster_starts_at_its_first_call_and_again_after_close(server):
    poster = RetriedPoster(RetryPolicy(attempts=2, backoff_s=0.0), None, 2.0, threads=2, name="test-poster")
    url = server.url + "/chat/completions"
    with pytest.raises(PoolClosed):
        poster.post(url, BODY, timeout_s=5.0, max_bytes=1 << 20)  # not started
    server.script.append(("status", 503))
    outs = poster.map(lambda i: poster.post(url, {**BODY, "i": i}, timeout_s=5.0, max_bytes=1 << 20), range(3))
    assert all(o.last.ok for o in outs) and sum(o.retries for o in outs) == 1 and len(server.requests) == 4
    poster.close()
    with pytest.raises(PoolClosed):
        poster.post(url, BODY, timeout_s=5.0, max_bytes=1 << 20)
    assert poster.map(lambda _: poster.post(url, BODY, timeout_s=5.0, max_bytes=1 << 20).last.ok, [0]) == [True]
    poster.close()
