"""Is the run gaming its reward? Seen from held-out evaluations: a reward the run trains on rose while a measure it
never trains on fell (a judge's score up, an independent judge's "does it answer" down). The check compares each
evaluation with the first one (before training, when eval.on_start); what it finds names the two measures, their
values then and now, and the held-out replies whose trained reward rose the most."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlvr.platform.numbers import is_finite_float32

EXAMPLES = 3  # replies shown with an alarm
SHOWN_CHARS = 300  # of each reply and prompt


@dataclass(frozen=True)
class Alarm:
    step: int
    reward: str  # eval/reward/NAME: a trained reward, on the held-out replies
    reward_then: float
    reward_now: float
    measure: str  # eval/metric/NAME or eval/accuracy: never trained on
    measure_then: float
    measure_now: float
    examples: tuple[dict, ...]  # {"prompt", "then", "now", "reward_then", "reward_now", "measure_then", "measure_now"}

    def line(self) -> str:
        return (f"the run may be gaming its reward: on the held-out prompts {self.reward} rose "
                f"{self.reward_then:.3g} -> {self.reward_now:.3g} while {self.measure}, which it does not train on, "
                f"fell {self.measure_then:.3g} -> {self.measure_now:.3g} (step {self.step}); read the replies whose "
                "reward rose most (summary.json: gaming) before trusting the reward")

    def as_dict(self) -> dict:
        return asdict(self)


def measures(rewards: list, eval_metrics: list, eval_reward: str, watched: tuple[str, ...] = ()
             ) -> tuple[list[str], list[str]]:
    """(trained, independent): the held-out measures of the rewards the run trains on (weight > 0; only those named in
    ``watched`` when it is given), and of what it does not train on - eval.metrics, weight-0 rewards, and accuracy
    when task.eval_reward is not a trained reward."""
    weights = {r.name: r.weight for r in rewards}
    trained = [f"eval/reward/{r.name}" for r in rewards if r.weight > 0 and (not watched or r.name in watched)]
    independent = [f"eval/metric/{r.name}" for r in eval_metrics]
    independent += [f"eval/reward/{r.name}" for r in rewards if r.weight == 0]
    if not weights.get(eval_reward):
        independent.append("eval/accuracy")
    return trained, independent


def gaming_alarm(step: int, then: dict, now: dict, trained: list[str], independent: list[str], rise: float,
                 fall: float) -> Alarm | None:
    """An alarm when some ``trained`` measure rose by at least ``rise`` from evaluation ``then`` to ``now`` while
    some ``independent`` one fell by at least ``fall`` (the largest rise and the largest fall are named); None
    otherwise. ``then`` and ``now``: ``{"metrics": {name: value}, "replies": [{"prompt", "reply", "scores"}]}``,
    the replies in the same row order (the held-out rows)."""
    def change(name: str) -> float | None:
        a, b = then["metrics"].get(name), now["metrics"].get(name)
        return None if a is None or b is None else b - a

    rises = [(d, n) for n in trained if (d := change(n)) is not None and d >= rise]
    falls = [(-d, n) for n in independent if (d := change(n)) is not None and -d >= fall]
    if not rises or not falls:
        return None
    reward, measure = max(rises)[1], max(falls)[1]
    return Alarm(step, reward, then["metrics"][reward], now["metrics"][reward], measure, then["metrics"][measure],
                 now["metrics"][measure], _examples(then["replies"], now["replies"], reward, measure))


def _examples(then: list[dict], now: list[dict], reward: str, measure: str) -> tuple[dict, ...]:
    """The held-out rows whose ``reward`` rose most, with their replies then and now."""
    r_key, m_key = reward.removeprefix("eval/"), measure.removeprefix("eval/")
    m_key = "check" if m_key == "accuracy" else m_key
    rows = []
    for a, b in zip(then, now):
        ra, rb = a["scores"].get(r_key), b["scores"].get(r_key)
        if ra is not None and rb is not None:
            rows.append((rb - ra, a, b))
    rows.sort(key=lambda t: -t[0])
    return tuple({"prompt": _shown(b["prompt"]), "then": _shown(a["reply"]), "now": _shown(b["reply"]),
                  "reward_then": a["scores"][r_key], "reward_now": b["scores"][r_key],
                  "measure_then": a["scores"].get(m_key), "measure_now": b["scores"].get(m_key)}
                 for _, a, b in rows[:EXAMPLES])


def _shown(value: object) -> str:
    if isinstance(value, list):  # chat messages: the last one's content
        value = value[-1].get("content", "") if value and isinstance(value[-1], dict) else ""
    return str(value)[:SHOWN_CHARS]


def evaluation_record(step: int, metrics: dict, replies: list[dict], names: list[str]) -> dict:
    """What the check keeps of an evaluation: ``names``' values in ``metrics`` and each reply's prompt (as shown),
    text and scores."""
    return {"step": step, "metrics": {k: float(metrics[k]) for k in names if k in metrics},
            "replies": [{"prompt": _shown(r["prompt"]), "reply": _shown(r["reply"]), "scores": r["scores"]}
                        for r in replies]}


def valid_record(value: object) -> bool:
    """``evaluation_record``'s shape (a checkpoint's state.json is untrusted): a step, finite metrics, replies with
    text and finite-or-null scores."""
    if not (isinstance(value, dict) and type(value.get("step")) is int and isinstance(value.get("metrics"), dict)
            and isinstance(value.get("replies"), list)):
        return False
    if not all(isinstance(k, str) and is_finite_float32(v) for k, v in value["metrics"].items()):
        return False
    return all(isinstance(r, dict) and isinstance(r.get("prompt"), str) and isinstance(r.get("reply"), str)
               and isinstance(r.get("scores"), dict)
               and all(isinstance(k, str) and (v is None or is_finite_float32(v)) for k, v in r["scores"].items())
               for r in value["replies"])
