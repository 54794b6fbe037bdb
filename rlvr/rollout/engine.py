"""Group-aware sampling for Hugging Face causal LMs.

Each distinct prompt is prefilled once; its KV cache is then repeated for the G samples of its group,
so a step pays for B prompt prefills instead of B*G (``generate(num_return_sequences=G)`` pays B*G); a
prefix all prompts share (system message, worked examples) is prefilled once for the batch. All groups
decode together into a preallocated KV cache (no per-token copy), and a sequence that has emitted EOS is
dropped from the batch, so it stops costing compute.

Recorded log-probs: for every generated token we record its log-prob under the distribution it was drawn
from - logits / temperature, then top-k / top-p truncation and renormalisation - which is vLLM's
``processed_logprobs`` mode. Without truncation this is log softmax(logits / temperature)[token], exactly
what the trainer recomputes; with top-k / top-p the behaviour policy really is the truncated one, and the
trainer's importance weight pi / pi_behav accounts for the truncation too. Greedy decoding (temperature 0)
records log softmax(logits)[token].

Randomness: one generator for the whole batch, or one per completion (a list), so that a completion's
tokens depend only on its own seed, whatever else is in the batch (what a server needs for per-request
seeds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rlvr.models.architecture import share_prefix_within
from rlvr.rollout.kv_cache import preallocated_cache


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()  # stop strings: a completion ends once its text contains one


@dataclass
class SampledTokens:
    """What ``generate_groups`` returns: B*G sampled completions as token tensors (the caller decodes the texts),
    row i belonging to prompt i // G."""

    ids: torch.Tensor  # [B*G, T] right-padded with pad_id
    mask: torch.Tensor  # [B*G, T] 1 on generated tokens, EOS included
    behaviour_logp: torch.Tensor  # [B*G, T] float32, 0 on padding
    truncated: torch.Tensor  # [B*G] bool: reached max_new_tokens without EOS
    top_ids: torch.Tensor | None = None  # [B*G, T, k] the k most likely tokens at each step (top_logprobs=k)
    top_logp: torch.Tensor | None = None  # [B*G, T, k] their log-probs under the sampled-from distribution


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits [A, V] outside the top-k / nucleus top-p set with -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p  # keep the token crossing top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


Generators = torch.Generator | list[torch.Generator] | None  # one for the batch, or one per completion


def _uniforms(rows: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One uniform per active row [A, 1]; ``rows`` are the rows' indices in the full batch."""
    if isinstance(generator, list):
        return torch.cat([torch.rand(1, generator=generator[r], device=generator[r].device)
                          for r in rows.tolist()])[:, None]
    return torch.rand(rows.shape[0], 1, generator=generator, device=generator.device if generator else "cpu")


def _next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: Generators, rows: torch.Tensor, full: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pick one token per row of logits [A, V]; return tokens [A], their recorded log-probs [A], and (``full``) the
    log-probs of the whole distribution sampled from [A, V], else None.

    Three passes over the vocabulary: max, exp(x - max) cumulated, and the search; a token's log-prob is
    x_token - max - log(sum exp(x - max)), the log-softmax without materialising it."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
        logp = chosen - torch.logsumexp(logits, dim=-1)
        return tokens, logp, torch.log_softmax(logits, dim=-1) if full else None
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    scaled = _filter_logits(scaled, params.top_k, params.top_p)  # -inf outside top-k / top-p
    top = scaled.max(dim=-1, keepdim=True).values  # [A, 1]
    # Inverse-CDF sampling: one uniform per row (torch.multinomial draws one per vocabulary entry).
    cdf = (scaled - top).exp_().cumsum_(dim=-1)  # [A, V] unnormalised
    total = cdf[:, -1:]  # [A, 1] sum of exp(x - max)
    u = _uniforms(rows, generator).to(cdf.device) * total
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
    logp = (scaled.gather(-1, tokens[:, None]) - top - total.log()).squeeze(-1)
    return tokens, logp, torch.log_softmax(scaled, dim=-1) if full else None


def common_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many leading tokens all the left-padded prompts [B, P] share, leaving each at least one of its own."""
    lengths = prompt_mask.long().sum(-1)  # [B]
    shortest = int(lengths.min())
    if prompt_ids.shape[0] < 2 or shortest < 2:
        return 0
    starts = prompt_ids.shape[1] - lengths  # where each prompt's tokens begin
    aligned = prompt_ids.gather(1, starts[:, None] + torch.arange(shortest - 1, device=prompt_ids.device))
    differs = (aligned != aligned[:1]).any(0)
    return int(differs.nonzero()[0, 0]) if bool(differs.any()) else shortest - 1


def prefill(
    backbone: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache, share_prefix: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the prompts [B, P] into ``cache``; return the last position's hidden state [B, H] and the attention
    mask [B, P] of the cached positions.

    A prefix common to every prompt (a system message, worked examples) of at least ``share_prefix`` tokens
    runs once, as one row whose cache is then repeated for the batch; each prompt's own remainder follows, right
    aligned, so the cache keeps the layout [prefix | padding | remainder] (positions skip the padding). Without
    one, the left-padded prompts run as they are.
    """
    shared = common_prefix_length(prompt_ids, prompt_mask) if share_prefix else 0
    if shared < max(share_prefix, 1):
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        out = backbone(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, cache=cache,
                       use_cache=True)
        return out.last_hidden_state[:, -1], prompt_mask
    b, p = prompt_ids.shape
    device = prompt_ids.device
    lengths = prompt_mask.long().sum(-1)
    first = int(p - lengths[0])  # where prompt 0's tokens begin
    prefix = prompt_ids[:1, first : first + shared]  # [1, S]; every prompt starts with it
    backbone(input_ids=prefix, attention_mask=torch.ones_like(prefix),
             position_ids=torch.arange(shared, device=device)[None], cache=cache, use_cache=True)
    cache.batch_repeat_interleave(b)
    width = p - shared  # remainder block: the last `width` columns, each prompt's own tokens right-aligned
    own = torch.arange(width, device=device)[None, :] >= (width - (lengths - shared))[:, None]  # [B, width]
    rest_mask = own.to(prompt_mask.dtype)
    attn = torch.cat([prompt_mask.new_ones(b, shared), rest_mask], dim=1)  # [B, P]
    positions = shared + (rest_mask.long().cumsum(-1) - 1).clamp(min=0)
    # the columns left of a prompt's own tokens (padding, or its copy of the prefix) are masked out
    out = backbone(input_ids=prompt_ids[:, shared:], attention_mask=attn, position_ids=positions, cache=cache,
                   use_cache=True)
    return out.last_hidden_state[:, -1], attn


@torch.no_grad()
def generate_groups(
    backbone: nn.Module,
    head: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    group_size: int,
    params: SamplingParams,
    eos_ids: list[int],
    pad_id: int,
    generator: Generators = None,
    stop: Callable[[list[int]], bool] | None = None,
    top_logprobs: int = 0,
    share_prefix: int = 16,
) -> SampledTokens:
    """Sample ``group_size`` completions for each prompt.

    Args:
        backbone, head: the model body (returns last_hidden_state) and output layer (hidden [A, H] -> logits [A, V]:
            rlvr.models.policy.backbone_and_head gives the model's whole head, scale and soft-cap included).
        prompt_ids, prompt_mask: [B, P] left-padded prompts.
        eos_ids: token ids that end a completion (kept in it, with mask 1).
        stop: called with a row's completion tokens so far; True ends that completion after the current
            token (used for stop strings; the token completing the stop string is kept).
        top_logprobs: also record the k most likely tokens of each step and their log-probs.
        share_prefix: prefill a token prefix common to all prompts once when it is at least this long (0: never).
    """
    columns = prompt_ids.shape[1] + params.max_new_tokens
    cache = preallocated_cache(columns)  # no per-token copy of the cache
    share_prefix = share_prefix_within(backbone.config, columns, share_prefix)  # exact under sliding windows
    last_hidden, prompt_attn = prefill(backbone, prompt_ids, prompt_mask, cache, share_prefix)
    logits = head(last_hidden).repeat_interleave(group_size, dim=0)  # [B*G, V]
    cache.batch_repeat_interleave(group_size)
    attn = prompt_attn.repeat_interleave(group_size, dim=0)  # [B*G, P]
    next_pos = prompt_mask.long().sum(-1).repeat_interleave(group_size)  # [B*G]
    return decode(backbone, head, logits, cache, attn, next_pos,
                  DecodeSpec(params, eos_ids, pad_id, generator, stop, top_logprobs))


Leaving = Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], None]
"""(their places in the cache's batch [k], their rows of the whole batch [k], the cache, its attention mask
[A, C]): rows about to leave the cache - finished, or all remaining ones when the generation ends. Their keys and
values cover every token but the last one sampled (it was never fed back)."""


@dataclass(frozen=True)
class DecodeSpec:
    """How ``decode`` draws tokens and when a row ends: ``generate_groups``'s arguments of the same names."""

    params: SamplingParams
    eos_ids: list[int]
    pad_id: int
    generator: Generators = None
    stop: Callable[[list[int]], bool] | None = None
    top_logprobs: int = 0


@torch.no_grad()
def decode(backbone: nn.Module, head: nn.Module, logits: torch.Tensor, cache, attn: torch.Tensor,
           next_pos: torch.Tensor, spec: DecodeSpec, leaving: Leaving | None = None) -> SampledTokens:
    """Sample up to ``params.max_new_tokens`` tokens for each of n rows whose contexts are in ``cache``: ``logits``
    [n, V] are the next token's, ``attn`` [n, C] the cache's attention mask, ``next_pos`` [n] the next token's
    position. Finished rows leave the batch and the cache; ``leaving`` sees them go (episodes keep them for their
    next turn)."""
    params, eos_ids, pad_id, generator, stop = spec.params, spec.eos_ids, spec.pad_id, spec.generator, spec.stop
    top_logprobs = spec.top_logprobs
    n = logits.shape[0]
    device = logits.device
    ids = torch.full((n, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, params.max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(n, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    active = torch.arange(n, device=device)  # rows of the full batch still decoding
    eos = torch.tensor(eos_ids, device=device)
    k = top_logprobs
    top_ids = torch.zeros((n, params.max_new_tokens, k), dtype=torch.long, device=device) if k else None
    top_logp = torch.zeros((n, params.max_new_tokens, k), dtype=torch.float32, device=device) if k else None
    history: list[list[int]] = [[] for _ in range(n)] if stop is not None else []  # sampled tokens, on the host
    for t in range(params.max_new_tokens):
        tokens, token_logp, logp_all = _next_tokens(logits, params, generator, active, full=bool(k))
        ids[active, t] = tokens
        logps[active, t] = token_logp
        if k:
            best = logp_all.topk(k, dim=-1)
            top_ids[active, t], top_logp[active, t] = best.indices, best.values
        lengths[active] = t + 1
        done = torch.isin(tokens, eos)
        if stop is not None:  # stop strings: each still-running row's tokens so far, kept on the host
            rows, new, ended = torch.stack([active, tokens, done.long()]).tolist()  # one copy per step, not per row
            flags = []
            for row, token, d in zip(rows, new, ended):
                history[row].append(token)
                flags.append(not d and bool(stop(history[row])))
            done |= torch.tensor(flags, dtype=torch.bool, device=done.device)
        finished[active] = done
        if t + 1 == params.max_new_tokens or bool(done.all()):
            if leaving is not None:
                leaving(torch.arange(active.shape[0], device=device), active, cache, attn)
            break
        if bool(done.any()):  # compact: finished rows leave the batch and the cache
            if leaving is not None:
                gone = done.nonzero().squeeze(-1)
                leaving(gone, active[gone], cache, attn)
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            active, tokens, attn, next_pos = active[keep], tokens[keep], attn[keep], next_pos[keep]
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=-1)
        out = backbone(
            input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos[:, None], cache=cache, use_cache=True
        )
        logits = head(out.last_hidden_state[:, -1])
        next_pos = next_pos + 1
    width = int(lengths.max()) if n else 0
    mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
    return SampledTokens(
        ids=ids[:, :width], mask=mask, behaviour_logp=logps[:, :width], truncated=~finished,
        top_ids=top_ids[:, :width] if k else None, top_logp=top_logp[:, :width] if k else None,
    )
