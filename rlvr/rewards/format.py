"""Format rewards: does the completion have the shape we ask for?"""

from __future__ import annotations

import re

from rlvr.rewards.base import RewardFn, completion_text

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_match(pattern: str = THINK_ANSWER) -> RewardFn:
    """1.0 when the whole (stripped) completion matches ``pattern`` (DOTALL), else 0.0.

    The default is the reasoning-then-answer layout ``<think>...</think><answer>...</answer>``.
    """
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(prompts, completions, **columns) -> list[float | None]:
        return [1.0 if regex.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]

    return format_reward


def tool_success() -> RewardFn:
    """For episodes (multi-turn completions): 1.0 when at least one tool call returned a result, 0.0 when every
    call failed (an ``error:`` result: malformed, unknown tool, bad arguments, an exception, a timeout) or the model
    called none. A shaping reward for teaching a model to use its tools: weigh it well below the correctness
    reward, which it does not replace (a call with any valid arguments earns it). Single completions score 0.0."""

    def tool_success_reward(prompts, completions, **columns) -> list[float | None]:
        return [1.0 if not isinstance(c, str) and any(
            m.get("role") == "tool" and not str(m.get("content", "")).startswith("error:") for m in c) else 0.0
            for c in completions]

    return tool_success_reward


# A reply that treats the message as a text to review or rewrite ("Your message conveys...", "Here's a refined
# version"), not as something its writer said.
REVIEW = (r"\b(here'?s|here is|below is)\b[^.!?\n]{0,40}\b(version|rewrite|revision|edit)\b"
          r"|\b(revised|refined|edited|rewritten|polished|condensed|improved|corrected) (version|response|reply|text"
          r"|message|completion|draft)\b"
          r"|\b(improved|better|correct) (grammar|style|clarity|wording)\b"
          r"|\bthe original (message|text|post|response|prompt)\b"
          r"|\b(your|this|the) (message|response|reply|post|text|passage|writing|narrative|prompt|completion)"
          r" (is|was|provides|conveys|shows|has|reads|offers|demonstrates|effectively|captures|highlights)\b")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")


def sentences(text: str) -> int:
    """Sentences in ``text``: runs of words ended by . ! or ? (or the end of the text)."""
    parts = _SENTENCE_END.split(text.strip())
    return sum(1 for p in parts if re.search(r"\w", p))


def _words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.casefold())


def copies(reply: str, message: str, run: int) -> bool:
    """``reply`` repeats ``run`` or more consecutive words of ``message`` (an echo, or a rewrite that quotes it)."""
    said = _words(message)
    grams = {tuple(said[i:i + run]) for i in range(len(said) - run + 1)}
    words = _words(reply)
    return any(tuple(words[i:i + run]) in grams for i in range(len(words) - run + 1))


def reply_form(max_sentences: int = 2, max_tokens: int = 0, reviews: bool = True, copy_words: int = 0) -> RewardFn:
    """1.0 when a completion has the form of a reply, else 0.0: at most ``max_sentences`` sentences (0: any), fewer
    than ``max_tokens`` tokens when that is set (rollout.max_new_tokens: a reply cut at the limit was not finished),
    with ``reviews`` no sentence that treats the message as a text to review or rewrite (``REVIEW``), and with
    ``copy_words`` no run of that many consecutive words of the message (an echo). A cheap, verifiable term to mix
    with a judge that rewards the words of such replies (docs/concepts/judges.md)."""
    if max_sentences < 0 or max_tokens < 0 or copy_words < 0:
        raise ValueError(f"reply_form: max_sentences, max_tokens and copy_words are >= 0; got {max_sentences}, "
                         f"{max_tokens}, {copy_words}")
    review = re.compile(REVIEW, re.IGNORECASE)

    def reply_form_reward(prompts, completions, completion_ids=None, **columns) -> list[float | None]:
        from rlvr.rewards.judge import prompt_text

        out = []
        for i, (p, c) in enumerate(zip(prompts, completions)):
            text = completion_text(c).replace("\u2019", "'")
            ok = not max_sentences or sentences(text) <= max_sentences
            ok = ok and not (max_tokens and completion_ids is not None and len(completion_ids[i]) >= max_tokens)
            ok = ok and not (reviews and review.search(text))
            ok = ok and not (copy_words and copies(text, prompt_text(p), copy_words))
            out.append(1.0 if ok else 0.0)
        return out

    return reply_form_reward


# A reply that declines the request ("I'm sorry, but I can't help with that", "As an AI, I cannot ...").
REFUSAL = (r"\b(i('m| am) (sorry|afraid),? but i (can(no|')t|won't|am unable|'m unable|'m not able))"
           r"|\bi (can(no|')t|won't|am unable to|'m unable to|'m not able to|am not able to) (help|assist|provide|"
           r"answer|comply|do that|fulfil|fulfill|respond|engage)"
           r"|\bas an ai\b")


def refusal() -> RewardFn:
    """1.0 when a completion declines the request (``REFUSAL``: "I'm sorry, but I can't...", "As an AI..."), else
    0.0: a rate to watch in evaluation (eval/refusal_frac), or a penalty with a negative weight."""
    pattern = re.compile(REFUSAL, re.IGNORECASE)

    def refusal_reward(prompts, completions, **columns) -> list[float | None]:
        return [1.0 if pattern.search(completion_text(c).replace("\u2019", "'")) else 0.0 for c in completions]

    return refusal_reward
