"""The client of a served distillation teacher: the log-prob of every token of a sequence the student sampled, from
any vLLM-compatible ``/v1/completions`` that answers ``prompt_logprobs`` (vLLM, rlvr serve).

The request, per completion: ``{"model", "prompt": [prompt ids + completion ids], "max_tokens": 1,
"prompt_logprobs": 0, "temperature": T}``. The answer's ``choices[0].prompt_logprobs`` has one entry per prompt
position: ``null`` for the first (nothing precedes it), then ``{token id (a string): {"logprob", "rank",
"decoded_token"}}`` holding at least the token at that position - entry i is log p(token i | tokens < i), so a
completion of C tokens after P prompt tokens reads entries P .. P + C - 1. vLLM reports raw log-probs (before the
temperature) unless it runs with ``--logprobs-mode processed_logprobs``; rlvr serve applies the request's
temperature. Every value is checked (the sequence's length, the token's id present, a finite log-prob <= 0); a
request that still fails after its retries (timeouts, connection errors, 408, 429, 5xx, a malformed answer) stops
the step with an error naming the server: the student is never trained on a guess.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from rlvr.platform.numbers import finite_float32
from rlvr.rollout.http_client import (
    SMALL_ANSWER_BYTES,
    api_key_from_env,
    error_message,
    printable,
    read_json,
    show,
)
from rlvr.rollout.retry import RetriedPoster, RetryPolicy
from rlvr.rollout.server_errors import MalformedAnswer

CONNECT_TIMEOUT_S = 10.0
BYTES_PER_TOKEN = 512  # an entry with the actual token (and a top-1 beside it) is ~150 bytes
TOLERANCE = 1e-4  # a log-prob above 0 by more than rounding is not one


class TeacherError(RuntimeError):
    pass


def base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"distill.url {printable(url, 100)!r} must be http(s)://HOST[:PORT][/PATH]")
    return url.rstrip("/").removesuffix("/v1")


def token_logprobs(body: object, prompt_len: int, completion: list[int]) -> list[float]:
    """The completion's log-probs from a /v1/completions answer with prompt_logprobs; ``MalformedAnswer`` if off."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise MalformedAnswer("an answer without exactly one choice")
    entries = choices[0].get("prompt_logprobs")
    if not isinstance(entries, list) or len(entries) != prompt_len + len(completion):
        got = len(entries) if isinstance(entries, list) else "no list of"
        raise MalformedAnswer(f"{got} prompt_logprobs entries for a sequence of {prompt_len + len(completion)} "
                              "tokens (does the server answer prompt_logprobs?)")
    out = []
    for t, token in enumerate(completion):
        entry = entries[prompt_len + t]
        item = entry.get(str(token)) if isinstance(entry, dict) else None
        value = finite_float32(item.get("logprob")) if isinstance(item, dict) else None
        if value is None or value > TOLERANCE:  # -1e300: finite in JSON, -inf in the trainer's float32
            raise MalformedAnswer(f"no log-prob <= 0 finite in float32 for token {token} at completion position {t}: "
                                  f"{show(item)}")
        out.append(min(value, 0.0))
    return out


class TeacherClient:
    """Scores sequences on the teacher server, ``threads`` requests in flight at once."""

    def __init__(self, url: str, model: str, api_key_env: str, timeout_s: float, threads: int = 8,
                 policy: RetryPolicy | None = None):
        self.url, self.model, self.timeout_s = base_url(url), model, timeout_s
        self.poster = RetriedPoster(policy or RetryPolicy(errors=(httpx.TransportError, MalformedAnswer)),
                                    api_key_from_env(api_key_env), CONNECT_TIMEOUT_S, threads, "rlvr-teacher")

    def model_name(self) -> str:
        """The served model's name (asked of /v1/models once, when not given); starts the HTTP client."""
        http = self.poster.http()
        if not self.model:
            r = http.request("GET", self.url + "/v1/models", timeout_s=self.timeout_s,
                                           max_bytes=SMALL_ANSWER_BYTES)
            body = read_json(r) if r.status_code == 200 else None
            data = body.get("data") if isinstance(body, dict) else None
            first = data[0] if isinstance(data, list) and data else None
            if not (isinstance(first, dict) and isinstance(first.get("id"), str)):
                raise TeacherError(f"distill.url {self.url}: GET /v1/models answered {r.status_code} without a model "
                                   "id; set distill.model")
            self.model = first["id"]
        return self.model

    def _score(self, ids: list[int], temperature: float, parse) -> tuple[object, str]:
        """(the parsed answer, '') for scoring ``ids``, or (None, why it failed) after the retries."""
        body = {"model": self.model_name(), "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": temperature}
        outcome = self.poster.post(self.url + "/v1/completions", body, timeout_s=self.timeout_s,
                                   max_bytes=SMALL_ANSWER_BYTES + BYTES_PER_TOKEN * len(ids), parse=parse)
        last = outcome.last
        if last.ok:
            return last.value, ""
        why = (f"{type(last.error).__name__}: {printable(str(last.error))}" if last.error is not None else
               f"{last.response.status_code} {error_message(last.response)}")
        return None, f"{why} after {outcome.attempts} attempt(s)"

    def _one(self, sequence: tuple[list[int], list[int], float]) -> list[float]:
        prompt, completion, temperature = sequence
        value, why = self._score(prompt + completion, temperature,
                                 lambda answer: token_logprobs(answer, len(prompt), completion))
        if why:
            raise TeacherError(f"the teacher at {self.url} did not score a completion: {why}")
        return value  # type: ignore[return-value]

    def score(self, sequences: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """Per (prompt ids, completion ids, temperature): the completion tokens' log-probs under the teacher."""
        self.model_name()
        return self.poster.map(self._one, sequences)

    def check_tokens(self, student: str) -> None:
        """Refuse a teacher whose tokenizer differs from the student's, in one line: a probe of the student's chat
        template, some text and 64 ids spread over the student's whole vocabulary (its last one included) is scored,
        and the server must take every id and decode each as the student does."""
        from rlvr.models.policy import load_tokenizer, resolve_model_dir

        tokenizer = load_tokenizer(resolve_model_dir(student))
        text = "Distillation probe: 12 + 30 = 42, with tabs\tand newlines\n"
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"},
                                                  {"role": "assistant", "content": text}], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += [round(i * (len(tokenizer) - 1) / 63) for i in range(64)]
        value, why = self._score(ids, 1.0, None)
        if why:
            raise TeacherError(f"the teacher at {self.url} refused a prompt_logprobs probe of the student's token ids "
                               f"({why}): its vocabulary differs from the student's, or it does not serve "
                               "prompt_logprobs")
        choices = value.get("choices") if isinstance(value, dict) else None
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        entries = first.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise TeacherError(f"the teacher at {self.url} answered the probe without one prompt_logprobs entry per "
                               "token: it does not serve prompt_logprobs, or tokenizes token ids differently")
        for position, (token, entry) in enumerate(zip(ids[1:], entries[1:]), start=1):
            item = entry.get(str(token)) if isinstance(entry, dict) else None
            decoded = item.get("decoded_token") if isinstance(item, dict) else None
            ours = tokenizer.decode([token])
            if "\ufffd" in ours:  # a piece of a UTF-8 character: servers render its bytes their own way
                continue
            if decoded is not None and decoded != ours:
                raise TeacherError(f"the teacher at {self.url} reads token {token} as {show(decoded)}, the student as "
                                   f"{show(ours)}: its tokenizer differs (position {position}); rlvr distils between "
                                   "models of one tokenizer")

    def close(self) -> None:
        self.poster.close()
