"""Reward functions used by the end-to-end tests through the 'module:function' path."""


def length_reward(prompts, completions, **columns):
    """Longer completions score higher: random models then still get groups with spread."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
