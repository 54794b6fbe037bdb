"""rlvr serve as a vLLM user starts it: ``--lora-modules`` in both of vLLM's forms, an adapter folder given as the
model (one line saying what to run instead), and ``stream=true`` read by the real ``openai`` client (skipped where
it is not installed) and, raw, by httpx: the chunks join to exactly the answer sent without ``stream``."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from rlvr.serve.lora_modules import parse_lora_modules, refuse_adapter_as_model
from tests.serving import ROOT, ServerProcess
from tests.test_serve import make_adapter

SERVED = ("tiny", "/models/tiny")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tokenizer):
    return make_adapter(tmp_path_factory.mktemp("lora") / "math", len(tokenizer), seed=3)


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter):
    spec = json.dumps({"name": "json-math", "path": str(adapter), "base_model_name": str(tiny_model_dir)})
    proc = ServerProcess(tiny_model_dir, "--lora-modules", f"math={adapter}", spec).wait_ready()
    yield proc
    proc.stop()


def test_both_forms_parse(adapter):
    spec = json.dumps({"name": "b", "path": str(adapter), "base_model_name": "tiny"})
    assert parse_lora_modules([f"a={adapter}", spec], SERVED) == (("a", str(adapter)), ("b", str(adapter)))


@pytest.mark.parametrize("spec, message", [
    ("math", "--lora-modules math: write NAME=PATH (e.g. --lora-modules math=runs/gsm/adapter) or JSON"),
    ("=x", "--lora-modules =x: write NAME=PATH"),
    ("{not json", "--lora-modules {not json: not valid JSON; write NAME=PATH or"),
    ('{"name": "m"}', 'the JSON form needs string fields "name" and "path"'),
    ("tiny=ADAPTER", "--lora-modules tiny: that is the base model's name; choose another"),
    ("m=/no/such/dir", "--lora-modules m=/no/such/dir: no such folder"),
    ('{"name": "m", "path": "ADAPTER", "base_model_name": "other"}',
     "base_model_name 'other' is not the model this server serves (tiny); leave it out or name that model"),
])
def test_bad_lora_modules_are_one_line(adapter, spec, message):
    with pytest.raises(ValueError) as caught:
        parse_lora_modules([spec.replace("ADAPTER", str(adapter))], SERVED)
    assert message.replace("ADAPTER", str(adapter)) in str(caught.value)


def test_a_folder_without_an_adapter_and_a_name_twice(adapter, tmp_path):
    with pytest.raises(ValueError, match=rf"^--lora-modules m={tmp_path}: no readable LoRA adapter there"):
        parse_lora_modules([f"m={tmp_path}"], SERVED)
    with pytest.raises(ValueError, match="^--lora-modules names m twice"):
        parse_lora_modules([f"m={adapter}", f"m={adapter}"], SERVED)


def test_an_adapter_given_as_the_model_says_so(adapter, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/base-1b"}))
    with pytest.raises(ValueError) as caught:
        refuse_adapter_as_model(str(folder))
    assert str(caught.value) == (f"{folder} is a LoRA adapter, not a model: serve its base model with "
                                 f"--lora-modules NAME=PATH, e.g. rlvr serve org/base-1b --lora-modules "
                                 f"adapter={folder}")
    done = subprocess.run([sys.executable, "-m", "rlvr", "serve", str(folder), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"rlvr: error: {caught.value}"]


def test_lora_modules_are_served_by_name(server, adapter, tiny_model_dir):
    models = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
    assert models["math"]["parent"] == models["json-math"]["parent"] == str(tiny_model_dir)
    assert models["math"]["root"] == str(adapter)
    body = {"prompt": "12 * 9 =", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ids = {name: server.post("/v1/completions", {**body, "model": name}).json()["choices"][0]["token_ids"]
           for name in ("math", "json-math", "")}
    assert ids["math"] == ids["json-math"] != ids[""]  # the same adapter twice; it changes the base's output


def _events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]


def test_stream_chunks_join_to_the_unstreamed_answer(server):
    body = {"prompt": ["12 * 9 =", "Hi"], "n": 2, "max_tokens": 6, "temperature": 0.8, "seed": 7, "logprobs": 1,
            "model": "math", "return_token_ids": True}
    whole = server.post("/v1/completions", body).json()
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    for choice in whole["choices"]:
        parts = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"]
        assert [t for p in parts for t in p["token_ids"]] == choice["token_ids"]
        assert [x for p in parts for x in p["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]
        assert [p["finish_reason"] for p in parts] == [None] * (len(parts) - 1) + [choice["finish_reason"]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["object"] == "text_completion"


def test_the_openai_client_streams_chat_and_completions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    whole = client.chat.completions.create(model="math", messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model="math", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    text = client.completions.create(model="math", prompt="12 * 9 =", max_tokens=6, temperature=0)
    streamed = client.completions.create(model="math", prompt="12 * 9 =", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
