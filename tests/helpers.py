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
