"""The pool does not trust what servers answer. A real faulty peer - a tiny HTTP server on loopback that speaks
enough of vLLM's API to be added to a pool - answers generation requests in each malformed way; the request is
retried on a real `rlvr serve`, counted, and what is trained on is the good server's answer. With only bad
servers the request fails naming the fault; a server trickling bytes is cut off at the request's deadline; the
pool sends its API key and stops with a clear error when a server refuses it."""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch

from rlvr.rollout import SamplingParams
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.rollout.server_answers import LOGP_FLOOR, parse_completions
from rlvr.rollout.server_errors import BadAnswerError, MalformedAnswer, ServerAuthError
from rlvr.store.bucket import AdapterBucket
from tests.serving import ServerProcess
from tests.test_remote import PROMPTS, _trainer

PARAMS = SamplingParams(temperature=0.9, max_new_tokens=6)
G = 2


def valid_answer(n: int, max_tokens: int) -> dict:
    """A well-formed /v1/completions answer: n choices of max_tokens tokens (id 5), log-prob -0.5 each."""
    return {"id": "cmpl-fake", "object": "text_completion", "model": "policy-v0", "choices": [
        {"index": i, "text": "", "token_ids": [5] * max_tokens, "finish_reason": "length",
         "logprobs": {"tokens": ["x"] * max_tokens, "token_logprobs": [-0.5] * max_tokens}} for i in range(n)]}


def _set(choice: int, key: str, value):
    def change(a):
        a["choices"][choice][key] = value
        return a
    return change


def _logps(choice: int, edit):
    def change(a):
        edit(a["choices"][choice]["logprobs"]["token_logprobs"])
        return a
    return change


def _ids(choice: int, edit):
    def change(a):
        edit(a["choices"][choice]["token_ids"])
        return a
    return change


def _setitem(i, value):
    return lambda xs: xs.__setitem__(i, value)


def _both(*changes):
    def change(a):
        for c in changes:
            a = c(a)
        return a
    return change


# name -> (how a valid answer is broken, what the pool's reason says). VOCAB is filled in at request time.
MALFORMED = {
    "logprobs_shorter_than_tokens": (_logps(0, lambda xs: xs.pop()), "5 log-probs for 6 tokens"),
    "logprobs_longer_than_tokens": (_logps(1, lambda xs: xs.append(-0.1)), "7 log-probs for 6 tokens"),
    "token_id_past_the_vocabulary": (_ids(0, _setitem(2, "VOCAB")), "outside the vocabulary"),
    "negative_token_id": (_ids(1, _setitem(0, -1)), "token id -1 outside the vocabulary"),
    "float_token_id": (_ids(0, _setitem(0, 5.0)), "token id 5.0 outside"),
    "bool_token_id": (_ids(0, _setitem(0, True)), "token id True outside"),
    "more_tokens_than_max_tokens": (_both(_ids(0, lambda xs: xs.append(5)), _logps(0, lambda xs: xs.append(-0.5))),
                                    "7 tokens, more than max_tokens = 6"),
    "no_tokens": (_both(_set(0, "token_ids", []), _set(0, "logprobs", {"token_logprobs": []})), "has no tokens"),
    "duplicate_index": (_set(1, "index", 0), "choice index 0 appears twice"),
    "index_out_of_range": (_set(1, "index", G), f"index {G} outside 0..{G - 1}"),
    "string_index": (_set(1, "index", "1"), "index '1' outside"),
    "too_few_choices": (lambda a: {**a, "choices": a["choices"][:1]}, f"1 choices for n = {G}"),
    "too_many_choices": (lambda a: {**a, "choices": a["choices"] + a["choices"][:1]}, f"3 choices for n = {G}"),
    "nan_logprob": (_logps(0, _setitem(3, float("nan"))), "log-prob nan is not a finite number"),
    "minus_infinity_logprob": (_logps(0, _setitem(0, float("-inf"))), "log-prob -inf"),
    "positive_logprob": (_logps(1, _setitem(2, 0.5)), "log-prob 0.5 is not"),
    "absurdly_negative_logprob": (_logps(1, _setitem(2, -1e30)), "log-prob -1e+30"),
    "string_logprob": (_logps(0, _setitem(1, "-0.5")), "log-prob '-0.5'"),
    "null_logprob": (_logps(0, _setitem(0, None)), "log-prob None"),
    "aborted_finish_reason": (_set(0, "finish_reason", "abort"), "finish_reason 'abort' is not one of stop, length"),
    "missing_finish_reason": (_set(1, "finish_reason", None), "finish_reason None"),
    "no_token_ids": (_set(0, "token_ids", None), "no token ids or log-probs"),
    "no_logprobs": (_set(0, "logprobs", None), "no token ids or log-probs"),
    "choices_not_a_list": (lambda a: {"choices": {"0": a["choices"][0]}}, "no list of choices"),
    "answer_not_an_object": (lambda a: [a], "no list of choices"),
    "not_json": (b"<html>502 Bad Gateway</html>", "not JSON"),
    "json_nested_past_the_stack": (b"[" * 200_000 + b"]" * 200_000, "not JSON"),
    "huge_answer": (lambda a: {**a, "padding": "x" * 3_000_000}, "larger than"),
}


class FaultyServer:
    """A real HTTP server on loopback that behaves like a rollout server (health, models, adapter loads) and
    answers /v1/completions per ``mode``: 'valid', a key of MALFORMED, 'trickle_body' / 'trickle_headers' (a
    valid answer, one byte every 0.1 s), 'hang' (no answer until the server stops), 'hang_sampling' (greedy
    requests - evaluation - answered, sampled ones hang), or a callable
    (body -> answer). With ``api_key`` it answers 401 to requests without that Bearer token (but /health); the
    first ``busy`` generation requests get 503 with Retry-After (a full queue)."""

    def __init__(self, vocab: int, mode="valid", api_key: str | None = None, busy: int = 0):
        self.vocab, self.mode, self.api_key, self.busy = vocab, mode, api_key, busy
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.completed = 0  # generation answers sent in full
        self.stopping = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status: int, payload, headers: dict | None = None) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _allowed(self) -> bool:
                outer.requests.append((self.command, self.path, dict(self.headers)))
                if outer.api_key and self.path != "/health" and \
                        self.headers.get("authorization") != f"Bearer {outer.api_key}":
                    self._send(401, {"error": {"message": "Unauthorized", "code": 401}})
                    return False
                return True

            def do_GET(self):
                if not self._allowed():
                    return
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                if not self._allowed():
                    return
                if self.path != "/v1/completions":
                    self._send(200, b"")  # adapter loads and unloads succeed
                    return
                outer._complete(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def _complete(self, handler, body: dict) -> None:
        mode = self.mode
        if self.completions() <= self.busy:
            handler._send(503, {"error": {"message": "queue full"}}, {"Retry-After": "0.2"})
            return
        answer = valid_answer(body["n"], body["max_tokens"])
        if callable(mode):
            answer = mode(answer)
        elif mode in MALFORMED:
            broken = MALFORMED[mode][0]
            answer = broken if isinstance(broken, bytes) else broken(copy.deepcopy(answer))
        if mode == "hang" or (mode == "hang_sampling" and body.get("temperature", 1.0) > 0):
            self.stopping.wait()
            return
        data = answer if isinstance(answer, bytes) else json.dumps(answer).replace('"VOCAB"', str(self.vocab)).encode()
        try:
            if mode in ("trickle_body", "trickle_headers"):
                self._trickle(handler, data, headers_too=mode == "trickle_headers")
            else:
                handler._send(200, data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on us
            return
        self.completed += 1

    def _trickle(self, handler, data: bytes, headers_too: bool) -> None:
        """A valid answer after 300 leading blanks (JSON allows them), one byte every 0.1 s: 30 s in all."""
        data = b" " * 300 + data
        head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        slow = head + data if headers_too else data
        if not headers_too:
            handler.wfile.write(head)
        for i in range(len(slow)):
            if self.stopping.wait(0.1 if i < 300 else 0):
                raise BrokenPipeError
            handler.wfile.write(slow[i:i + 1])
            handler.wfile.flush()

    def completions(self) -> int:
        return sum(1 for m, p, _ in self.requests if p == "/v1/completions")

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def good(tiny_model_dir):
    server = ServerProcess(tiny_model_dir).wait_ready()
    yield server
    server.stop()


@pytest.fixture
def faulty(tokenizer):
    servers: list[FaultyServer] = []

    def start(mode="valid", **kw) -> FaultyServer:
        servers.append(FaultyServer(len(tokenizer), mode, **kw))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _stats(server) -> dict:
    return httpx.get(f"{server.url}/stats").json()


def _sampler(urls, model, tokenizer, tmp_path, **pool_kw) -> RemoteSampler:
    return RemoteSampler(ServerPool(urls, probe_interval_s=0.5, **pool_kw), tokenizer, model,
                         AdapterBucket(tmp_path / "bucket"))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return _trainer(tiny_model_dir)


def test_a_valid_fake_answer_is_taken_as_it_is(faulty, model, tokenizer, tmp_path):
    """The faulty server's 'valid' mode really is valid: the failures below are the malformations alone."""
    fake = faulty("valid")
    sampler = _sampler([fake.url], model, tokenizer, tmp_path)
    sampler.sync(0)
    groups = sampler.sample(PROMPTS[:1], G, PARAMS, seed=0)
    assert groups.completion_ids.tolist() == [[5] * 6] * G and (groups.behaviour_logp == -0.5).all()
    assert sampler.stats()["answers_rejected"] == 0 and fake.completed == 1
    sampler.close()


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_answer_is_retried_on_a_good_server_and_counted(kind, faulty, good, model, tokenizer, tmp_path):
    fake = faulty(kind)
    sampler = _sampler([fake.url, good.url], model, tokenizer, tmp_path)  # ties go to the first: the fake
    sampler.sync(0)
    before = _stats(good)["requests"]
    groups = sampler.sample(PROMPTS[:1], G, PARAMS, seed=0)
    assert fake.completions() == 1 and _stats(good)["requests"] == before + 1  # asked once each
    stats = sampler.stats()
    assert stats["answers_rejected"] == 1 and stats["requests_retried"] == 1 and stats["servers_live"] == 2
    assert sampler.pool.stats.rejected_by[fake.url] == 1
    # what comes back is the good server's answer, well-formed
    m = groups.completion_mask.bool()
    assert groups.completion_ids.shape[0] == G and groups.completion_ids.max() < len(tokenizer)
    assert groups.completion_ids[m].min() >= 0 and groups.completion_mask.sum(1).le(6).all()
    assert torch.isfinite(groups.behaviour_logp).all() and (groups.behaviour_logp[m] <= 0).all()
    assert (groups.behaviour_logp[m] < 0).any()  # the good server's log-probs, not zeros filled in
    sampler.close()


@pytest.mark.parametrize("kind", ["logprobs_shorter_than_tokens", "negative_token_id", "nan_logprob", "not_json"])
def test_only_bad_servers_is_a_clear_error_naming_the_fault(kind, faulty, model, tokenizer, tmp_path):
    fakes = [faulty(kind), faulty(kind)]
    sampler = _sampler([f.url for f in fakes], model, tokenizer, tmp_path)
    sampler.sync(0)
    with pytest.raises(BadAnswerError, match="no server gave a well-formed answer") as err:
        sampler.sample(PROMPTS[:1], G, PARAMS, seed=0)
    assert MALFORMED[kind][1] in str(err.value) and all(f.url in str(err.value) for f in fakes)
    assert sampler.stats()["answers_rejected"] == 4  # max_attempts
    assert sum(f.completions() for f in fakes) == 4 and min(f.completions() for f in fakes) >= 1
    sampler.close()


# the size bound is the pool's (a big answer may be well-formed); bytes are not JSON at all
STRUCTURAL = sorted(k for k, v in MALFORMED.items() if not isinstance(v[0], bytes) and k != "huge_answer")


@pytest.mark.parametrize("kind", STRUCTURAL)
def test_the_validator_names_each_fault(kind):
    """parse_completions on its own: each malformation is refused with the reason the pool reports."""
    broken = MALFORMED[kind][0](copy.deepcopy(valid_answer(G, 6)))
    broken = json.loads(json.dumps(broken).replace('"VOCAB"', "400"))
    with pytest.raises(MalformedAnswer) as err:
        parse_completions(broken, G, 6, 400)
    assert MALFORMED[kind][1] in str(err.value)


def test_the_validator_keeps_rounding_and_the_floor():
    """Up to 1e-4 above 0 is float rounding, stored as 0; the floor itself is a valid log-prob; choices may come
    in any order."""
    answer = valid_answer(G, 3)
    answer["choices"][0]["logprobs"]["token_logprobs"] = [5e-5, -0.0, LOGP_FLOOR]
    answer["choices"][1]["finish_reason"] = "stop"
    answer["choices"].reverse()
    first, second = parse_completions(answer, G, 3, 400)
    assert first.logprobs == [0.0, 0.0, LOGP_FLOOR] and second.logprobs == [-0.5] * 3
    assert first.truncated and not second.truncated
    answer["choices"][1]["logprobs"]["token_logprobs"][0] = 2e-4  # choice 0, now second in the list
    with pytest.raises(MalformedAnswer, match="choice 0: log-prob 0.0002"):
        parse_completions(answer, G, 3, 400)


@pytest.mark.parametrize("mode", ["trickle_body", "trickle_headers"])
def test_a_trickling_server_is_cut_off_at_the_deadline(mode, faulty, good, model, tokenizer, tmp_path):
    """The faulty server sends a valid answer one byte every 0.1 s (30 s in all): every read arrives well within
    the 2 s request timeout, so only a deadline on the whole request stops it."""
    fake = faulty(mode)
    sampler = _sampler([fake.url, good.url], model, tokenizer, tmp_path, request_timeout_s=2.0)
    sampler.sync(0)
    started = time.monotonic()
    groups = sampler.sample(PROMPTS[:1], G, PARAMS, seed=0)
    elapsed = time.monotonic() - started
    assert groups.completion_ids.shape[0] == G and fake.completed == 0  # answered by the good server
    assert sampler.pool.stats.servers_lost == 1 and sampler.pool.stats.retries == 1
    assert elapsed < 20, f"the trickle was read for {elapsed:.0f} s"  # far below the 30 s the trickle takes
    sampler.close()


def test_a_hanging_request_is_cancelled_when_the_pool_closes(faulty, model, tokenizer, tmp_path):
    """Closing the pool ends a request that is still waiting (the learner shuts down cleanly)."""
    from rlvr.rollout.server_errors import PoolClosed

    fake = faulty("hang")
    sampler = _sampler([fake.url], model, tokenizer, tmp_path)
    sampler.sync(0)
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: _catch(errors, sampler.sample, PROMPTS[:1], G, PARAMS, 0))
    waiter.start()
    deadline = time.monotonic() + 10
    while fake.completions() == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sampler.close()
    waiter.join(timeout=10)
    assert not waiter.is_alive() and len(errors) == 1 and isinstance(errors[0], PoolClosed)


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as err:  # noqa: BLE001 (recorded for the test)
        errors.append(err)


def test_the_pool_sends_its_api_key_on_every_request(faulty, model, tokenizer, tmp_path):
    fake = faulty("valid", api_key="s3cret-key")
    sampler = _sampler([fake.url], model, tokenizer, tmp_path, api_key="s3cret-key")
    sampler.pool.wait_ready(10)
    sampler.sync(0)
    assert sampler.sample(PROMPTS[:1], G, PARAMS, seed=0).completion_ids.shape[0] == G
    sampler.close()
    assert {h.get("authorization") for _, _, h in fake.requests} == {"Bearer s3cret-key"}
    assert {p for _, p, _ in fake.requests} >= {"/health", "/v1/models", "/v1/load_lora_adapter", "/v1/completions"}


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_server_refusing_the_key_is_a_clear_error_before_any_work(key, faulty, model, tokenizer, tmp_path):
    fake = faulty("valid", api_key="s3cret-key")
    pool = ServerPool([fake.url], api_key=key)
    hint = "sent none" if key is None else "does not accept the pool's API key"
    with pytest.raises(ServerAuthError, match=f"refused the request \\(401: Unauthorized\\); .*{hint}.*RLVR_API_KEY"):
        pool.wait_ready(10)
    pool.close()


def test_api_key_from_env(monkeypatch):
    from rlvr.rollout.http_client import api_key_from_env

    monkeypatch.setenv("MY_KEY", "  abc\n")
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    assert api_key_from_env("MY_KEY") == "abc"
    assert api_key_from_env("NO_SUCH_KEY") is None and api_key_from_env("") is None
    with pytest.raises(ValueError, match="printable ASCII"):
        ServerPool(["http://127.0.0.1:1"], api_key="two words")


def test_a_busy_server_is_waited_for_not_dropped(faulty, model, tokenizer, tmp_path):
    """503 with Retry-After (a full queue) is not a failure: the pool waits as asked and asks again, without marking
    the server dead or using up attempts."""
    fake = faulty("valid", busy=5)  # more busy answers than max_attempts
    sampler = _sampler([fake.url], model, tokenizer, tmp_path)
    sampler.sync(0)
    groups = sampler.sample(PROMPTS[:1], G, PARAMS, seed=0)
    assert groups.completion_ids.tolist() == [[5] * 6] * G and fake.completions() == 6
    stats = sampler.stats()
    assert stats["answers_busy"] == 5 and stats["servers_lost"] == 0 and stats["answers_rejected"] == 0
    sampler.close()
