"""Keys and values kept after a generation, so that a context extending one feeds only its new tokens: an
episode's next turn in process (``TurnCache``), a request that extends an earlier one on ``rlvr serve``
(``PrefixStore``).

Without it every turn prefills the episode's whole context again - the prompt, every earlier turn and every
observation - which made episodes far slower per model token than single-turn decoding (BENCHMARKS.md,
"Episodes": the whole-prefill row against the single-turn one).
Here the rows of a finished generation hand their cache columns over (``decode``'s ``leaving``); a later context
that starts with a held row's tokens gets them laid out again, right-aligned, and only its new tokens - the last
token the row sampled (never fed back) and what came after it, an observation - are fed, as one block, before
decoding goes on. Contexts without a held cache are fed whole in the same block; when none has one, each distinct
context is prefilled once (the G episodes of a prompt share theirs) by the shared-prefix prefill of single-turn
sampling.

What changes against a re-prefill: an earlier turn's keys and values come from the decode steps that produced it
rather than from one pass over the whole context, so log-probs agree to float rounding (the tokens do not change);
the trainer rescores every token in one pass anyway. Held back where it would not be exact: under sliding-window
or chunked attention once the cache could outgrow the window (a window counts cache columns, and the layout pads
between turns) - such a generation prefills whole contexts, as before.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rlvr.models.architecture import attention_window, share_prefix_within
from rlvr.models.prompts import left_pad
from rlvr.rollout.engine import DecodeSpec, Generators, SampledTokens, SamplingParams, decode, prefill
from rlvr.rollout.kv_cache import preallocated_cache


@dataclass
class Held:
    """One row's cache after a generation: the keys and values of ``tokens`` (its context and completion without
    the last token sampled), per layer [H_kv, len(tokens), D]."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def starts(self, context: list[int]) -> bool:
        """Whether ``context`` extends these tokens by at least one."""
        return len(context) > len(self.tokens) and context[: len(self.tokens)] == self.tokens


@dataclass
class Continued:
    out: SampledTokens  # [n * group_size] rows, as generate_groups returns them
    held: list[Held | None]  # each row's cache after the generation (None: not kept)
    reused: int  # context tokens not fed again


@torch.no_grad()
def sample_continuing(backbone: nn.Module, head: Callable, contexts: list[list[int]], held: list[Held | None],
                      group_size: int, params: SamplingParams, eos_ids: list[int], pad_id: int,
                      generators: Generators = None, stop: Callable[[list[int]], bool] | None = None,
                      top_logprobs: int = 0, keep_bytes: float = math.inf) -> Continued:
    """``group_size`` completions of each context (rows ordered as generate_groups orders them), continuing from
    ``held[i]`` where it is given (it must hold a prefix of ``contexts[i]``: ``Held.starts``). Rows' caches are
    returned for the next call up to ``keep_bytes`` in all, in the order the rows end (a row past the budget is not
    copied at all; 0: none kept)."""
    window = attention_window(backbone.config)
    width = max((len(h.tokens) for h in held if h), default=0)
    fed = max(len(c) - (len(h.tokens) if h else 0) for c, h in zip(contexts, held))
    if window is not None and width + fed + params.max_new_tokens > window:
        held = [None] * len(contexts)  # the layout's padding would count against the window: prefill whole
    reused = sum(len(h.tokens) for h in held if h)
    if reused:
        cache, logits, attn, next_pos = _extend(backbone, head, contexts, held, pad_id, params.max_new_tokens)
    else:
        cache, logits, attn, next_pos = _prefill(backbone, head, contexts, pad_id, params.max_new_tokens)
    del held
    if group_size > 1:
        cache.batch_repeat_interleave(group_size)
        logits, attn, next_pos = (t.repeat_interleave(group_size, dim=0) for t in (logits, attn, next_pos))
    leaving: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    budget = keep_bytes

    def hand_over(places: torch.Tensor, rows: torch.Tensor, cache, attn: torch.Tensor) -> None:
        nonlocal budget
        position = sum(layer.keys[0, :, 0].numel() * layer.keys.element_size() * 2 for layer in cache.layers)
        for place, row in zip(places.tolist(), rows.tolist()):
            columns = attn[place].nonzero().squeeze(-1)  # this row's tokens, in order
            if len(columns) * position > budget:
                continue  # sized before it is copied: past the budget nothing is
            budget -= len(columns) * position
            leaving[row] = ([layer.keys[place].index_select(1, columns) for layer in cache.layers],
                            [layer.values[place].index_select(1, columns) for layer in cache.layers])

    out = decode(backbone, head, logits, cache, attn, next_pos,
                 DecodeSpec(params, eos_ids, pad_id, generators, stop, top_logprobs),
                 leaving=hand_over if keep_bytes > 0 else None)
    del cache
    after: list[Held | None] = [None] * out.ids.shape[0]
    lengths = out.mask.sum(-1).tolist()
    for row, (keys, values) in leaving.items():
        tokens = contexts[row // group_size] + out.ids[row, : lengths[row] - 1].tolist()
        if lengths[row] and keys and keys[0].shape[1] == len(tokens):
            after[row] = Held(tokens, keys, values)
    return Continued(out, after, reused)


def _prefill(backbone: nn.Module, head: Callable, contexts: list[list[int]], pad_id: int, max_new_tokens: int):
    """Every context prefilled from scratch, each distinct one once."""
    device = next(backbone.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    index = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]
    ids, mask = left_pad([list(c) for c in distinct], pad_id)  # [U, P]
    columns = ids.shape[1] + max_new_tokens
    cache = preallocated_cache(columns)
    share = share_prefix_within(backbone.config, columns, 16)
    last_hidden, attn = prefill(backbone, ids.to(device), mask.to(device), cache, share)
    rows = torch.tensor(index, device=device)  # [n] each context's distinct one
    if len(distinct) < len(contexts):
        cache.batch_select_indices(rows)
    return cache, head(last_hidden)[rows], attn[rows], mask.sum(-1).to(device)[rows]


def _extend(backbone: nn.Module, head: Callable, contexts: list[list[int]], held: list[Held | None], pad_id: int,
            max_new_tokens: int):
    """The held caches laid out right-aligned [n, H_kv, W, D], then each context's new tokens fed as one block
    (right-aligned too); a context without a cache is fed whole."""
    device = next(backbone.parameters()).device
    n, width = len(contexts), max(len(h.tokens) for h in held if h)
    lengths = [len(h.tokens) if h else 0 for h in held]
    block, block_mask = left_pad([c[length:] for c, length in zip(contexts, lengths)], pad_id)  # [n, M]
    cache = preallocated_cache(width + block.shape[1] + max_new_tokens)
    sample = next(h for h in held if h)
    for layer, (k0, v0) in enumerate(zip(sample.keys, sample.values)):
        keys = k0.new_zeros(n, k0.shape[0], width, k0.shape[2])  # [n, H_kv, W, D]; masked where no token
        values = v0.new_zeros(n, v0.shape[0], width, v0.shape[2])
        for row, h in enumerate(held):
            if h:
                keys[row, :, width - lengths[row]:] = h.keys[layer]
                values[row, :, width - lengths[row]:] = h.values[layer]
        cache.update(keys, values, layer)
    start = torch.tensor(lengths, device=device)  # [n] the first new token's position
    kept = (torch.arange(width, device=device)[None, :] >= (width - start)[:, None]).long()  # [n, W]
    block, block_mask = block.to(device), block_mask.to(device)
    attn = torch.cat([kept, block_mask], dim=1)  # [n, W + M]
    positions = start[:, None] + (block_mask.cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=block, attention_mask=attn, position_ids=positions, cache=cache, use_cache=True)
    return cache, head(out.last_hidden_state[:, -1]), attn, start + block_mask.sum(-1)


class TurnCache:
    """Samples one model turn for each of several episodes (rlvr.rollout.episodes' TurnSampler shape, returning the
    sampled tokens), keeping each episode's cache for its next turn. One per episode run: an episode absent from a
    turn has ended, and its cache goes."""

    def __init__(self, backbone: nn.Module, head: Callable, params: SamplingParams, eos_ids: list[int], pad_id: int,
                 generators: list[torch.Generator], stop: Callable[[list[int]], bool] | None = None):
        self.backbone, self.head, self.params = backbone, head, params
        self.eos_ids, self.pad_id, self.generators, self.stop = eos_ids, pad_id, generators, stop
        self.held: dict[int, Held] = {}
        self.reused_tokens = 0  # context tokens not fed again (for tests and benchmarks)

    def __call__(self, contexts: list[list[int]], episodes: list[int]) -> SampledTokens:
        held = [h if (h := self.held.get(e)) is not None and h.starts(c) else None for e, c in zip(episodes, contexts)]
        self.held = {}
        got = sample_continuing(self.backbone, self.head, contexts, held, 1, self.params, self.eos_ids, self.pad_id,
                                [self.generators[e] for e in episodes], self.stop)
        self.reused_tokens += got.reused
        self.held = {e: h for e, h in zip(episodes, got.held) if h is not None}
        return got.out


class PrefixStore:
    """Held caches of a server's recent completions, looked up by token prefix, least recently used dropped
    beyond ``max_bytes``; keyed by adapter too (emptied whenever adapters change)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self._entries: collections.OrderedDict[tuple, Held] = collections.OrderedDict()
        self._lengths: collections.Counter = collections.Counter()  # how many entries hold each length
        self.hits = self.reused_tokens = 0

    def find(self, adapter: str | None, context: list[int]) -> Held | None:
        """The longest held cache whose tokens begin ``context`` (and are shorter)."""
        for length in sorted((n for n in self._lengths if n < len(context)), reverse=True):
            key = (adapter, tuple(context[:length]))
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
        return None

    def put(self, adapter: str | None, held: Held) -> None:
        size = held.bytes
        if size > self.max_bytes:
            return
        key = (adapter, tuple(held.tokens))
        if key in self._entries:
            self._remove(key)
        self._entries[key] = held
        self.bytes += size
        self._lengths[len(held.tokens)] += 1
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0

    def _remove(self, key: tuple) -> None:
        held = self._entries.pop(key)
        self.bytes -= held.bytes
        self._lengths[len(held.tokens)] -= 1
        if not self._lengths[len(held.tokens)]:
            del self._lengths[len(held.tokens)]
