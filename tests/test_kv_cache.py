"""The preallocated KV cache: same keys/values as transformers' DynamicCache through every operation the
sampler uses (prefill, per-token updates, repeat per group, dropping finished rows, outgrowing capacity)."""

import torch
from transformers import DynamicCache

from rlvr.rollout.kv_cache import PreallocatedLayer, preallocated_cache


def _kv(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)


def test_matches_dynamic_cache_through_prefill_repeat_select_and_growth():
    ours, ref = preallocated_cache(capacity=7), DynamicCache()  # 5 prompt + 4 new tokens: grows once
    for layer in (0, 1):
        k, v = _kv(3, 5, seed=layer)
        for cache in (ours, ref):
            cache.update(k, v, layer)
    for cache in (ours, ref):
        cache.batch_repeat_interleave(2)  # [6, H, 5, D]
    for step in range(4):
        for layer in (0, 1):
            k, v = _kv(ours.layers[0].keys.shape[0], 1, seed=10 * step + layer)
            got, want = ours.update(k, v, layer), ref.update(k, v, layer)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        if step == 1:
            keep = torch.tensor([0, 2, 5])
            for cache in (ours, ref):
                cache.batch_select_indices(keep)
    assert isinstance(ours.layers[0], PreallocatedLayer)
    assert ours.get_seq_length() == ref.get_seq_length() == 9
    assert ours.layers[0].capacity == 14  # doubled once, not once per token


def test_updates_write_in_place_within_capacity():
    cache = preallocated_cache(capacity=8)
    cache.update(*_kv(2, 3, seed=0), 0)
    buffer = cache.layers[0].key_buffer
    cache.update(*_kv(2, 1, seed=1), 0)
    assert cache.layers[0].key_buffer is buffer and cache.layers[0].keys.shape == (2, 2, 4, 4)
