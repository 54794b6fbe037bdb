"""The reward-function protocol and how several functions combine.

A reward function has TRL's signature::

    f(prompts, completions, **columns) -> list[float | None]

``prompts`` are the dataset prompts (a string or a list of chat messages), ``completions`` the sampled
answers - plain strings for string prompts, ``[{"role": "assistant", "content": text}]`` for chat prompts,
as TRL passes them - and ``columns`` every other dataset column (one value per completion) plus
``completion_ids`` (lists of token ids). As TRL 1.x does, a function that takes them (by name, or ``**kwargs``)
also gets ``trainer_state`` (``TrainerState``: global_step, max_steps, epoch), ``log_metric(name, value)`` (a
scalar averaged over the step, logged as ``reward_log/NAME``) and ``log_extra(column, values)`` (accepted; rlvr
keeps no completions table, samples.jsonl has each function's values). A TRL reward function therefore works
unchanged, unless it returns NaN for "no score" (TRL ignores NaN; rlvr refuses it, below: return None instead).

Combination policy: the total is the weighted sum of the values that are present. ``None`` means "this
function does not apply to / could not score this completion" and contributes nothing; a completion that no
function scored has no reward (NaN in ``Scores.total``) and is excluded from the update. Missing values are
counted per function in the metrics. A batch in which no completion has a reward trains nothing:
``Scores.unscored_warning()`` says so, naming the functions, for the caller to print.

Failure policy, per function (``on_error``):
- a function that raises or exceeds ``timeout_s``: ``"raise"`` (default) stops with an error naming the
  function; ``"none"`` scores the whole batch None for that function and records the error. A
  ``RewardConfigError`` (a judge's or reward model's endpoint answering 401, 403 or 404) stops the run either way.
- a wrong number of values is always an error naming the function (a silent misalignment would train
  on other completions' rewards); a value that is not a real number or None is an error too, and so is a
  non-finite one: inf and NaN are refused with an error naming the function and the index. A function
  says "does not apply" with None, never with NaN (read as None, a NaN everywhere would train nothing without a
  word). Numbers of any real type (int, float, numpy
  scalars, one-element tensors) are accepted.
- ``check_rewards`` calls every function once on a few rows with placeholder completions, so these errors
  come before a run spends minutes on its first evaluation.
A timed-out function cannot be killed from Python: it is abandoned in a daemon thread, which may keep
a core busy. Untrusted or hang-prone checks belong in the process-isolated verifiers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from rlvr.platform.numbers import finite_float32

RewardFn = Callable[..., list]
ON_ERROR = ("raise", "none")


@dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float = 1.0
    on_error: str = "raise"  # "raise" or "none" (see module docstring)
    timeout_s: float = 0.0  # 0: no limit


class RewardError(RuntimeError):
    pass


class RewardConfigError(RewardError):
    """A reward's endpoint refused the run's configuration (401, 403, 404: a wrong key, model name or URL): every
    call would fail the same way, so it stops the run under every ``on_error``."""


@dataclass
class TrainerState:
    """TRL's ``trainer_state`` as reward functions read it (transformers' TrainerState names): optimizer steps taken
    so far, the run's total, and epochs of the training rows drawn; ``log_history`` holds the logged steps (filled
    by GRPOTrainer after training)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict] = field(default_factory=list)


class RewardLog:
    """What reward functions log through TRL's ``log_metric`` (finite numbers, averaged per step) and ``log_extra``
    (accepted, not kept)."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def log_metric(self, name: str, value: float) -> None:
        finite = finite_float32(value)
        if not isinstance(name, str) or not name or finite is None:
            raise ValueError(f"log_metric({str(name)[:80]!r}, {str(value)[:40]}): give a metric name and a finite "
                             "number")
        with self._lock:
            self._values.setdefault(name, []).append(finite)

    def log_extra(self, column: str, values: list) -> None:
        pass

    def drain(self) -> dict[str, float]:
        """The mean of each metric logged since the last drain."""
        with self._lock:
            values, self._values = self._values, {}
        return {name: sum(v) / len(v) for name, v in values.items()}


@dataclass
class RewardContext:
    """The TRL arguments every scoring passes (``trl_arguments``); the loop keeps ``state`` current."""

    state: TrainerState = field(default_factory=TrainerState)
    log: RewardLog = field(default_factory=RewardLog)


CONTEXT = RewardContext()  # the training loop's (rlvr/run/loop.py); one run per process
TRL_ARGUMENTS = ("trainer_state", "log_metric", "log_extra")


@contextlib.contextmanager
def evaluation_context(global_step: int, max_steps: int, epoch: float) -> Iterator[RewardLog]:
    """Score held-out replies: the rewards see the state after the step just taken (as TRL's evaluation does) and
    log into a log of the evaluation's own, yielded (not into the next training step's metrics)."""
    global CONTEXT
    kept = CONTEXT
    state = dataclasses.replace(kept.state, global_step=global_step, max_steps=max_steps, epoch=epoch)
    CONTEXT = RewardContext(state, RewardLog())
    try:
        yield CONTEXT.log
    finally:
        CONTEXT = kept


@contextlib.contextmanager
def scratch_context() -> Iterator[None]:
    """Score with a throwaway state and log (check_rewards' placeholder calls log nothing into the run)."""
    global CONTEXT
    kept, CONTEXT = CONTEXT, RewardContext()
    try:
        yield
    finally:
        CONTEXT = kept


def trl_arguments(fn: Callable, group_size: int | None = None) -> dict[str, Any]:
    """TRL's trainer_state, log_metric and log_extra for a function that takes them (by name or **kwargs), and
    rlvr's ``group_size`` (G: completions i*G .. i*G+G-1 answer one prompt) for one that names it (a group judge)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    named = {p.name for p in parameters}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        wanted = set(TRL_ARGUMENTS)
    else:
        wanted = named & set(TRL_ARGUMENTS)
    given = {"trainer_state": CONTEXT.state, "log_metric": CONTEXT.log.log_metric, "log_extra": CONTEXT.log.log_extra}
    out = {k: v for k, v in given.items() if k in wanted}
    if group_size and "group_size" in named:
        out["group_size"] = group_size
    return out


class Scores(NamedTuple):
    total: torch.Tensor  # [N] float32, NaN where no function scored
    per_function: dict[str, torch.Tensor]  # name -> [N] float32, NaN = None (unweighted)
    errors: dict[str, str]  # name -> what went wrong, for functions contained under on_error="none"
    weights: dict[str, float] | None = None  # name -> its weight in ``total`` (None: all 1)

    def weight_vector(self) -> torch.Tensor:
        """[K] the weights of ``per_function``'s columns, in its order."""
        return torch.tensor([(self.weights or {}).get(k, 1.0) for k in self.per_function], dtype=torch.float64,
                            device="cpu")

    def select(self, rows: torch.Tensor) -> Scores:
        """The scores of completions ``rows`` (an index tensor)."""
        return Scores(self.total[rows], {k: v[rows] for k, v in self.per_function.items()}, self.errors, self.weights)

    @staticmethod
    def concat(parts: list[Scores]) -> Scores:
        """Scores of several batches of completions, in order (the same reward functions in each)."""
        per_function = {k: torch.cat([p.per_function[k] for p in parts]) for k in parts[0].per_function}
        errors = {k: v for p in parts for k, v in p.errors.items()}
        return Scores(torch.cat([p.total for p in parts]), per_function, errors, parts[0].weights)

    def unscored_warning(self) -> str | None:
        """A one-line message when no completion has a reward (every function returned None, or was contained
        under on_error: none, for every completion, so the batch trains nothing), naming the functions; None
        when at least one completion has a reward, or there are no completions."""
        n = self.total.numel()
        if n == 0 or not bool(torch.isnan(self.total).all()):
            return None
        names = ", ".join(repr(k) for k in self.per_function)
        failed = "; ".join(f"{k} failed ({v}) and was scored None (on_error: none)" for k, v in self.errors.items())
        return (f"no completion of this batch has a reward: the reward functions ({names}) returned None for all "
                f"{n} completions, so it trains nothing" + (f"; {failed}" if failed else "")
                + ". Check that they read the right columns and the completions' format (a function returns None "
                "only where it does not apply)")


def completion_text(completion: Any) -> str:
    """The text of a completion in either TRL format (string, or list of chat messages). A multi-turn completion
    (an episode: assistant turns with ``tool`` results between them) is its last assistant turn, the final answer:
    a tool's output is never read as the model's answer."""
    if isinstance(completion, str):
        return completion
    if any(m.get("role") == "tool" for m in completion):
        answers = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
        return answers[-1] if answers else ""
    return "".join(m.get("content", "") for m in completion)


def plain_text(prompt: Any, text: str) -> str:
    """A prompt and a completion's text as one plain text (no chat template): a chat prompt's contents joined by
    newlines, then the completion (what a reward model without a chat template scores)."""
    head = prompt if isinstance(prompt, str) else "\n".join(str(m.get("content") or "") for m in prompt)
    return head + text


def as_completions(prompts: list, texts: list[str]) -> list:
    """Completions in TRL's convention: plain text for string prompts, chat messages for chat prompts."""
    return [t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(prompts, texts)]


def _as_float(value: Any, name: str, index: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward function {name!r} returned {type(value).__name__} at index {index}; expected a float or None"
        )
    finite = finite_float32(value)  # 1e300 is inf in the float32 rewards; 10**400 has no float at all
    if finite is None:
        plain = isinstance(value, float) and not math.isfinite(value)  # nan, inf: nothing to add
        shown = str(value)[:40] + ("" if plain else " (not finite in float32)")
        raise RewardError(
            f"reward function {name!r} returned {shown} at index {index}; rewards must be finite or None "
            "(return None where the function does not apply to a completion)"
        )
    return finite


def _call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    if timeout_s <= 0:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 (handed to the caller's thread)
            box["error"] = err

    worker = threading.Thread(target=run, daemon=True, name="rlvr-reward")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"did not return within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def score_completions(
    rewards: Sequence[WeightedReward],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    group_size: int | None = None,
) -> Scores:
    """Run every reward function once over the batch and combine the values (see the module docstring);
    ``group_size``: G when the completions come as whole groups (given to a function that names it)."""
    n = len(completions)
    per_fn: dict[str, torch.Tensor] = {}
    errors: dict[str, str] = {}
    total = torch.zeros(n, dtype=torch.float64)
    scored = torch.zeros(n, dtype=torch.bool)
    for reward in rewards:
        trl = trl_arguments(reward.fn, group_size)
        call = lambda reward=reward, trl=trl: reward.fn(prompts=prompts, completions=completions, **columns, **trl)
        try:
            values = _call_with_timeout(call, reward.timeout_s)
        except RewardConfigError:
            raise  # the run's configuration: on_error none would train on with no signal from it
        except Exception as err:
            what = f"{type(err).__name__}: {err}"
            if reward.on_error != "none":
                raise RewardError(
                    f"reward function {reward.name!r} failed ({what}); fix it, or set on_error: none for it to "
                    "score such batches as None"
                ) from err
            errors[reward.name] = what
            values = [None] * n
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(
                f"reward function {reward.name!r} returned {got} values for {n} completions; "
                f"it must return a list of {n}"
            )
        v = torch.tensor([_as_float(x, reward.name, i) for i, x in enumerate(values)], dtype=torch.float64)
        per_fn[reward.name] = v.float()
        present = ~torch.isnan(v)
        total += torch.where(present, reward.weight * v, torch.zeros_like(v))
        scored |= present
    total = torch.where(scored, total, torch.full_like(total, math.nan))
    return Scores(total.float(), per_fn, errors, {reward.name: reward.weight for reward in rewards})


PLACEHOLDERS = ("", "0")  # the completions check_rewards scores: an empty answer and a bare number


def check_rewards(
    rewards: Sequence[WeightedReward], rows: Sequence[dict], n: int = 2, placeholders: Sequence[str] = PLACEHOLDERS,
    environments: Callable[[dict], Any] | None = None,
) -> Scores:
    """Call every reward function once, the way training does, on the first ``n`` rows with placeholder
    completions, so a function that raises (a missing column, a bad kwarg), returns the wrong number of values, a
    string, inf or NaN fails in seconds with the same ``RewardError`` as in training, before any evaluation.

    Each row gets one completion per placeholder, in the row's prompt format (plain text for a string prompt,
    chat messages for a chat prompt: ``as_completions``), with the row's other columns (one value per completion,
    as ``rlvr.tasks.reward_columns`` passes them) and fake ``completion_ids`` (one token per character, plus one).
    The values themselves are not judged: a correctness reward scores a placeholder 0 or None. Functions under
    on_error: none are contained as in training (their errors are in the returned ``Scores.errors``). Returns
    the scores of the ``n * len(placeholders)`` completions."""
    rows = list(rows[:n])
    prompts = [row["prompt"] for row in rows for _ in placeholders]
    texts = [t for _ in rows for t in placeholders]
    names = sorted({k for row in rows for k in row if k != "prompt"})
    columns: dict[str, list] = {}
    for name in names:
        for i, row in enumerate(rows):
            if name not in row:
                raise KeyError(f"dataset row {i} ({row['prompt']!r:.80}) has no column {name!r} that other rows have")
        columns[name] = [row[name] for row in rows for _ in placeholders]
    columns["completion_ids"] = [[0] * (len(t) + 1) for t in texts]
    if environments is not None:  # an episode run: reward functions also get the environments (as TRL passes them)
        columns["environments"] = [environments(row) for row in rows for _ in placeholders]
    try:
        with scratch_context():
            return score_completions(rewards, prompts, as_completions(prompts, texts), columns, len(placeholders))
    except RewardError as err:
        shown = ", ".join(repr(t) for t in placeholders)
        raise RewardError(f"{err} (found before training: each function was called once on {len(rows)} training "
                          f"rows with the placeholder completions {shown})") from err
