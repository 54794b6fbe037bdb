"""A KV cache whose keys and values live in buffers sized for the whole generation.

transformers' DynamicCache grows by ``torch.cat`` on every decoded token, which copies the whole cache each
step: with a long prompt repeated for every completion of a group (e.g. 64 rows x 300 tokens x 30 layers,
~0.9 GB in fp32) that is a sizeable share of a long generation (BENCHMARKS.md, "Long completions"). Here each layer
writes the new token's keys/values in place and hands attention a view of the filled part; the buffers are
reallocated only when rows leave the batch (``batch_select_indices``) or a generation outgrows its reservation.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys/values in [B, H, capacity, D] buffers; ``keys``/``values`` are views [B, H, length, D]."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _t, d = key_states.shape
        self.key_buffer = key_states.new_empty(b, h, self.capacity, d)
        self.value_buffer = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:  # outgrew the reservation: double it (one copy)
            self.capacity = max(end, 2 * self.capacity)
            self.key_buffer = _with_capacity(self.key_buffer, self.length, self.capacity)
            self.value_buffer = _with_capacity(self.value_buffer, self.length, self.capacity)
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def _refresh_views(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._refresh_views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.key_buffer = self.key_buffer[indices]
            self.value_buffer = self.value_buffer[indices]
            self._refresh_views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PreallocatedLayer does not crop")


def _with_capacity(buffer: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    b, h, _c, d = buffer.shape
    grown = buffer.new_empty(b, h, capacity, d)
    grown[:, :, :length] = buffer[:, :, :length]
    return grown


def preallocated_cache(capacity: int) -> DynamicCache:
    """A DynamicCache whose layers (created on first use) hold ``capacity`` positions without reallocating."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: PreallocatedLayer(capacity)
    return cache
