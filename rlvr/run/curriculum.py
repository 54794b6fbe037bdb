"""A curriculum over a task's ``steps`` column: train on one-operation problems, then two, then the mix.

Stages are sets of allowed ``steps`` values. A run moves to the next stage once its pass rate (the mean of the
correctness reward over everything sampled) has reached ``pass_rate`` on each of the last ``window`` steps, or
after ``max_stage_steps`` steps in the stage, whichever comes first; the last stage lasts to the end. Rows of
other stages are skipped in the data stream (its cursor moves past them), so the order stays a pure function
of the seed and the stream position and a resumed run draws the same rows. The groups the policy already
solves every time, or never, carry no signal: DAPO's dynamic sampling drops them online (algo.dynamic_sampling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

WINDOW = 3  # steps whose pass rate must all reach the threshold


@dataclass(frozen=True)
class Curriculum:
    stages: tuple[tuple[int, ...], ...]  # allowed ``steps`` values of each stage, in order
    pass_rate: float
    max_stage_steps: int

    @classmethod
    def of(cls, task) -> Curriculum | None:
        """The curriculum of a TaskConfig (None without ``task.curriculum``): a stage per listed operation count,
        then ``task.train_steps``."""
        if not task.curriculum:
            return None
        return cls(tuple((n,) for n in task.curriculum) + (tuple(task.train_steps),), task.curriculum_pass_rate,
                   task.curriculum_stage_steps)

    def allowed(self, state: dict) -> tuple[int, ...]:
        return self.stages[self._stage(state)]

    def record(self, state: dict, pass_rate: float) -> None:
        """After a step: note its pass rate and move to the next stage when due (``state`` is the run's loop state,
        saved in checkpoints)."""
        stage = self._stage(state)
        if stage == len(self.stages) - 1:
            return
        recent, taken = state.get("curriculum_recent", []), state.get("curriculum_stage_taken", 0)
        if not (isinstance(recent, list) and all(type(r) in (int, float) for r in recent) and type(taken) is int):
            raise ValueError("the checkpoint's loop state holds a malformed curriculum history; resume from another "
                             "checkpoint")
        recent, taken = [*recent, pass_rate][-WINDOW:], taken + 1
        if (len(recent) == WINDOW and min(recent) >= self.pass_rate) or taken >= self.max_stage_steps:
            stage, recent, taken = stage + 1, [], 0
        state.update(curriculum_stage=stage, curriculum_recent=recent, curriculum_stage_taken=taken)


    def _stage(self, state: dict) -> int:
        """The stage in ``state`` (0 before the first step), checked: a checkpoint's loop state is input too."""
        stage = state.get("curriculum_stage", 0)
        if type(stage) is not int or not 0 <= stage < len(self.stages):
            raise ValueError(f"the checkpoint's loop state is at curriculum stage {stage!r}, which task.curriculum "
                             f"(stages 0-{len(self.stages) - 1}) does not have; resume with the curriculum it was "
                             "written with, or from another checkpoint")
        return stage


def stage_row_ids(rows: list[dict], allowed: tuple[int, ...], count: int, state: dict,
                  order: Callable[[int, int], list[int]]) -> list[int]:
    """The next ``count`` rows of the data stream whose ``steps`` is ``allowed``, advancing ``state["cursor"]`` past
    every row read. ``order(start, n)``: the row indices at stream positions [start, start + n)."""
    if any("steps" not in r for r in rows):
        raise ValueError("task.curriculum needs a 'steps' column (operations per problem) on every training row, as "
                         "task word_problems writes")
    if not any(r["steps"] in allowed for r in rows):
        raise ValueError(f"task.curriculum: no training row has {allowed} operations; the rows have "
                         f"{sorted({r['steps'] for r in rows})}")
    out: list[int] = []
    while len(out) < count:
        for i in order(state["cursor"], count):
            state["cursor"] += 1
            if rows[i]["steps"] in allowed:
                out.append(i)
                if len(out) == count:
                    break
    return out
