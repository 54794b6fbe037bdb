"""The admission queue of rlvr serve (rlvr.serve.admission), as both engines use it: the bound on rows accepted and
not finished, what a full queue and a too-large request answer, arrival order, cancellation (also by a client that
disconnects), and shutdown. Real engines in-process (queued before they start, or held in the model's forward), and
the real app on loopback."""

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from rlvr.rollout import SamplingParams
from rlvr.serve.admission import EngineError, ServerBusy
from rlvr.serve.app import create_app
from rlvr.serve.classify_engine import ClassifyEngine, ClassifyJob
from rlvr.serve.engine import AdapterJob, Engine, Job
from tests.test_reward_model import by_hand, make_reward_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
BUSY_3_OF_4 = "the server is busy (3 texts queued, at most 4); retry later or on another server"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-reward-model")
    model, tok = make_reward_model()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def engines():
    """Makes engines and closes every one afterwards."""
    made = []

    def make(kind, path, **kwargs):
        made.append(kind(str(path), **kwargs))
        return made[-1]

    yield make
    for e in made:
        e.close()


def _wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the engine never got there")
        time.sleep(0.02)


@contextmanager
def _served(app):
    """The app on a loopback port, served by uvicorn on a thread of this process; yields its URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _wait_until(lambda: server.started, 30)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_the_classify_queue_bound_answers_order_cancellation_and_shutdown(engines, rm_dir):
    from transformers import AutoModelForSequenceClassification

    e = engines(ClassifyEngine, rm_dir, max_queued_rows=4, batch_wait_s=0.0)  # not started: all of it waits
    first = e.submit(ClassifyJob([[5, 6, 7], [7, 6, 5], [8, 9]]))  # 3 of 4 rows
    assert e.admission.rows == 3
    with pytest.raises(ServerBusy) as busy:  # 3 + 2 > 4
        e.submit(ClassifyJob([[5, 6], [6, 5]]))
    assert (busy.value.status, busy.value.headers, str(busy.value)) == (503, {"Retry-After": "1"}, BUSY_3_OF_4)
    with pytest.raises(EngineError) as large:  # 5 > 4: no wait would admit it
        e.submit(ClassifyJob([[5]] * 5))
    assert (large.value.status, str(large.value)) == (
        400, "5 texts is more than this server accepts at once (--max-queued-rows 4): send fewer texts per request")
    second = e.submit(ClassifyJob([[9, 8]]))  # 3 + 1 = 4: exactly the bound
    assert e.admission.rows == 4
    first.cancel()  # its client went away: its 3 rows are free at once
    assert e.admission.rows == 1
    third = e.submit(ClassifyJob([[10, 11, 12], [12, 11]]))  # 1 + 2 = 3
    e.start()
    scored = [second.result(timeout=60), third.result(timeout=60)]  # [1, 1] and [2, 1]
    reference = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    texts = [[[9, 8]], [[10, 11, 12], [12, 11]]]
    assert [[float(row[0]) for row in logits] for logits in scored] == [
        [pytest.approx(by_hand(reference, ids), abs=1e-5) for ids in job] for job in texts]  # each its own slice
    assert (e.batches, e.requests, e.rows, e.admission.cancelled) == (1, 2, 3, 1)  # one batch: both, in order
    assert e.admission.rows == 0
    e.close()
    with pytest.raises(EngineError) as closed:
        e.submit(ClassifyJob([[5]]))
    assert (closed.value.status, str(closed.value)) == (503, "the server is shutting down")


def test_the_generation_queue_bound_answers_and_shutdown(engines, tiny_model_dir):
    e = engines(Engine, tiny_model_dir, max_queued_rows=4, batch_wait_s=0.0)  # not started: all of it waits
    full = e.submit(Job([[5, 6, 7], [7, 6, 5]], 2, GREEDY, None))  # 2 prompts x n=2 = 4 of 4 rows
    with pytest.raises(ServerBusy) as busy:
        e.submit(Job([[5, 6]], 1, GREEDY, None))
    busy_4_of_4 = "the server is busy (4 completions queued, at most 4); retry later or on another server"
    assert (busy.value.status, busy.value.headers, str(busy.value)) == (503, {"Retry-After": "1"}, busy_4_of_4)
    with pytest.raises(EngineError) as large:
        e.submit(Job([[5, 6]] * 3, 2, GREEDY, None))
    assert (large.value.status, str(large.value)) == (400, (
        "3 prompts x n=2 = 6 completions is more than this server accepts at once (--max-queued-rows 4): send fewer "
        "prompts per request"))
    unload = e.submit(AdapterJob("unload", "nothing"))  # an adapter change holds no rows: admitted when full
    full.cancel()
    assert e.admission.rows == 0
    kept = e.submit(Job([[5, 6]], 3, GREEDY, None))  # 3 of 4
    e.start()
    e.close(wait_s=60)  # what was accepted before runs to its end, then the thread ends
    assert len(kept.result(timeout=0)[0].token_ids) == 3
    with pytest.raises(EngineError) as gone:
        unload.result(timeout=0)
    assert gone.value.status == 404  # it ran (there was no such adapter)
    assert (e.batches, e.requests, e.rows, e.admission.cancelled, e.admission.rows) == (1, 1, 3, 1, 0)
    for job in (Job([[5]], 1, GREEDY, None), AdapterJob("unload", "x")):
        with pytest.raises(EngineError) as closed:
            e.submit(job)
        assert (closed.value.status, str(closed.value)) == (503, "the server is shutting down")


def test_classify_over_http_a_full_queue_answers_503_and_a_client_that_leaves_is_dropped(engines, rm_dir):
    e = engines(ClassifyEngine, rm_dir, max_queued_rows=4, batch_wait_s=0.0).start()
    assert e.ready.wait(60) and e.load_error is None
    entered, gate = threading.Event(), threading.Event()

    def wait(*_):  # the engine thread waits in its forward until the gate opens
        entered.set()
        gate.wait(60)

    hold = e.model.register_forward_pre_hook(wait)
    try:
        held = e.submit(ClassifyJob([[5, 6, 7], [7, 6, 5], [8, 9]]))  # 3 of 4 rows
        assert entered.wait(60)  # taken: what comes now waits for the next batch
        with _served(create_app(e, "rm")) as url:
            r = httpx.post(f"{url}/classify", json={"input": [[5, 6], [6, 5]]}, timeout=30)  # 3 + 2 > 4
            assert (r.status_code, r.headers["retry-after"], r.json()["error"]) == (
                503, "1", {"message": BUSY_3_OF_4, "type": "ServiceUnavailableError", "param": None, "code": 503})
            with pytest.raises(httpx.ReadTimeout):  # admitted (4 of 4), and its client leaves while it waits
                httpx.post(f"{url}/classify", json={"input": [[9, 8]]}, timeout=httpx.Timeout(30, read=0.5))
            _wait_until(lambda: e.admission.rows == 3)  # cancelled: its row is free before the engine moves on
            gate.set()
            assert tuple(held.result(timeout=60).shape) == (3, 1)
            _wait_until(lambda: e.admission.cancelled == 1)  # dropped unscored
            assert (e.batches, e.requests, e.rows, e.admission.rows) == (1, 1, 3, 0)
            stats = httpx.get(f"{url}/stats", timeout=30).json()
            assert (stats["queued_completions"], stats["cancelled"]) == (0, 1)
            r = httpx.post(f"{url}/classify", json={"input": [[9, 8]]}, timeout=30)
            assert r.status_code == 200 and len(r.json()["data"]) == 1
    finally:
        gate.set()
        hold.remove()
