"""Episodes over real `rlvr serve` processes: the learner drives the turns with token-id prompts (observations
appended as tokens, the server's log-probs are the trainer's on sampled tokens, seeded turns repeat); a server
killed mid-episode moves the next turn to another server and no episode is lost or doubled."""

import threading

import pytest
import torch

from rlvr.learn.batch import StepBatch
from rlvr.learn.forward import completion_logprobs
from rlvr.models.prompts import prompt_token_ids
from rlvr.rollout import SamplingParams
from rlvr.rollout.episodes import EpisodeLimits, observation_ids
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.remote_sampler import RemoteSampler
from rlvr.store.bucket import AdapterBucket
from tests.serving import ServerProcess
from tests.test_remote import _start_together, _trainer

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 ="}]]
LIMITS = EpisodeLimits(max_turns=3, max_episode_tokens=200)
STOP = SamplingParams(temperature=1.0, max_new_tokens=24, stop=tuple("aeioustnr "))  # random-model turns end soon


class Answering:
    """Answers the first two turns with one observation each, then ends the episode."""

    def __init__(self):
        self.seen = []

    def step(self, text, timeout_s):
        self.seen.append(text)
        return ["42"] if len(self.seen) <= 2 else []


@pytest.fixture(scope="module")
def module_servers(tiny_model_dir):
    """Started together: a server with the default flags (``shared``) and one that keeps no prefix cache."""
    procs = _start_together(tiny_model_dir, (), ("--prefix-cache-mb", "0"))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
def shared(module_servers):
    """One `rlvr serve` (default flags) for every test here that only sends it requests: the server of the first
    test, the healthy partner of the killed one, the prefix-caching one; the adapters a test leaves on it are
    unloaded after it."""
    yield module_servers[0]
    for server in module_servers:
        for name in server.get("/stats").json()["adapters"]:
            assert server.post("/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def _ids(tokenizer):
    return [prompt_token_ids(tokenizer, p) for p in PROMPTS]


def _remote(urls, model, tokenizer, tmp_path):
    sampler = RemoteSampler(ServerPool(urls, probe_interval_s=0.5), tokenizer, model, AdapterBucket(tmp_path / "b"))
    sampler.sync(0)
    return sampler


def _check_stream(got, envs):
    """Each episode: its turns as the environment saw them; turn, observation, ... turn in the stream."""
    for i, env in enumerate(envs):
        assert got.stats.turns[i] == len(env.seen)
        mask = got.groups.sampled_mask[i][got.groups.completion_mask[i].bool()]
        switches = int(torch.diff(mask).ne(0).sum())
        assert mask[0] == 1 and switches == 2 * (len(env.seen) - 1) - (0 if mask[-1] == 1 else 1)


def test_episodes_over_rlvr_serve_carry_the_trainers_logprobs(tiny_model_dir, tokenizer, tmp_path, shared):
    model = _trainer(tiny_model_dir)
    remote = _remote([shared.url], model, tokenizer, tmp_path)
    envs = [Answering() for _ in range(4)]
    got = remote.sample_episodes(_ids(tokenizer), envs, 2, STOP, seed=5, limits=LIMITS)
    again = remote.sample_episodes(_ids(tokenizer), [Answering() for _ in range(4)], 2, STOP, seed=5, limits=LIMITS)
    remote.close()
    g = got.groups
    assert torch.equal(g.completion_ids, again.groups.completion_ids)  # every turn seeded: the same episodes
    _check_stream(got, envs)
    assert max(got.stats.turns) == 3 and got.stats.observation_tokens > 0
    # turns stopped at a stop string end without the end-of-turn token: the observation brings it
    obs = observation_ids(tokenizer, ["42"], turn_closed=False)
    rows = [g.completion_ids[i][g.completion_mask[i].bool()].tolist() for i in range(4)]
    assert any(r[k:k + len(obs)] == obs for r in rows for k in range(len(r)))
    # behaviour log-probs from the server are the trainer's, on sampled tokens only
    with torch.no_grad():
        logp, _ = completion_logprobs(model, StepBatch.from_groups(g, torch.zeros(4)), torch.arange(4))
    sampled = g.sampled_mask.bool()
    assert (logp - g.behaviour_logp)[sampled].abs().max() < 1e-4
    assert (g.behaviour_logp[~sampled] == 0).all()


@pytest.mark.long
def test_a_server_killed_mid_episode_moves_the_turn_elsewhere(tiny_model_dir, tokenizer, tmp_path, shared):
    slow, fast = ServerProcess(tiny_model_dir, "--batch-wait-ms", "1500").wait_ready(), shared
    try:
        model = _trainer(tiny_model_dir)
        sampler = _remote([slow.url, fast.url], model, tokenizer, tmp_path)
        envs = [Answering() for _ in range(4)]
        killer = threading.Timer(0.7, slow.kill)
        killer.start()
        got = sampler.sample_episodes(_ids(tokenizer), envs, 2, STOP, seed=1, limits=LIMITS)
        killer.join()
        assert sampler.pool.stats.servers_lost == 1
        # every episode whole: each turn once in the stream, each observation once, none twice
        _check_stream(got, envs)
        assert max(got.stats.turns) >= 2
        sampler.close()
    finally:
        slow.stop()




def test_a_servers_prefix_store_feeds_only_each_turns_new_tokens(tiny_model_dir, tokenizer, tmp_path, shared,
                                                                  module_servers):
    """The same seeded episodes from a server that keeps completions' caches (the default) and from one that keeps
    none: the same tokens, log-probs to float rounding; the first continued every later turn from its store, which
    an adapter load empties. Both are the module's servers; the keeping one is shared, its counters compared before
    and after (loading this test's adapter empties what earlier tests left in its store)."""
    kept, plain = shared, module_servers[1]
    model = _trainer(tiny_model_dir)
    got = {}
    for name, server in (("kept", kept), ("plain", plain)):
        remote = _remote([server.url], model, tokenizer, tmp_path / name)
        if name == "kept":
            start = kept.get("/stats").json()
            assert start["prefix_cache_bytes"] == 0  # the adapter load emptied the store
        got[name] = remote.sample_episodes(_ids(tokenizer), [Answering() for _ in range(4)], 2, STOP, seed=5,
                                           limits=LIMITS)
        if name == "kept":
            stats = kept.get("/stats").json()
            remote.sync(1)  # a new adapter version: nothing held may be continued under it
            after_load = kept.get("/stats").json()
        remote.close()
    assert "prefix_hits" not in plain.get("/stats").json()
    a, b = got["kept"].groups, got["plain"].groups
    assert torch.equal(a.completion_ids, b.completion_ids) and got["kept"].stats.turns == got["plain"].stats.turns
    torch.testing.assert_close(a.behaviour_logp, b.behaviour_logp, atol=1e-5, rtol=0)
    later_turns = sum(t - 1 for t in got["kept"].stats.turns)
    # every later turn continued its episode's cache
    assert later_turns > 0 and stats["prefix_hits"] - start["prefix_hits"] == later_turns
    assert stats["prefix_reused_tokens"] > start["prefix_reused_tokens"] and stats["prefix_cache_bytes"] > 0
    assert after_load["prefix_cache_bytes"] == 0
