"""rlvr serve under hostile or careless clients (issue 21): the API key, where adapters may be loaded from, what
errors may say, bounded batches / queue / bodies, work off the event loop, cancellation, and adapter changes that
requests cannot overtake. Real servers on loopback (tests/serving.py) or a real engine in-process."""

import os
import secrets
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlvr.rollout import SamplingParams
from rlvr.serve.engine import AdapterJob, Engine, Job
from rlvr.serve.security import NOT_ALLOWED, AdapterPathError, AdapterPolicy
from tests.serving import ServerProcess
from tests.test_serve import make_adapter

KEY = "env-key-" + secrets.token_hex(8)
FLAG_KEY = "flag-key-" + secrets.token_hex(8)
BANNER = "SSH-2.0-SECRET-BANNER-7f3a"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def layout(tmp_path_factory, tokenizer):
    """allowed/ (the root): a0, a link to outside, an adapter whose weights link outside; outside/: a1."""
    root = tmp_path_factory.mktemp("roots")
    allowed, outside = root / "allowed", root / "outside"
    allowed.mkdir()
    outside.mkdir()
    make_adapter(allowed / "a0", len(tokenizer), seed=0)
    make_adapter(outside / "a1", len(tokenizer), seed=1)
    (allowed / "escape").symlink_to(outside)
    half = allowed / "half"
    half.mkdir()
    (half / "adapter_config.json").write_bytes((outside / "a1" / "adapter_config.json").read_bytes())
    (half / "adapter_model.safetensors").symlink_to(outside / "a1" / "adapter_model.safetensors")
    fifo = allowed / "fifo"  # no manifest, its config a FIFO: opening it to read would block the engine for good
    fifo.mkdir()
    os.mkfifo(fifo / "adapter_config.json")
    (fifo / "adapter_model.safetensors").write_bytes((allowed / "a0" / "adapter_model.safetensors").read_bytes())
    (allowed / "empty").mkdir()
    return allowed, outside


class Listener:
    """A loopback TCP server that counts connections and answers each with a foreign banner line."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.sendall(f"{BANNER}\r\n".encode())

    def close(self):
        self.sock.close()
        self.thread.join(timeout=5)


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def listener():
    lst = Listener()
    yield lst
    lst.close()


@pytest.fixture(scope="module")
def secured(tiny_model_dir, layout):
    """Key from the environment (as runtimes pass it), adapters only from allowed/, default limits."""
    proc = ServerProcess(tiny_model_dir, "--allowed-adapter-roots", str(layout[0]), api_key=KEY).wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def remote(tiny_model_dir, listener):
    """Both a flag key and an environment key; ftp allowed under two URL roots (the listener, a closed port)."""
    closed = _closed_port()
    roots = f"ftp://127.0.0.1:{listener.port}/ok,ftp://127.0.0.1:{closed}/bucket"
    env = {**os.environ, "RLVR_API_KEY": KEY}
    proc = ServerProcess(tiny_model_dir, "--api-key", FLAG_KEY, "--allowed-protocols", "file,ftp",
                         "--allowed-adapter-roots", roots, env=env).wait_ready()
    proc.api_key, proc.closed_port = FLAG_KEY, closed
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def bounded(tiny_model_dir):
    proc = ServerProcess(tiny_model_dir, "--max-num-seqs", "4", "--max-batch-tokens", "420", "--max-queued-rows", "16",
                         "--batch-wait-ms", "300", "--body-timeout-s", "1").wait_ready()
    yield proc
    proc.stop()


def _load(server, path, name="x"):
    return server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


# --- the API key ---------------------------------------------------------------------------------------------


def test_every_route_but_health_needs_the_api_key(secured, tiny_model_dir):
    assert httpx.get(f"{secured.url}/health").status_code == 200  # probes need no key
    requests = [("GET", "/v1/models", None), ("GET", "/stats", None), ("GET", "/no-such-route", None),
                ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
                ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
                ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"}),
                ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"})]
    for method, path, body in requests:
        for headers in ({}, {"authorization": f"Bearer {KEY}x"}, {"authorization": f"Basic {KEY}"},
                        {"authorization": KEY}, {"authorization": f"Bearer {FLAG_KEY}"}):
            r = httpx.request(method, f"{secured.url}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == 401 and r.headers["www-authenticate"] == "Bearer"
            assert KEY not in r.text
    # refused before the body is read: a huge unauthenticated upload is answered 401 all the same
    r = httpx.post(f"{secured.url}/v1/completions", content=b"x" * (8 << 20), timeout=30)
    assert r.status_code == 401
    assert secured.get("/v1/models").json()["data"][0]["id"] == str(tiny_model_dir)
    assert secured.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
    assert secured.get("/no-such-route").status_code == 404
    cmdline = Path(f"/proc/{secured.proc.pid}/cmdline").read_bytes().decode()
    assert KEY not in cmdline  # passed through the environment, not visible in ps


def test_the_api_key_flag_wins_over_the_environment(remote):
    assert remote.get("/v1/models").status_code == 200
    r = httpx.get(f"{remote.url}/v1/models", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 401


# --- where adapters come from ----------------------------------------------------------------------------------


def test_adapters_load_only_from_inside_the_allowed_roots(secured, layout, tmp_path):
    allowed, outside = layout
    r = _load(secured, allowed / "a0")
    assert r.status_code == 200, r.text
    assert secured.post("/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200
    refused = [outside / "a1",  # a real adapter, outside
               outside / "nothing-here",  # a missing path, outside: the same answer (no existence oracle)
               tmp_path,
               "/etc",
               f"{allowed}/../outside/a1",  # traversal
               allowed / "escape" / "a1",  # a symlinked directory leading out
               allowed / "half",  # its weights file links out
               f"file://{outside}/a1",
               "outside/a1"]  # relative: resolved against the server's directory, not inside the root
    answers = set()
    for path in refused:
        r = _load(secured, path)
        assert r.status_code == 400, (path, r.text)
        message = r.json()["error"]["message"]
        assert message == NOT_ALLOWED, (path, message)
        answers.add(r.text.replace(r.json().get("id", ""), ""))
    assert len(answers) == 1  # every refusal reads the same, whatever exists there
    assert secured.get("/stats").json()["adapters"] == []


def test_inside_the_roots_a_missing_or_unreadable_adapter_gets_the_same_answer(secured, layout):
    """No existence oracle inside the roots either (a loopback server's default root is /): missing, an empty
    folder, a FIFO config (refused unopened: the engine goes on serving) all read as a path outside does."""
    allowed, outside = layout
    answers = set()
    for path in (allowed / "fifo", outside / "a1", allowed / "missing", allowed / "empty", allowed / "a0" / "x"):
        r = _load(secured, path)
        assert (r.status_code, r.json()["error"]["message"]) == (400, NOT_ALLOWED), (path, r.text)
        answers.add(r.text.replace(r.json().get("id", ""), ""))
    assert len(answers) == 1
    assert secured.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_disallowed_protocols_are_refused_before_any_connection(secured, listener):
    before = listener.connections
    port = listener.port
    for path in (f"ftp://127.0.0.1:{port}/x", f"http://127.0.0.1:{port}/x", f"FTP://127.0.0.1:{port}/x",
                 f"simplecache::ftp://127.0.0.1:{port}/x", f"zip://a::ftp://127.0.0.1:{port}/x", "memory://x/v00000001",
                 "hf://org/repo/v00000001", f"https://127.0.0.1:{port}/x"):
        r = _load(secured, path)
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_ALLOWED, (path, r.text)
    assert listener.connections == before


def test_errors_from_an_allowed_url_root_do_not_quote_the_remote(remote, listener):
    port = listener.port
    before = listener.connections
    for path in (f"ftp://127.0.0.1:{port}/other/v00000001", f"ftp://127.0.0.1:{port}/okay/v00000001",
                 f"ftp://127.0.0.1:{port}/ok/../other", f"ftp://u@127.0.0.1:{port}/ok/v00000001",
                 f"ftp://127.0.0.1:{port}/ok/v1?x=1", f"ftp://127.0.0.1:{port}/ok/%2e%2e/x",
                 f"ftp://127.0.0.1:{port + 1}/ok/v00000001"):
        r = _load(remote, path)
        assert r.status_code == 400 and r.json()["error"]["message"] == NOT_ALLOWED, (path, r.text)
    assert listener.connections == before  # nothing outside the roots was contacted
    r = _load(remote, f"ftp://127.0.0.1:{port}/ok/v00000001")  # inside: fetched, and the reply is foreign
    assert listener.connections > before
    assert (r.status_code, r.json()["error"]["message"]) == (400, NOT_ALLOWED)
    assert "SECRET" not in r.text and "SSH" not in r.text
    r = _load(remote, f"ftp://127.0.0.1:{remote.closed_port}/bucket/v00000001")  # inside, nothing listening
    message = r.json()["error"]["message"]
    assert (r.status_code, message) == (400, NOT_ALLOWED), r.text
    assert "refused" not in r.text.lower() and "errno" not in r.text.lower() and "127.0.0.1" not in r.text
    assert "SECRET" in remote.output() or "fetching" in remote.output()  # the operator's log has the details


def test_adapter_policy_rules(tmp_path):
    root = tmp_path / "root"
    (root / "v1").mkdir(parents=True)
    policy = AdapterPolicy.parse([str(root)])
    assert policy.resolve(str(root / "v1")) == os.path.realpath(root / "v1")
    assert policy.resolve(f"file://{root}/v1") == os.path.realpath(root / "v1")
    for path in (str(tmp_path), f"{root}/../x", f"{root}x/v1", "", "\x00/x", "s3://b/v1", "x" * 5000):
        with pytest.raises(AdapterPathError):
            policy.resolve(path)
    s3 = AdapterPolicy.parse(["s3://b/run1"], ["file", "s3"])
    assert s3.resolve("s3://b/run1/v00000001") == "s3://b/run1/v00000001"
    assert s3.resolve("S3://b/run1/v00000001/") == "s3://b/run1/v00000001"
    for path in ("s3://b/run10/v1", "s3://b/run1/../x", "s3://b/run1/v1?x", "s3://b/run1/%2e%2e", "s3://b//run1/v1",
                 "simplecache::s3://b/run1/v1", "gs://b/run1/v1", str(root / "v1")):
        with pytest.raises(AdapterPathError):
            s3.resolve(path)
    assert AdapterPolicy.parse(["s3://"], ["s3"]).resolve("s3://any/where") == "s3://any/where"
    with pytest.raises(ValueError, match="--allowed-protocols"):
        AdapterPolicy.parse(["s3://b/run1"], ["file"])
    with pytest.raises(ValueError, match="unknown protocol"):
        AdapterPolicy.parse([], ["file", "nope"])
    # no roots given: any local directory on loopback, nothing on other addresses
    for host in ("127.0.0.1", "::1", "localhost"):
        assert AdapterPolicy.default(host).resolve(str(root / "v1")) == os.path.realpath(root / "v1")
    for host in ("0.0.0.0", "10.0.0.5", "::"):
        with pytest.raises(AdapterPathError):
            AdapterPolicy.default(host).resolve(str(root / "v1"))


def test_the_cli_refuses_inconsistent_security_flags(tiny_model_dir, capsys):
    from rlvr.cli import main

    assert main(["serve", str(tiny_model_dir), "--allowed-adapter-roots", "s3://b/run1"]) == 2
    assert "--allowed-protocols" in capsys.readouterr().err
    assert main(["serve", str(tiny_model_dir), "--api-key", "has space"]) == 2
    assert "--api-key" in capsys.readouterr().err


# --- adapter changes and the requests around them (a real engine, in-process) -----------------------------------


@pytest.fixture
def engine(tiny_model_dir):
    made = []

    def make(**kwargs) -> Engine:
        made.append(Engine(str(tiny_model_dir), **kwargs))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _tokens(future) -> list[int]:
    (g,) = future.result(timeout=60)
    return g.token_ids[0]


def test_a_request_sent_after_load_inplace_never_runs_on_the_old_weights(engine, layout, tmp_path, tokenizer):
    second = make_adapter(tmp_path / "second", len(tokenizer), seed=5)
    e = engine(batch_wait_s=0.2)
    ids = tokenizer("What is 3 + 4?")["input_ids"]
    # all queued before the engine runs: the first request's batch window sees the swap and the one after it
    load = e.submit(AdapterJob("load", "one", str(layout[0] / "a0")))
    before = e.submit(Job([ids], 1, GREEDY, "one"))
    swap = e.submit(AdapterJob("load", "one", str(second), inplace=True))
    after = e.submit(Job([ids], 1, GREEDY, "one"))
    e.start()
    assert "added" in load.result(timeout=60) and "added" in swap.result(timeout=60)
    old, new = _tokens(before), _tokens(after)
    assert old != new
    assert _tokens(e.submit(Job([ids], 1, GREEDY, "one"))) == new  # what "one" now is


def test_the_adapter_table_others_read_is_never_changed_under_them(engine, layout):
    e = engine().start()
    seen = e.adapters
    e.submit(AdapterJob("load", "x", str(layout[0] / "a0"))).result(timeout=60)
    assert seen == {} and e.adapters == {"x": str(layout[0] / "a0")}
    seen = e.adapters
    e.submit(AdapterJob("unload", "x")).result(timeout=60)
    assert seen == {"x": str(layout[0] / "a0")} and e.adapters == {}


def test_a_running_batch_whose_requests_are_all_cancelled_stops(engine, tokenizer):
    from rlvr.models.policy import backbone_and_head

    e = engine().start()
    assert e.ready.wait(60) and e.load_error is None
    job = Job([tokenizer("What is 3 + 4?")["input_ids"]], 2, SamplingParams(max_new_tokens=200), None, seed=1)
    backbone, _ = backbone_and_head(e._base)
    cancel = backbone.register_forward_pre_hook(lambda *_: job.future.cancel())  # the client leaves at prefill
    try:
        e.submit(job)
        deadline = time.monotonic() + 60
        while e.admission.cancelled == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        cancel.remove()
    assert e.admission.cancelled == 1 and e.rows == 0 and e.batches == 0 and e.admission.rows == 0
    assert len(_tokens(e.submit(Job([[5, 6, 7]], 1, GREEDY, None)))) > 0  # the engine goes on


# --- bounded work ------------------------------------------------------------------------------------------------


def test_a_request_larger_than_a_batch_runs_in_several_with_the_same_answer(bounded, secured):
    body = {"prompt": [[5, 6, 7, 8, 9]] * 3 + [[9, 8, 7]] * 2, "n": 2, "max_tokens": 8, "seed": 11,
            "temperature": 0.9, "return_token_ids": True}
    before = bounded.get("/stats").json()["batches"]
    r = bounded.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    split = r.json()
    assert len(split["choices"]) == 10 and [c["index"] for c in split["choices"]] == list(range(10))
    assert bounded.get("/stats").json()["batches"] - before >= 3  # 10 completions, at most 4 per batch
    whole = secured.post("/v1/completions", body).json()  # the same request in one batch elsewhere
    assert [c["token_ids"] for c in split["choices"]] == [c["token_ids"] for c in whole["choices"]]


@pytest.mark.parametrize("body, says", [
    ({"prompt": [5, 6, 7], "n": 5}, ["n=5", "--max-num-seqs 4", "lower n"]),
    ({"prompt": [5, 6, 7, 8, 9], "n": 4, "max_tokens": 120}, ["500 tokens", "--max-batch-tokens 420", "max_tokens"]),
    ({"prompt": [[5, 6, 7]] * 9, "n": 2}, ["18 completions", "--max-queued-rows 16", "fewer prompts"]),
    # 100 prompt tokens: 99 scored, each with its own entry and 5 more: 594 entries (before: a 200, its answer built)
    ({"prompt": [5] * 100, "max_tokens": 1, "prompt_logprobs": 5},
     ["prompt_logprobs=5 on 99 prompt tokens = 594 entries", "--max-batch-tokens 420", "lower prompt_logprobs"]),
])
def test_requests_that_can_never_fit_are_refused_with_what_to_lower(bounded, body, says):
    r = bounded.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(s in message for s in says), message


def test_prompt_logprobs_are_answered_once_per_prompt(bounded):
    """On the first choice of each prompt (index i * n), null on the others: the answer does not grow with n (vLLM
    repeats the list on every choice; a client reading choices[i * n] reads the same from both)."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    body = {"prompt": prompts, "n": 3, "max_tokens": 2, "temperature": 1.0, "prompt_logprobs": 1, "seed": 1}
    r = bounded.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["prompt_logprobs"] is None for c in choices] == [False, True, True, False, True, True]
    for first, prompt in ((choices[0], prompts[0]), (choices[3], prompts[1])):
        entries = first["prompt_logprobs"]
        assert len(entries) == len(prompt) and entries[0] is None
        assert all(str(t) in e and 1 <= len(e) <= 2 for t, e in zip(prompt[1:], entries[1:]))  # the token + top 1
    alone = bounded.post("/v1/completions", {**body, "prompt": prompts[1], "n": 1}).json()["choices"][0]
    assert alone["prompt_logprobs"] == choices[3]["prompt_logprobs"]  # whatever n


def _wait_for(server, predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.get("/stats").json()
        if predicate(stats):
            return stats
        time.sleep(0.02)
    raise TimeoutError(f"server stats never matched: {stats}")


def test_a_full_queue_answers_503_with_retry_after(bounded):
    long = {"prompt": [[5, 6, 7]] * 16, "max_tokens": 200, "temperature": 1.0}  # 8 batches of 2 (token budget)
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=bounded.post("/v1/completions", long)))
    worker.start()
    try:
        _wait_for(bounded, lambda s: s["queued_completions"] == 16)
        r = bounded.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "--max-queued-rows" not in r.text and "busy" in r.json()["error"]["message"]
    finally:
        worker.join(timeout=120)
    assert result["r"].status_code == 200 and len(result["r"].json()["choices"]) == 16
    assert bounded.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_a_request_whose_client_went_away_is_dropped(bounded):
    before = _wait_for(bounded, lambda s: s["queued_completions"] == 0)
    # 8 batches of 2 rows x 200 tokens after a 300 ms batch wait: >= 1.6 s of decoding even on a fast idle machine
    # (>= 1 ms per decode step), so the client's 0.5 s read timeout always leaves before most batches ran
    long = {"prompt": [[5, 6, 7]] * 16, "max_tokens": 200, "temperature": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{bounded.url}/v1/completions", json=long, timeout=httpx.Timeout(30, read=0.5))
    after = _wait_for(bounded, lambda s: s["cancelled"] > before["cancelled"])
    assert after["queued_completions"] == 0
    assert after["completions"] - before["completions"] < 16  # its remaining prompts never ran
    assert bounded.post("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_oversized_requests_are_refused_while_health_answers_at_once(secured):
    latencies, stop = [], threading.Event()

    def probe():
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                started = time.monotonic()
                assert client.get(f"{secured.url}/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        huge = "What is 3 + 4? " * 400_000  # 6 MB
        r = secured.post("/v1/completions", {"prompt": huge})
        assert r.status_code == 413 and "--max-body-mb" in r.json()["error"]["message"]

        def chunks():
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"x" * 65536
            yield b'"}'

        r = httpx.post(f"{secured.url}/v1/completions", content=chunks(), headers=secured.headers, timeout=60)
        assert r.status_code == 413  # no Content-Length: counted as it arrives
        big = "What is 3 + 4? " * 230_000  # 3.5 MB: under the body limit, far over the context
        r = secured.post("/v1/completions", {"prompt": big})
        assert r.status_code == 400 and "maximum context length is 256" in r.json()["error"]["message"]
        ids = secured.post("/v1/completions", {"prompt": [[5] * 250] * 2000})  # 3 MB of token ids, parsed off-loop
        assert ids.status_code == 400 and "maximum context length" in ids.json()["error"]["message"]
        time.sleep(0.1)
    finally:
        stop.set()
        prober.join(timeout=30)
    assert len(latencies) >= 5 and max(latencies) < 1.0, latencies


def test_a_body_that_never_finishes_arriving_gets_408(bounded):
    host, port = bounded.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")  # ... and nothing more
        answer = conn.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408") and "--body-timeout-s" not in answer
    assert httpx.get(f"{bounded.url}/health").status_code == 200
