"""Episodes keep each episode's keys and values between its turns (rlvr.rollout.turn_cache): the turns sampled so are
the turns a whole-context prefill per turn samples - the same tokens, log-probs to float rounding - for every model
family's attention (sliding windows fall back to the prefill), and a turn then feeds only its new tokens."""

import pytest
import torch

from rlvr.models.prompts import prompt_token_ids
from rlvr.rollout import SamplingParams
from rlvr.rollout.decode_weights import decoding
from rlvr.rollout.episodes import EpisodeLimits, local_turns, run_episodes
from rlvr.rollout.groups import stop_string_checker
from rlvr.rollout.turn_cache import TurnCache
from tests.architectures import make_family_model
from tests.conftest import make_model

PROMPTS = [[{"role": "user", "content": "3 + 4 ="}], [{"role": "user", "content": "12 * 9 = What is 3 + 4?"}]]
G = 4


class Echo:
    """Answers every model turn with an observation that grows turn by turn, so episodes run to their limits."""

    def __init__(self):
        self.turn = 0

    def step(self, text: str, timeout_s: float) -> list[str]:
        self.turn += 1
        return [f"turn {self.turn}: {len(text)}" * self.turn]


def _run(model, tokenizer, keep_cache: bool, eos: list[int], params: SamplingParams, dtype=torch.float32):
    """G episodes per prompt; returns the batch and the TurnCache used (None without one)."""
    prompt_ids = [prompt_token_ids(tokenizer, p) for p in PROMPTS]
    n = len(PROMPTS) * G
    generators = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    made = {}
    with decoding(model, dtype, fold=False) as decoder:
        turns = local_turns(decoder, tokenizer, eos, params, generators, keep_cache=keep_cache)
        made["cache"] = next((c.cell_contents for c in turns.__closure__ or ()
                              if isinstance(c.cell_contents, TurnCache)), None)
        batch = run_episodes(turns, tokenizer, prompt_ids, [Echo() for _ in range(n)], G, params,
                             EpisodeLimits(max_turns=4, max_episode_tokens=240), eos)
    return batch, made["cache"]


def _same(a, b, atol=1e-5):
    assert a.stats.turns == b.stats.turns
    assert torch.equal(a.groups.completion_ids, b.groups.completion_ids)
    assert torch.equal(a.groups.sampled_mask, b.groups.sampled_mask)
    torch.testing.assert_close(a.groups.behaviour_logp, b.groups.behaviour_logp, atol=atol, rtol=0)


def test_cached_turns_are_the_turns_a_whole_prefill_samples(tokenizer):
    model = make_model(len(tokenizer)).eval()
    eos = list(range(0, len(tokenizer), 9))  # turns end at varied lengths
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    prefilled, _ = _run(model, tokenizer, False, eos, params)
    cached, cache = _run(model, tokenizer, True, eos, params)
    _same(prefilled, cached)
    assert max(prefilled.stats.turns) == 4 and min(prefilled.stats.turns) == 1  # several turns, ended at each limit
    # what the later turns did not feed again: every continuing episode's context before its last sampled token
    assert cache.reused_tokens > 0
    # only the episodes sampled in the last turn still hold one (until the run drops the cache)
    assert set(cache.held) == {i for i, t in enumerate(cached.stats.turns) if t == 4}


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mistral", "granite", "phi", "gpt_neox"])
def test_every_familys_attention_continues_from_its_cache(tokenizer, family):
    """Rotary variants (partial, per-head norms), soft-caps, scaled logits; gemma3 and mistral have 8-token windows,
    so their later turns prefill the whole context instead."""
    model = make_family_model(family, len(tokenizer))
    eos = list(range(3, len(tokenizer), 11))
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9)
    prefilled, _ = _run(model, tokenizer, False, eos, params)
    cached, cache = _run(model, tokenizer, True, eos, params)
    _same(prefilled, cached, atol=1e-4)
    assert max(cached.stats.turns) > 1
    assert (cache.reused_tokens > 0) == (family not in ("gemma3", "mistral"))


def test_a_context_that_does_not_extend_the_cache_is_prefilled_whole(tokenizer):
    model = make_model(len(tokenizer)).eval()
    eos = list(range(0, len(tokenizer), 7))
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    stop = stop_string_checker(tokenizer, params.stop)
    prompt = prompt_token_ids(tokenizer, PROMPTS[1])
    with decoding(model, torch.float32, fold=False) as (backbone, head):
        def cache_seeded(*seeds: int) -> TurnCache:
            generators = [torch.Generator().manual_seed(s) for s in seeds]
            return TurnCache(backbone, head, params, eos, tokenizer.pad_token_id, generators, stop)

        cache = cache_seeded(1, 2)
        first = cache([prompt, prompt], [0, 1])
        lengths = first.mask.sum(-1).tolist()
        assert set(cache.held) == {0, 1}  # both wait for their next turn
        # episode 0 goes on; episode 1's history was edited (its first sampled token changed): no longer an extension
        go_on = prompt + first.ids[0, : lengths[0]].tolist() + [5, 6]
        edited = prompt + [(first.ids[1, 0].item() + 1) % 50] + first.ids[1, 1: lengths[1]].tolist() + [5, 6]
        cache.generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
        again = cache([go_on, edited], [0, 1])
        assert cache.reused_tokens == len(prompt) + lengths[0] - 1  # only episode 0's cache was used
        fresh = cache_seeded(3, 4)([go_on, edited], [0, 1])
        assert torch.equal(again.ids, fresh.ids)
        torch.testing.assert_close(again.behaviour_logp, fresh.behaviour_logp, atol=1e-5, rtol=0)
        # an episode left out of a turn has ended: its cache is dropped
        cache([go_on + again.ids[0, : int(again.mask[0].sum())].tolist() + [7]], [0])
        assert set(cache.held) <= {0}


def test_the_prefix_store_stays_within_its_bound_and_matches_only_whole_prefixes():
    """A client flooding a server with requests cannot grow the store past --prefix-cache-mb (least recently used go
    first); a prefix is found only under its own adapter and only where every held token matches."""
    from rlvr.rollout.turn_cache import Held, PrefixStore

    def held(tokens):  # 2 layers, keys and values [1, L, 4] fp32: 32 bytes per token per tensor
        return Held(list(tokens), [torch.zeros(1, len(tokens), 4)] * 2, [torch.zeros(1, len(tokens), 4)] * 2)

    store = PrefixStore(max_bytes=64 * 10)  # ten tokens' worth
    store.put("a", held([1, 2, 3]))  # 3 tokens x 4 tensors x 16 bytes = 192
    store.put("a", held([1, 2, 3, 4, 5]))  # 320
    assert store.find("a", [1, 2, 3, 9]).tokens == [1, 2, 3]
    assert store.find("a", [1, 2, 3, 4, 5, 6]).tokens == [1, 2, 3, 4, 5]  # the longest that fits
    assert store.find("b", [1, 2, 3, 4, 5, 6]) is None  # another adapter's cache is never continued
    assert store.find("a", [1, 2, 4, 4, 5, 6]) is None and store.find("a", [1, 2, 3]) is None  # must extend it
    store.put("a", held([7, 8, 9, 10]))  # 256: over the bound, the least recently used ([1, 2, 3]) goes
    assert store.bytes <= store.max_bytes and store.find("a", [1, 2, 3, 9]) is None
    store.put("a", held(range(20)))  # larger than the whole store: not kept
    assert store.bytes <= store.max_bytes and store.find("a", list(range(21))) is None
    store.clear()
    assert store.bytes == 0 and store.find("a", [7, 8, 9, 10, 11]) is None


def test_caches_past_the_budget_are_never_copied(tokenizer):
    """A server's store is sized before it copies: a batch hands over at most keep_bytes of keys and values (rows in
    the order they end), whatever the store keeps afterwards; 0 copies nothing."""
    from rlvr.rollout.turn_cache import sample_continuing

    model = make_model(len(tokenizer)).eval()
    contexts = [prompt_token_ids(tokenizer, p) for p in PROMPTS]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)

    def kept(budget: float) -> list:
        generators = [torch.Generator().manual_seed(i) for i in range(2 * G)]
        with decoding(model, torch.float32, fold=False) as (backbone, head):
            got = sample_continuing(backbone, head, contexts, [None, None], G, params, [2], tokenizer.pad_token_id,
                                    generators, keep_bytes=budget)
        return [h for h in got.held if h is not None]

    everything = kept(float("inf"))
    assert len(everything) == 2 * G
    one = min(h.bytes for h in everything)
    assert kept(0) == [] and kept(one - 1) == []  # not even one row fits: none is copied
    some = kept(sum(sorted(h.bytes for h in everything)[:3]))
    assert 1 <= len(some) < 2 * G and sum(h.bytes for h in some) <= sum(sorted(h.bytes for h in everything)[:3])
