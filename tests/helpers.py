"""Reward functions used by the end-to-end tests through the 'module:function' path."""


def length_reward(prompts, completions, **columns):
    """Longer completions score higher: random models then still get groups with spread."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def failing_reward(prompts, completions, **columns):
    raise RuntimeError("verifier crashed")


def hanging_reward(prompts, completions, **columns):
    import time

    time.sleep(30)
    return [0.0] * len(completions)


def unaccounted_s(record: dict, parts: tuple[str, ...]) -> float:
    """A step's wall time (time/step_s) minus the named parts of it (eval/time_s added when the step evaluated)."""
    return record["time/step_s"] - sum(record[k] for k in parts) - record.get("eval/time_s", 0.0)


def assert_parts_add_up(records: list[dict], parts: tuple[str, ...]) -> None:
    """The parts never exceed the step, and what they leave unaccounted (building the batch, logging) is under
    0.5 s or 20 % of the step, whichever is larger: a part missing or counted twice fails it."""
    for r in records:
        gap = unaccounted_s(r, parts)
        assert -1e-3 <= gap <= max(0.5, 0.2 * r["time/step_s"]), (r["step"], gap, {k: r[k] for k in parts})


class Notebook:
    """A TRL-style environment for end-to-end tests: reset(**row) adds a line to the prompt, one tool, and
    get_reward() scores the completion's length (so a random model's groups differ)."""

    def reset(self, prompt=None, **row) -> str:
        self.notes = []
        return " (you may write notes)"

    def note(self, text: str) -> str:
        """Write a note.

        Args:
            text: the note
        """
        self.notes.append(text)
        return f"{len(self.notes)} notes"

    def get_reward(self) -> float:
        return float(len(self.notes))


def environments_reward(prompts, completions, environments, **columns):
    """A reward that reads the environments (TRL's signature): 1 when the environment is a Notebook."""
    return [1.0 if isinstance(e, Notebook) else 0.0 for e in environments]


def rising_reward(prompts, completions, trainer_state, **columns):
    """0.2 + 0.3 per optimizer step taken, at most 1: a trained reward that rises at every evaluation."""
    return [min(1.0, 0.2 + 0.3 * trainer_state.global_step)] * len(completions)


def falling_measure(prompts, completions, trainer_state, **columns):
    """0.9 - 0.3 per optimizer step taken, at least 0: an independent measure that falls at every evaluation."""
    return [max(0.0, 0.9 - 0.3 * trainer_state.global_step)] * len(completions)


def flat_measure(prompts, completions, **columns):
    return [0.5] * len(completions)
