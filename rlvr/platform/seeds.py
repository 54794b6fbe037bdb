"""Every seed rlvr derives, by name, in one place.

A run has one integer seed (train.seed). Everything random in a step - which rows, which tokens - is drawn from
a seed computed here from it and a position (a step, a round, a data position, a prompt in a request), so a
resumed run repeats the uninterrupted one and two different positions never share a stream. The constants are
distinct primes; changing one changes every sampled run, so they are fixed.
"""

from __future__ import annotations

_STEP = 1_000_003  # also the async runtime's per-data-position stride: a step and a position never collide in a run
_ROUND = 1_000_000_007
_EPOCH = 100_003
_REQUEST = 1_000_033
_REQUEST_PROMPT = 7_919
_CHOICE = 1_009


def step_seed(seed: int, step: int) -> int:
    """Sampling seed of a synchronous step (its first round)."""
    return seed * _STEP + step


def round_seed(first: int, k: int) -> int:
    """Sampling seed of extra round ``k`` of a step whose first round used ``first`` (dynamic sampling)."""
    return first + k * _ROUND


def group_seed(seed: int, uid: int) -> int:
    """Sampling seed of the group at data position ``uid`` (asynchronous runs sample one group at a time)."""
    return seed * _STEP + uid


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of the permutation that orders the training rows in ``epoch``."""
    return seed * _EPOCH + epoch


def request_seed(seed: int, prompt: int) -> int:
    """A rollout request's seed from its batch's seed and the prompt's position (distinct for nearby steps)."""
    return (seed * _REQUEST + prompt * _REQUEST_PROMPT) % (2**31 - 1)


def completion_seed(seed: int, prompt: int, choice: int) -> int:
    """A served completion's seed from its request's seed, its prompt and its choice index (rlvr serve)."""
    return ((seed * _STEP + prompt) * _CHOICE + choice) % (1 << 63)


def episode_seed(seed: int, episode: int) -> int:
    """Seed of episode ``episode`` (its position in the batch) of a batch sampled with ``seed``: every model turn
    of the episode draws from it (in process: one generator; on servers: ``turn_seed``)."""
    return request_seed(seed, episode)


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """A served model turn's seed: turn ``turn`` of episode ``episode`` of a batch sampled with ``seed``."""
    return completion_seed(seed, episode, turn) % (2**31 - 1)
