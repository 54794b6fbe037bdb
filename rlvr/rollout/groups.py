"""Turn dataset prompts into token ids and sample a group of completions for each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from rlvr.models import backbone_and_head
from rlvr.rollout.engine import SamplingParams, generate_groups

Prompt = str | list[dict[str, Any]]  # raw text, or chat messages [{"role": ..., "content": ...}]


@dataclass
class Groups:
    """G completions for each of B prompts; completion row i belongs to prompt i // G."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B*G, T] right-padded
    completion_mask: torch.Tensor  # [B*G, T]
    sampling_logp: torch.Tensor  # [B*G, T] log-probs recorded while sampling
    truncated: torch.Tensor  # [B*G] bool
    texts: list[str]  # [B*G] decoded completions, special tokens removed
    group_size: int
    policy_version: int = 0

    @property
    def num_completions(self) -> int:
        return self.completion_ids.shape[0]


def prompt_text(tokenizer, prompt: Prompt) -> str:
    """Chat messages go through the tokenizer's chat template; plain strings are used as they are."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts into left-padded ids and mask, both [B, P]."""
    texts = [prompt_text(tokenizer, p) for p in prompts]
    chat = [not isinstance(p, str) for p in prompts]
    encoded = [tokenizer(t, add_special_tokens=not c)["input_ids"] for t, c in zip(texts, chat)]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization: {prompts[i]!r}")
    width = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in encoded], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in encoded], dtype=torch.long)
    return ids, mask


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


def stop_string_checker(tokenizer, stops: tuple[str, ...]) -> Callable[[list[int]], bool] | None:
    """True once the decoded tail of a completion contains a stop string (tail: enough tokens to hold the
    longest stop string, since every token decodes to at least one character)."""
    if not stops:
        return None
    window = max(len(s) for s in stops) + 1

    def stopped(token_ids: list[int]) -> bool:
        tail = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    return stopped


def sample_groups(
    model: nn.Module,
    tokenizer,
    prompts: list[Prompt],
    group_size: int,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    policy_version: int = 0,
) -> Groups:
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)
    backbone, head = backbone_and_head(model)
    was_training = model.training
    model.eval()
    try:
        out = generate_groups(
            backbone,
            head,
            prompt_ids,
            prompt_mask,
            group_size,
            params,
            eos_ids=eos_token_ids(model, tokenizer),
            pad_id=tokenizer.pad_token_id,
            generator=generator,
            stop=stop_string_checker(tokenizer, params.stop),
        )
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(
        [row[m.bool()].tolist() for row, m in zip(out.ids, out.mask)], skip_special_tokens=True
    )
    return Groups(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=out.ids,
        completion_mask=out.mask.long(),
        sampling_logp=out.sampling_logp,
        truncated=out.truncated,
        texts=texts,
        group_size=group_size,
        policy_version=policy_version,
    )
