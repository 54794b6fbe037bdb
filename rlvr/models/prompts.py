"""Prompts as text and token ids: chat messages go through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

import torch

Prompt = str | list[dict[str, Any]]  # raw text, or chat messages [{"role": ..., "content": ...}]


PLAIN_ROLES = {"user": "Q: ", "assistant": "A: "}


def prompt_text(tokenizer, prompt: Prompt) -> str:
    """Chat messages go through the tokenizer's chat template; plain strings are used as they are (as TRL does with
    its standard, non-conversational prompts): a string is never wrapped into a user message here."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this tokenizer has no chat template (a base model?), so chat-message prompts cannot be rendered; "
            "set task.chat_template=false to send them as plain text (Q:/A: turns), or pass string prompts."
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def bare_string_warning(tokenizer, prompts: list[Prompt]) -> str | None:
    """A one-line warning when string prompts are about to reach a model that has a chat template (the caller
    renders chat messages with it): they are sent as they are, without the template, and a chat model given bare
    text tends to ramble. Strings that already hold one of the tokenizer's special tokens (a prompt rendered with
    the template beforehand) do not count. None when there is nothing to warn about."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    bare = [p for p in prompts if isinstance(p, str) and not any(t in p for t in special)]
    if not bare:
        return None
    return (
        f"{len(bare)} of {len(prompts)} prompts are plain strings, sent as they are without the model's chat "
        "template (only chat messages are rendered with it), and a chat model given bare text tends to ramble: "
        "give chat messages instead (prompt: [{role: user, content: ...}], TRL's conversational format), or send "
        "each string as a user message with task.prompt_template='{prompt}'; for a base model that continues text, "
        "set task.chat_template=false"
    )


def plain_text(prompt: Prompt) -> str:
    """Chat messages as a plain transcript for a base model (``task.chat_template=false``): the system message
    as a first paragraph, each user turn as ``Q: ...`` and each assistant turn as ``A: ...``, turns separated by
    a blank line, ending in ``A:`` for the model to continue. Strings are returned as they are.

    [system, user "3 + 4 =", assistant "7", user "8 + 6 ="] -> "system\n\nQ: 3 + 4 =\nA: 7\n\nQ: 8 + 6 =\nA:"
    """
    if isinstance(prompt, str):
        return prompt
    turns = []
    for m in prompt:
        role = m["role"]
        if role == "system":
            turns.append(m["content"] + "\n\n")
        elif role in PLAIN_ROLES:
            turns.append(PLAIN_ROLES[role] + m["content"] + ("\n" if role == "user" else "\n\n"))
        else:
            raise ValueError(f"plain-text prompts know the roles system, user and assistant, not {role!r}")
    if prompt and prompt[-1]["role"] == "assistant":
        raise ValueError("a plain-text prompt must end with a user turn (the model writes the answer after 'A:')")
    return "".join(turns) + "A:"


def prompt_token_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The token ids a prompt is sampled from (special tokens added for plain text, as the template adds its own)."""
    return tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=isinstance(prompt, str))["input_ids"]


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask, both [B, P], from token-id lists."""
    width = max((len(x) for x in sequences), default=0)
    ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in sequences], dtype=torch.long, device="cpu")
    ids = ids.view(len(sequences), width)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in sequences], dtype=torch.long, device="cpu")
    return ids, mask.view(len(sequences), width)


def encode_prompts(tokenizer, prompts: list[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize prompts into left-padded ids and mask, both [B, P]."""
    encoded = [prompt_token_ids(tokenizer, p) for p in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty after tokenization: {prompts[i]!r}")
    return left_pad(encoded, tokenizer.pad_token_id)
