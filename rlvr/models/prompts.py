"""Prompts as text and token ids: chat messages go through the tokenizer's chat template."""

from __future__ import annotations

import re
import secrets
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


_SPECIAL: dict[int, tuple[Any, frozenset[int], tuple[str, ...]]] = {}  # id(tokenizer) -> (it, ids, strings)


def special_tokens(tokenizer) -> tuple[frozenset[int], tuple[str, ...]]:
    """The ids and strings of every special token of ``tokenizer`` (its named ones and its added special ones)."""
    known = _SPECIAL.get(id(tokenizer))
    if known is None or known[0] is not tokenizer:
        ids = set(tokenizer.all_special_ids)
        ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special)
        strings = tuple(t for t in tokenizer.convert_ids_to_tokens(sorted(ids)) if t)
        known = _SPECIAL[id(tokenizer)] = (tokenizer, frozenset(ids), strings)
    return known[1], known[2]


def has_special_tokens(tokenizer, text: str) -> bool:
    """Whether ``text`` tokenized as usual holds a special token (a string such as ``<|im_end|>`` written in it)."""
    ids, _ = special_tokens(tokenizer)
    return any(i in ids for i in tokenizer(text, add_special_tokens=False)["input_ids"])


def text_ids(tokenizer, text: str) -> list[int]:
    """``text`` read as text: a special-token string in it becomes ordinary tokens."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []


def defused(tokenizer, text: str) -> str:
    """``text`` with every special-token string in it broken by a word joiner (U+2060) after its first character."""
    for special in special_tokens(tokenizer)[1]:
        if special in text:
            text = text.replace(special, special[0] + "\u2060" + special[1:])
    return text


def defused_messages(tokenizer, messages: list[dict]) -> list[dict]:
    """``messages`` with each string content ``defused``."""
    return [{**m, "content": defused(tokenizer, m["content"])} if isinstance(m.get("content"), str) else m
            for m in messages]


def chat_token_ids(tokenizer, messages: list[dict], **template: Any) -> list[int]:
    """Token ids of ``messages`` under the chat template (``template``: apply_chat_template's options) with every
    message's content read as text: a special-token string written in it (``<|im_end|>``, ``<|im_start|>user``) is
    ordinary characters, never the turn boundary it names; only what the template writes is special. Contents
    without such strings give exactly the ids of the rendered text. With them, the template's own text and each
    content are tokenized apart (the content with its special strings split); a template that rewrites contents
    (trims them, drops reasoning) gets them with their special strings broken by a word joiner instead."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template)
    contents = [m.get("content") if isinstance(m.get("content"), str) else None for m in messages]
    if not any(c and has_special_tokens(tokenizer, c) for c in contents):
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    mark = f"\ue000{secrets.token_hex(8)}"  # a private-use mark no content can predict
    marked = [{**m, "content": f"{mark}{i}{mark}"} if c is not None else m
              for i, (m, c) in enumerate(zip(messages, contents))]
    pieces = re.split(f"{mark}(\\d+){mark}", tokenizer.apply_chat_template(marked, tokenize=False, **template))
    ids: list[int] = []
    rebuilt = []
    for k, piece in enumerate(pieces):  # template text, content index, template text, ...
        if k % 2:
            rebuilt.append(contents[int(piece)])
            ids += text_ids(tokenizer, contents[int(piece)])
        else:
            rebuilt.append(piece)
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
    if "".join(rebuilt) == text:
        return ids
    text = tokenizer.apply_chat_template(defused_messages(tokenizer, messages), tokenize=False, **template)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
