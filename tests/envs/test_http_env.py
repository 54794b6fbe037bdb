"""HttpEnvironment against real servers on loopback, each run by uvicorn in a thread of this process and stopped at
the end of the module: openenv-core's own app (``create_fastapi_app``, skipped when openenv-core is not installed)
serving a counter environment, and a hostile FastAPI server that answers whatever a test scripts. No timings are
asserted: the slow answers only have to be slower than a deadline a fifth of their length."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse

from rlvr.envs.environment import EpisodeError
from rlvr.envs.http_env import HttpEnvError, HttpEnvironment, message_action, observation_text, row_payload


class ThreadServer:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) in a daemon thread; ``stop`` ends it and joins."""

    def __init__(self, app) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="test-http-env-server")
        self.thread.start()
        for _ in range(300):
            if self.server.started:
                break
            if not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            self.thread.join(0.05)
        else:
            self.stop()
            raise RuntimeError("the test server did not start")
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the test server did not stop"


# --- openenv-core's own server ---

def counter_app(shared: bool):
    """openenv-core's FastAPI app for a counter environment: ``reset(question=...)``; each step adds one and echoes
    the message; the third step is done with reward 3.0. ``shared``: the factory returns one instance (the only
    way plain HTTP keeps state on this server)."""
    server = pytest.importorskip("openenv.core.env_server.http_server")
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class CountAction(Action):
        message: str = Field(..., min_length=1)

    class CountObservation(Observation):
        text: str = ""

    class CountEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def reset(self, seed=None, episode_id=None, question: str = "", **kwargs) -> CountObservation:
            self.count = 0
            return CountObservation(text=f" Say three things about {question}.")

        def step(self, action: CountAction, timeout_s=None, **kwargs) -> CountObservation:
            self.count += 1
            done = self.count == 3
            return CountObservation(text=f"{self.count}: {action.message}", done=done,
                                    reward=float(self.count) if done else None)

        @property
        def state(self) -> State:
            return State(step_count=self.count)

    if shared:
        one = CountEnv()
        return server.create_fastapi_app(lambda: one, CountAction, CountObservation, max_concurrent_envs=1)
    return server.create_fastapi_app(CountEnv, CountAction, CountObservation, max_concurrent_envs=4)


@pytest.fixture(scope="module")
def openenv_url():
    served = ThreadServer(counter_app(shared=False))
    yield served.url
    served.stop()


@pytest.fixture(scope="module")
def openenv_shared_url():
    served = ThreadServer(counter_app(shared=True))
    yield served.url
    served.stop()


ROW = {"prompt": [{"role": "user", "content": "Go."}], "question": "cats", "answer": 3, "not_json": object()}


def test_openenv_websocket_episode(openenv_url):
    env = HttpEnvironment(openenv_url)
    try:
        assert env.reset(ROW) == " Say three things about cats."
        assert [o.text for o in env.step("a", 5)] == ["1: a"]
        assert [(o.kind, o.text) for o in env.step("b", 5)] == [("ok", "2: b")]
        assert env.step("c", 5) == []  # done: the episode ends at this turn
        assert env.done and env.observation == "3: c" and env.turns == 3
        assert env.reward() == 3.0 and env.rewards == [None, None, None, 3.0]
        assert env.stats.calls["openenv"] == 3 and not env.stats.errors
        with pytest.raises(HttpEnvError, match="step after the episode ended"):
            env.step("d", 5)
    finally:
        env.release()
    env.release()  # idempotent


def test_openenv_websocket_sessions_are_separate(openenv_url):
    first, second = HttpEnvironment(openenv_url), HttpEnvironment(openenv_url)
    try:
        first.reset(ROW)
        second.reset({"question": "dogs"})
        first.step("a", 5)
        first.step("b", 5)
        assert [o.text for o in second.step("x", 5)] == ["1: x"]
        assert first.step("c", 5) == [] and first.reward() == 3.0
        assert second.reward() is None
    finally:
        first.release()
        second.release()


@pytest.mark.parametrize("transport", ["ws", "http"])
def test_openenv_rejected_action_is_an_observation(openenv_url, transport):
    env = HttpEnvironment(openenv_url, transport=transport)
    try:
        env.reset(ROW)
        [obs] = env.step("", 5)  # CountAction needs at least one character
        assert obs.kind == "bad_arguments" and obs.text.startswith("error: the environment rejected the action:")
        assert "message" in obs.text and env.stats.errors["openenv", "bad_arguments"] == 1
        assert [o.text for o in env.step("a", 5)] == ["1: a"]  # the episode goes on
    finally:
        env.release()


def test_openenv_http_makes_an_environment_per_request(openenv_url):
    """The protocol fact behind transport="ws": openenv-core's POST /step runs on a new instance every time."""
    env = HttpEnvironment(openenv_url, transport="http")
    try:
        assert env.reset(ROW) == " Say three things about cats."
        assert [o.text for o in env.step("a", 5)] == ["1: a"]
        assert [o.text for o in env.step("b", 5)] == ["1: b"]  # not 2: the count did not survive
    finally:
        env.release()


def test_openenv_http_with_a_shared_instance(openenv_shared_url):
    env = HttpEnvironment(openenv_shared_url, transport="http")
    try:
        env.reset(ROW)
        assert [o.text for o in env.step("a", 5)] == ["1: a"]
        assert [o.text for o in env.step("b", 5)] == ["2: b"]
        assert env.step("c", 5) == [] and env.done and env.reward() == 3.0
    finally:
        env.release()


# --- a hostile server ---

SCRIPT: dict = {}  # what the hostile server answers next: set by each test
RECEIVED: dict = {}  # what it was sent last, by endpoint
GOOD = b'{"observation": {"text": "ready"}, "reward": null, "done": false}'
LIMIT = 65_536


def hostile_app() -> FastAPI:
    app = FastAPI()

    async def answer(what: str, request: Request) -> Response:
        RECEIVED[what] = json.loads(await request.body())
        RECEIVED[f"{what}_auth"] = request.headers.get("authorization")
        if SCRIPT.get("key") and request.headers.get("authorization") != f"Bearer {SCRIPT['key']}":
            return Response(b'{"detail": "unauthorized"}', status_code=401, media_type="application/json")
        status, body = SCRIPT.get(what, (200, GOOD))
        if body == "slow":
            await asyncio.sleep(1.0)
            body = GOOD
        if body == "stream":
            return StreamingResponse(iter([b"x" * 8192] * 20), media_type="application/json")
        return Response(body, status_code=status, media_type="application/json")

    @app.post("/reset")
    async def reset(request: Request) -> Response:
        return await answer("reset", request)

    @app.post("/step")
    async def step(request: Request) -> Response:
        return await answer("step", request)

    @app.websocket("/ws")
    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            while True:
                message = json.loads(await websocket.receive_text())
                if message["type"] == "close":
                    break
                good = json.dumps({"type": "observation", "data": json.loads(GOOD)})
                body = SCRIPT.get(f"ws_{message['type']}", good)
                if body == "slow":
                    await asyncio.sleep(1.0)
                    continue
                await websocket.send_text(body)
        except WebSocketDisconnect:
            pass

    return app


@pytest.fixture(scope="module")
def hostile_url():
    served = ThreadServer(hostile_app())
    yield served.url
    served.stop()


@pytest.fixture(autouse=True)
def clean_script():
    SCRIPT.clear()
    RECEIVED.clear()
    yield


@pytest.mark.parametrize(("body", "expected"), [
    (b"not json", "the answer is not JSON"),
    (b"[" * 30_000, "the answer is not JSON"),
    (b'{"observation": {}, "reward": 1' + b"1" * 5000 + b"}", "the answer is not JSON"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'{"observation": "hi"}', '"observation" must be an object, got str'),
    (b'{"reward": 1.0, "done": true}', '"observation" must be an object, got nothing'),
    (b'{"observation": {}, "reward": "high"}', '"reward" must be a number or null, got str'),
    (b'{"observation": {}, "reward": NaN}', '"reward" is nan; rewards must be finite'),
    (b'{"observation": {}, "reward": 1e999}', '"reward" is inf; rewards must be finite'),
    (b'{"observation": {}, "done": "yes"}', '"done" must be true or false, got str'),
    (b'{"observation": {"text": "' + b"x" * 100_000 + b'"}}', f"bytes, over {LIMIT}"),
    ("stream", f"the answer is over {LIMIT} bytes"),
])
def test_hostile_step_answers_are_clear_errors(hostile_url, body, expected):
    SCRIPT["step"] = (200, body)
    env = HttpEnvironment(hostile_url, transport="http", max_response_bytes=LIMIT)
    try:
        assert env.reset({}) == "ready"
        with pytest.raises(HttpEnvError, match="^POST http://127.0.0.1:[0-9]+/step: ") as caught:
            env.step("hi", 5)
        assert expected in str(caught.value) and "\n" not in str(caught.value)
        assert isinstance(caught.value, EpisodeError)
    finally:
        env.release()


def test_hostile_reset_and_server_errors(hostile_url):
    SCRIPT["reset"] = (500, b"Internal Server Error\ntraceback...")
    with pytest.raises(HttpEnvError, match=r"/reset: HTTP 500: Internal Server Error traceback\.\.\."):
        HttpEnvironment(hostile_url, transport="http").reset({})
    SCRIPT["reset"] = (422, b'{"detail": "seed must be >= 0"}')  # a row the server refuses is not the model's doing
    with pytest.raises(HttpEnvError, match="HTTP 422"):
        HttpEnvironment(hostile_url, transport="http").reset({"seed": -1})
    SCRIPT["reset"] = (200, b'{"observation": {}, "reward": 0.5, "done": true}')
    env = HttpEnvironment(hostile_url, transport="http")
    assert env.reset({}) is None and env.done and env.reward() == 0.5
    assert env.step("anything", 5) == []  # reset ended the episode: the sampler's first step gets []
    env.release()


def test_reset_sends_the_rows_json_columns_and_step_the_action(hostile_url):
    env = HttpEnvironment(hostile_url, transport="http", api_key="k1")
    env.reset(ROW)
    env.step("the model's turn", 2.5)
    env.release()
    assert RECEIVED["reset"] == {"prompt": [{"role": "user", "content": "Go."}], "question": "cats", "answer": 3}
    assert RECEIVED["step"] == {"action": {"message": "the model's turn"}, "timeout_s": 2.5}
    assert RECEIVED["reset_auth"] == RECEIVED["step_auth"] == "Bearer k1"


def test_custom_action_and_observation_text(hostile_url):
    SCRIPT["step"] = (200, b'{"observation": {"board": "x.o", "legal": [1, 2]}, "reward": 1, "done": false}')
    env = HttpEnvironment(hostile_url, transport="http", action=lambda text: {"move": text.strip()},
                          observation_to_text=lambda obs: f"board {obs.get('board')}")
    assert env.reset({}) == "board None"
    assert [o.text for o in env.step(" 4 ", 5)] == ["board x.o"]
    assert RECEIVED["step"]["action"] == {"move": "4"} and env.reward() == 1.0
    env.release()
    assert message_action("hi") == {"message": "hi"}
    assert observation_text({"text": "only"}) == "only"
    assert observation_text({"board": "x.o", "legal": [1, 2]}) == '{"board":"x.o","legal":[1,2]}'
    assert row_payload({"a": 1, "b": float("nan"), "c": {1, 2}}) == {"a": 1}


def test_huge_observation_text_is_cut(hostile_url):
    SCRIPT["step"] = (200, json.dumps({"observation": {"text": "y" * 50_000}}).encode())
    env = HttpEnvironment(hostile_url, transport="http", max_response_bytes=LIMIT, max_chars=100)
    env.reset({})
    [obs] = env.step("hi", 5)
    assert obs.text == "y" * 100 + "\n[truncated: 49900 more characters]" and obs.truncated == 49_900
    env.release()
    SCRIPT["reset"] = (200, json.dumps({"observation": {"text": "z" * 50_000}}).encode())
    env = HttpEnvironment(hostile_url, transport="http", max_response_bytes=LIMIT, max_chars=100)
    assert env.reset({}) == "z" * 100 + "\n[truncated: 49900 more characters]"  # it goes into the prompt: bounded too
    env.release()


def test_api_key(hostile_url):
    SCRIPT["key"] = "secret"
    with pytest.raises(HttpEnvError, match=r"HTTP 401 \(check api_key\)"):
        HttpEnvironment(hostile_url, transport="http").reset({})
    env = HttpEnvironment(hostile_url, transport="http", api_key="secret")
    assert env.reset({}) == "ready"
    env.release()


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_slow_step_is_a_timeout_that_ends_the_episode(hostile_url, transport):
    SCRIPT["step"] = (200, "slow")
    SCRIPT["ws_step"] = "slow"
    env = HttpEnvironment(hostile_url, transport=transport)
    try:
        env.reset({})
        assert env.step("hi", 0.2) == [] and env.done
        assert env.stats.errors["openenv", "timeout"] == 1 and env.observation.startswith("error: the environment")
    finally:
        env.release()


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_server_down(transport):
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(HttpEnvError, match="cannot reach the server"):
        HttpEnvironment(f"http://127.0.0.1:{port}", transport=transport, timeout_s=5).reset({})


@pytest.mark.parametrize(("body", "expected"), [
    ("garbage", "the answer is not JSON"),
    ('{"type": "observation", "data": "x"}', 'expected {"type", "data": {...}}'),
    ('{"type": "state", "data": {}}', "expected an observation, got type state"),
    ('{"type": "error", "data": {"message": "env raised", "code": "EXECUTION_ERROR"}}',
     "server error EXECUTION_ERROR: env raised"),
    ('{"type": "observation", "data": {"observation": {}, "reward": NaN}}', "rewards must be finite"),
    ('{"type": "observation", "data": {"observation": {"text": "%s"}}}' % ("z" * 100_000),
     f"the answer is over {LIMIT} bytes"),
])
def test_hostile_websocket_answers_are_clear_errors(hostile_url, body, expected):
    SCRIPT["ws_step"] = body
    env = HttpEnvironment(hostile_url, max_response_bytes=LIMIT)
    try:
        assert env.reset({}) == "ready"
        with pytest.raises(HttpEnvError, match="/ws step: ") as caught:
            env.step("hi", 5)
        assert expected in str(caught.value)
    finally:
        env.release()


def test_bad_configuration():
    with pytest.raises(ValueError, match="transport"):
        HttpEnvironment("http://127.0.0.1:1", transport="grpc")
    with pytest.raises(ValueError, match="http:// or https://"):
        HttpEnvironment("ws://127.0.0.1:1")
    env = HttpEnvironment("http://127.0.0.1:1", action=lambda text: text)
    env._started = True  # no server needed: the builder is checked before anything is sent
    with pytest.raises(HttpEnvError, match="returned str; return a dict"):
        env.step("hi", 1)


def test_a_failing_observation_to_text_is_a_clear_error(hostile_url):
    env = HttpEnvironment(hostile_url, transport="http", observation_to_text=lambda obs: obs["board"])
    with pytest.raises(HttpEnvError, match="observation_to_text raised KeyError: 'board'"):
        env.reset({})
    env.release()


def test_an_openenv_server_drives_training_episodes(openenv_url, tiny_model_dir, tokenizer):
    """env.url end to end: the tiny model's turns are the actions, the observations come back as turns, the server's
    reward is a reward named openenv, reset's text is in the prompt."""
    from rlvr.config.schema import EnvConfig
    from rlvr.models.policy import load_causal_lm
    from rlvr.rewards import WeightedReward
    from rlvr.rollout import LocalSampler, SamplingParams
    from rlvr.run.scoring import build_environment_setup, sample_scored

    setup = build_environment_setup(EnvConfig(url=openenv_url, max_turns=5, max_episode_tokens=400), tokenizer)
    sampler = LocalSampler(load_causal_lm(tiny_model_dir), tokenizer)
    row = {"prompt": [{"role": "user", "content": "Go."}], "question": "cats"}
    seen = {}

    def spy(prompts, completions, environments, **kw):
        seen.update(completions=completions, environments=environments)
        return [0.0] * len(completions)

    params = SamplingParams(max_new_tokens=24, stop=tuple("aeioustnr "))  # random-model turns end soon
    got = sample_scored(sampler, [row, row], 2, params, 0, [WeightedReward("spy", spy)], setup)
    prompt = tokenizer.decode(got.groups.prompt_ids[0][got.groups.prompt_mask[0].bool()])
    assert "Go. Say three things about cats.<|im_end|>" in prompt
    rewards = got.scores.per_function["openenv"].tolist()
    for i, completion in enumerate(seen["completions"]):
        tools = [m["content"] for m in completion if m["role"] == "tool"]
        if rewards[i] == 3.0:  # the server ended the episode on its third step
            assert got.episode_stats.turns[i] == 3 and [t.split(":")[0] for t in tools] == ["1", "2"]
        assert all(isinstance(e, HttpEnvironment) for e in seen["environments"])
    assert rewards.count(3.0) >= 2

