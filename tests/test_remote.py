"""The remote Sampler and the server pool against real `rlvr serve` processes on loopback: groups come back whole
with the trainer's log-probs, failed and timed-out requests are retried elsewhere without duplicates, dead servers
rejoin with the current adapters, adapter loads are all-or-nothing, and the sync loop runs on servers."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from rlvr.config.loading import load_config, to_yaml
from rlvr.learn.batch import StepBatch
from rlvr.learn.forward import completion_logprobs
from rlvr.models.policy import LoraSpec, add_lora, load_causal_lm
from rlvr.rollout import SamplingParams, StaleVersion
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.rollout.server_errors import AdapterSyncError, NoServerError
from rlvr.store.bucket import AdapterBucket
from tests.serving import ServerProcess, post

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], "What is 7?", [{"role": "user", "content": "12 * 9 ="}],
           "Say something."]
PARAMS = SamplingParams(temperature=0.9, max_new_tokens=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(model_dir, seed=0):
    """A LoRA policy whose adapter is not the identity (random B), so the servers must really load it."""
    model = add_lora(load_causal_lm(model_dir), LoraSpec(r=4, alpha=8, target_modules=("q_proj", "v_proj")))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    return model


def _start_together(model_dir, *flags: tuple[str, ...]) -> list[ServerProcess]:
    """`rlvr serve` processes with these flags, started at once (their start-ups overlap) and ready; if one fails,
    those that started are stopped."""
    with ThreadPoolExecutor(len(flags)) as ex:
        futures = [ex.submit(ServerProcess, model_dir, *f) for f in flags]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            f.result()  # raises the first start-up failure
        for server in started:
            server.wait_ready()
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started


@pytest.fixture(scope="module")
def module_servers(tiny_model_dir):
    """The module's shared servers, started together: two that answer (``servers``) and a stuck one (``stuck``)."""
    procs = _start_together(tiny_model_dir, ("--batch-wait-ms", "20"), ("--batch-wait-ms", "20"),
                            ("--batch-wait-ms", "2500"))  # the stuck one's requests sit there 2.5 s
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def servers(module_servers):
    return module_servers[:2]


@pytest.fixture
def fast(servers):
    """The module's second server as the healthy partner of a server a test starts for itself (to kill, stall or
    restart): it only answers requests, so one process serves every such test. The adapters a test leaves on the
    module's servers are unloaded after it (other tests check which adapters those servers hold)."""
    yield servers[1]
    for server in servers:
        _unload_all(server)


def _unload_all(server) -> None:
    for name in _stats(server)["adapters"]:
        assert post(server.url, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


@pytest.fixture
def stuck(module_servers):
    """A server that holds every request 2.5 s, longer than the tests' request timeout (1 s): one process for the
    tests that time out on it (it is never killed). After each, it is idle again (the held request answered) and
    holds no adapters."""
    stuck_server = module_servers[2]
    yield stuck_server
    deadline = time.monotonic() + 30
    while _stats(stuck_server)["queued_completions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    _unload_all(stuck_server)


def _stats(server) -> dict:
    return httpx.get(f"{server.url}/stats").json()


def _sampler(urls, model, tokenizer, tmp_path, **pool_kw):
    pool = ServerPool(urls, probe_interval_s=0.5, **pool_kw)
    return RemoteSampler(pool, tokenizer, model, AdapterBucket(tmp_path / "bucket"))


def test_remote_groups_carry_the_trainers_logprobs(servers, tiny_model_dir, tokenizer, tmp_path):
    model = _trainer(tiny_model_dir)
    sampler = _sampler([s.url for s in servers], model, tokenizer, tmp_path)
    before = [_stats(s) for s in servers]
    sampler.sync(0)
    groups = sampler.sample(PROMPTS, 4, PARAMS, seed=1)
    after = [_stats(s) for s in servers]
    assert groups.num_groups == 4 and groups.completion_ids.shape[0] == 16 and (groups.version == 0).all()
    # one request per prompt, each with its 4 samples, spread over both servers
    requests = [a["requests"] - b["requests"] for a, b in zip(after, before)]
    assert sum(requests) == 4 and min(requests) >= 1
    assert sum(a["completions"] - b["completions"] for a, b in zip(after, before)) == 16
    # the servers sample from exactly the trainer's weights: its log-probs match the trainer's recomputation
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(groups, torch.zeros(16)), torch.arange(16))
    m = groups.completion_mask.bool()
    assert (logp - groups.behaviour_logp)[m].abs().max() < 1e-4
    again = sampler.sample(PROMPTS, 4, PARAMS, seed=1)
    assert torch.equal(again.completion_ids, groups.completion_ids)  # seeded: the same tokens, whatever server
    assert sampler.stats()["servers_live"] == 2 and sampler.stats()["adapter_bytes"] > 0
    sampler.close()


def test_versions_get_their_own_names_and_old_ones_are_unloaded(servers, tiny_model_dir, tokenizer, tmp_path):
    model = _trainer(tiny_model_dir)
    sampler = _sampler([s.url for s in servers], model, tokenizer, tmp_path)
    for version in range(4):
        sampler.sync(version)
    for server in servers:
        assert sorted(_stats(server)["adapters"]) == ["policy-v2", "policy-v3"]  # keep_versions = 2
    assert sampler.bucket.versions() == [2, 3]
    assert sampler.sample(PROMPTS[:1], 2, PARAMS, seed=0).version.tolist() == [3, 3]
    sampler.version = 1  # a request made before v1 was retired, answered after: sample again, not a failure
    with pytest.raises(StaleVersion, match="policy-v1 was unloaded while the request was in flight"):
        sampler.sample(PROMPTS[:1], 2, PARAMS, seed=0)
    sampler.pool.unload_adapter("policy-v2")
    sampler.pool.unload_adapter("policy-v3")
    sampler.close()


@pytest.mark.long
def test_a_killed_server_mid_request_is_retried_elsewhere(tiny_model_dir, tokenizer, tmp_path, fast):
    slow = ServerProcess(tiny_model_dir, "--batch-wait-ms", "1500").wait_ready()  # requests sit there 1.5 s
    try:
        model = _trainer(tiny_model_dir)
        before = _stats(fast)["requests"]  # the shared server's count so far
        sampler = _sampler([slow.url, fast.url], model, tokenizer, tmp_path)
        sampler.sync(0)
        killer = threading.Timer(0.7, slow.kill)  # while the slow server holds its requests
        killer.start()
        groups = sampler.sample(PROMPTS, 3, PARAMS, seed=2)
        killer.join()
        assert groups.num_groups == 4 and groups.completion_ids.shape[0] == 12  # every prompt once, none twice
        assert sampler.pool.stats.servers_lost == 1 and sampler.pool.stats.retries >= 1
        assert _stats(fast)["requests"] - before == 4  # its own two, and the two the killed server held
        sampler.close()
    finally:
        slow.stop()


def test_a_timed_out_request_is_retried_on_another_server(tiny_model_dir, tokenizer, tmp_path, fast, stuck):
    sampler = _sampler([stuck.url, fast.url], _trainer(tiny_model_dir), tokenizer, tmp_path, request_timeout_s=1.0)
    sampler.sync(0)
    groups = sampler.sample(PROMPTS[:2], 2, PARAMS, seed=3)
    assert groups.num_groups == 2 and sampler.pool.stats.retries >= 1
    sampler.close()


@pytest.mark.long
def test_a_dead_server_is_probed_and_rejoins_with_the_current_adapter(tiny_model_dir, tokenizer, tmp_path, fast):
    port = _free_port()
    flaky, steady = ServerProcess(tiny_model_dir, "--port", str(port)).wait_ready(), fast
    try:
        sampler = _sampler([flaky.url, steady.url], _trainer(tiny_model_dir), tokenizer, tmp_path)
        sampler.sync(0)
        flaky.kill()
        assert sampler.sample(PROMPTS, 2, PARAMS, seed=4).num_groups == 4
        assert [s.alive for s in sampler.pool.servers] == [False, True]
        flaky = ServerProcess(tiny_model_dir, "--port", str(port)).wait_ready()  # restarted, with no adapters
        assert _stats(flaky)["adapters"] == []
        time.sleep(0.6)  # past the probe interval
        sampler.sample(PROMPTS, 2, PARAMS, seed=5)
        assert sampler.pool.stats.servers_revived == 1 and _stats(flaky)["adapters"] == ["policy-v0"]
        assert _stats(flaky)["requests"] >= 1
        sampler.close()
    finally:
        flaky.stop()


def test_adapter_load_is_all_or_nothing(servers, tiny_model_dir, tokenizer, tmp_path, fast):
    full = fast  # the shared server (--max-loras 4, the default) filled with blockers; `fast` unloads them after
    bucket = AdapterBucket(tmp_path / "bucket")
    blocker = bucket.publish_adapter(_trainer(tiny_model_dir, seed=1), 1)
    for k in range(4):
        r = post(full.url, "/v1/load_lora_adapter", {"lora_name": f"blocker-{k}", "lora_path": blocker.url})
        assert r.status_code == 200
    pool = ServerPool([servers[0].url, full.url])
    published = bucket.publish_adapter(_trainer(tiny_model_dir, seed=2), 2)
    with pytest.raises(AdapterSyncError, match="did not load everywhere.*max-loras 4"):
        pool.load_adapter("policy-v2", published.url)
    assert "policy-v2" not in _stats(servers[0])["adapters"] and "policy-v2" not in pool.adapters
    pool.close()


def test_all_servers_dead_is_a_clear_error_in_bounded_time(tiny_model_dir, tokenizer, tmp_path):
    urls = [f"http://127.0.0.1:{_free_port()}" for _ in range(2)]  # nothing listens there
    pool = ServerPool(urls, probe_interval_s=0.2, no_server_wait_s=1.0)
    sampler = RemoteSampler(pool, tokenizer, _trainer(tiny_model_dir), AdapterBucket(tmp_path / "b"))
    started = time.monotonic()
    with pytest.raises(NoServerError, match="no rollout server reachable for 1 s"):
        sampler.sync(0)
        sampler.sample(PROMPTS, 2, PARAMS, seed=0)
    assert time.monotonic() - started < 15
    with pytest.raises(NoServerError, match="have been unreachable for 1 s"):
        pool.post("/v1/completions", {"prompt": "x"})
    pool.close()


def test_sync_loop_trains_with_generation_on_servers(servers, tiny_model_dir, tmp_path):
    from rlvr.launch import train
    from tests.test_e2e import _overrides

    out = tmp_path / "run"
    cfg = load_config(None, _overrides(tiny_model_dir, out) + [
        "rollout.backend=server", f"rollout.servers=[{servers[0].url}, {servers[1].url}]", "train.steps=3",
        "log.trackers=[]", "log.plot=false"])
    summary = train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and len(records) == 4
    assert all(r["sampler/adapter_bytes"] > 0 and r["sampler/servers_live"] == 2 for r in records[1:])
    assert records[-1]["sampler/requests"] >= 3 * 2  # two prompts a step, one request each (plus evaluation)
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["v00000002", "v00000003"]
    for server in servers:
        assert sorted(_stats(server)["adapters"]) == ["policy-v2", "policy-v3"]
        for name in ("policy-v2", "policy-v3"):
            post(server.url, "/v1/unload_lora_adapter", {"lora_name": name})
    with pytest.raises(Exception, match="rollout.backend=server ships LoRA adapters"):
        load_config(None, ["rollout.backend=server", "rollout.servers=[http://x]", "model.lora=false"])


def test_a_server_that_was_away_drops_the_versions_it_missed_the_unload_of(tiny_model_dir, tokenizer, tmp_path,
                                                                            fast, stuck):
    """A stuck server (its request timed out) is marked dead but keeps running with its adapters; while it is
    away the pool moves on two versions. When it is probed back, it unloads what the pool dropped meanwhile and
    loads what it lacks, so it never piles up adapters up to --max-loras."""
    sampler = _sampler([stuck.url, fast.url], _trainer(tiny_model_dir), tokenizer, tmp_path, request_timeout_s=1.0)
    sampler.sync(0)
    sampler.sync(1)
    assert sorted(_stats(stuck)["adapters"]) == ["policy-v0", "policy-v1"]
    sampler.sample(PROMPTS[:2], 2, PARAMS, seed=3)  # the stuck server times out: marked dead
    assert [s.alive for s in sampler.pool.servers] == [False, True]
    sampler.sync(2)
    sampler.sync(3)  # v0 and v1 unloaded from the live server only
    assert sorted(_stats(stuck)["adapters"]) == ["policy-v0", "policy-v1"]
    time.sleep(3)  # the stuck request (held 2.5 s) finishes; the probe interval (0.5 s) has passed
    sampler.sync(4)  # probes the server back (syncing it to v2, v3), then loads v4 everywhere, drops v2
    assert sampler.pool.servers[0].alive and sampler.pool.stats.servers_revived == 1
    assert sorted(_stats(stuck)["adapters"]) == ["policy-v3", "policy-v4"]
    sampler.close()


def test_the_pool_against_a_server_with_an_api_key(tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """`rlvr serve` started with a key (through RLVR_API_KEY, as the runtimes do): the pool with the key samples;
    without it, or with another, it stops before any work with an error that says where the key comes from - and
    build_sampler reads the key from the variable rollout.api_key_env names, never from the config."""
    from rlvr.rollout.server_errors import ServerAuthError
    from rlvr.run.build import build_sampler

    server = ServerProcess(tiny_model_dir, api_key="k-3f9a").wait_ready()
    try:
        for key, hint in ((None, "requires an API key and the pool sent none"),
                          ("k-wrong", "does not accept the pool's API key")):
            pool = ServerPool([server.url], api_key=key)
            with pytest.raises(ServerAuthError, match=f"refused the request \\(401.*{hint}.*rollout.api_key_env"):
                pool.wait_ready(30)
            with pytest.raises(AdapterSyncError, match=f"401.*{hint}"):  # a pool that skipped wait_ready
                pool.load_adapter("policy-v0", str(tmp_path))
            pool.close()
        model = _trainer(tiny_model_dir)
        sampler = _sampler([server.url], model, tokenizer, tmp_path, api_key="k-3f9a")
        sampler.sync(0)
        assert sampler.sample(PROMPTS, 2, PARAMS, seed=0).num_groups == 4
        sampler.close()

        overrides = ["rollout.backend=server", f"rollout.servers=[{server.url}]", "rollout.api_key_env=MY_ROLLOUT_KEY",
                     "rollout.server_wait_s=30", f"model.name={tiny_model_dir}"]
        cfg = load_config(None, overrides)
        monkeypatch.delenv("MY_ROLLOUT_KEY", raising=False)
        with pytest.raises(ServerAuthError, match="sent none"):
            build_sampler(cfg, model, tokenizer, tmp_path)
        monkeypatch.setenv("MY_ROLLOUT_KEY", "k-3f9a")
        sampler = build_sampler(cfg, model, tokenizer, tmp_path)
        sampler.sync(1)
        assert sampler.sample(PROMPTS[:1], 2, PARAMS, seed=0).version.tolist() == [1, 1]
        sampler.close()
        assert "k-3f9a" not in to_yaml(cfg) and "MY_ROLLOUT_KEY" in to_yaml(cfg)  # what the run directory keeps
    finally:
        server.stop()
