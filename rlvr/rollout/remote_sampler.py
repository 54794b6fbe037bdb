"""The Sampler over a server pool: generation on rollout servers over HTTP (``rlvr serve`` or vLLM, unchanged),
the trainer's adapter published to a bucket and loaded on every server at each sync."""

from __future__ import annotations

from collections.abc import Callable

from rlvr.models.prompts import Prompt, prompt_token_ids
from rlvr.platform.numbers import finite_float32
from rlvr.platform.seeds import request_seed, turn_seed
from rlvr.rollout.engine import SamplingParams
from rlvr.rollout.episodes import Environment, EpisodeBatch, EpisodeLimits, Turn, TurnSampler, run_episodes
from rlvr.rollout.groups import Groups, eos_token_ids
from rlvr.rollout.http_client import read_json
from rlvr.rollout.pool import ServerPool
from rlvr.rollout.server_answers import (
    ServerChoice,
    choices_to_ask,
    groups_of,
    parse_completions,
    parse_group,
)
from rlvr.rollout.server_errors import MalformedAnswer
from rlvr.store.bucket import AdapterBucket


def vocab_size(model, tokenizer) -> int:
    """Token ids the trainer can take: the rows of the model's input embedding (the tokenizer's length if the
    model has none)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(getattr(embedding, "num_embeddings", 0) or len(tokenizer))


def served_turns(generate: Callable[[list[list[int]], list[int]], list[list[ServerChoice]]], seed: int, first: int,
                 group_size: int) -> TurnSampler:
    """Model turns for ``run_episodes`` from a server-style engine: ``generate(contexts, seeds)`` answers one
    validated choice per context; turn t of episode i (its place in the batch, ``first`` prompts in) is seeded
    ``turn_seed(seed, first * group_size + i, t)``, whichever engine runs it."""
    turn = [0]

    def turns(contexts: list[list[int]], episodes: list[int]) -> list[Turn]:
        seeds = [turn_seed(seed, first * group_size + i, turn[0]) for i in episodes]
        turn[0] += 1
        return [Turn(a[0].token_ids, a[0].logprobs, a[0].truncated) for a in generate(contexts, seeds)]

    return turns


class RemoteSampler:
    """The Sampler over a server pool. ``sync(v)`` publishes the trainer's LoRA adapter as version v to the
    bucket, loads it on every server as ``{prefix}-v{v}`` (each version its own name, since servers key their
    prefix caches by adapter name), and unloads versions older than the last ``keep_versions``."""

    def __init__(self, pool: ServerPool, tokenizer, model, bucket: AdapterBucket, *, keep_versions: int = 2,
                 prefix: str = "policy", version: int = 0):
        self.pool, self.tokenizer, self.model, self.bucket = pool, tokenizer, model, bucket
        self.keep_versions, self.prefix, self.version = max(keep_versions, 1), prefix, version
        self.vocab_size = vocab_size(model, tokenizer)
        self.last_sync: dict[str, float] = {}

    def adapter_name(self, version: int) -> str:
        return f"{self.prefix}-v{version}"

    def sync(self, version: int) -> None:
        published = self.bucket.publish_adapter(self.model, version)
        load_s = self.pool.load_adapter(self.adapter_name(version), published.url)
        self.version = version
        for old in [n for n in self.pool.adapters if n.startswith(f"{self.prefix}-v")]:
            if int(old.rsplit("-v", 1)[1]) <= version - self.keep_versions:
                self.pool.unload_adapter(old)
        self.bucket.gc(self.keep_versions)
        self.last_sync = {"adapter_bytes": published.bytes, "publish_s": published.seconds, "load_s": load_s}

    def busy_seconds(self) -> dict[str, float]:
        """Seconds each live `rlvr serve` has spent generating (from its /stats; other engines are left out)."""
        out = {}
        for server in self.pool.live():
            r = self.pool.get(f"{server.url}/stats")
            if r is None or r.status_code != 200:
                continue
            try:
                busy = read_json(r).get("busy_s")
            except (MalformedAnswer, AttributeError):
                continue
            busy = finite_float32(busy)  # a 401-digit integer is refused, not an OverflowError
            if busy is not None and busy >= 0:
                out[server.url] = busy
        return out

    def stats(self) -> dict[str, float]:
        s = self.pool.stats
        return {**self.last_sync, "servers_live": len(self.pool.live()), "requests": s.requests,
                "requests_retried": s.retries, "servers_lost": s.servers_lost, "servers_revived": s.servers_revived,
                "answers_rejected": s.answers_rejected, "answers_busy": s.answers_busy}

    def close(self) -> None:
        self.pool.close()

    def _body(self, ids: list[int], n: int, params: SamplingParams, seed: int, version: int) -> dict:
        body = {"model": self.adapter_name(version), "prompt": ids, "n": n, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "seed": seed, "logprobs": 0,
                "return_token_ids": True, "include_stop_str_in_output": True, "skip_special_tokens": True}
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    def sample_episodes(self, prompt_ids: list[list[int]], envs: list[Environment], group_size: int,
                        params: SamplingParams, seed: int, limits: EpisodeLimits, first: int = 0) -> EpisodeBatch:
        """Episodes driven from here: each model turn is one stateless /v1/completions request whose prompt is the
        episode's token ids so far (n = 1, its own seed), sent to any live server; a server lost mid-episode only
        moves the next turn to another one, which has the same adapter version."""
        version = self.version

        def parse(answer: object) -> list[ServerChoice]:
            return parse_completions(answer, 1, params.max_new_tokens, self.vocab_size)

        def generate(contexts: list[list[int]], seeds: list[int]) -> list[list[ServerChoice]]:
            bodies = [self._body(ids, 1, params, s, version) for ids, s in zip(contexts, seeds)]
            return self.pool.post_many("/v1/completions", bodies, [params.max_new_tokens] * len(bodies),
                                       [parse] * len(bodies))

        return run_episodes(served_turns(generate, seed, first, group_size), self.tokenizer, prompt_ids, envs,
                            group_size, params, limits, eos_token_ids(self.model, self.tokenizer), version)

    def sample(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int,
               first: int = 0) -> Groups:
        """Greedy decoding asks each server for one choice and repeats it ``group_size`` times: vLLM refuses n > 1
        without sampling (the n would be equal)."""
        prompt_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        version, n = self.version, choices_to_ask(group_size, params.temperature)
        bodies = [self._body(ids, n, params, request_seed(seed, first + i), version)
                  for i, ids in enumerate(prompt_ids)]

        def parse(answer: object) -> list[ServerChoice]:
            return parse_group(answer, group_size, params.temperature, params.max_new_tokens, self.vocab_size)

        answers = self.pool.post_many("/v1/completions", bodies, [n * params.max_new_tokens] * len(bodies),
                                      [parse] * len(bodies))
        return groups_of(answers, prompt_ids, group_size, self.tokenizer, version, params.temperature)
