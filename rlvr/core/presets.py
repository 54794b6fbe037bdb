"""Algorithm variants as named settings of the same knobs; the training loop never branches on them.

- grpo: DeepSeekMath GRPO: group-std advantages, sequence-mean aggregation, symmetric clip 0.2,
  k3 KL with beta 0.04.
- dapo: DAPO's loss: token-mean aggregation, clip-higher (0.2 / 0.28), no KL. (DAPO's dynamic sampling
  and overlong shaping are data-side features, not loss knobs, and are not part of this preset.)
- dr_grpo: Dr. GRPO: no std scaling, token sum over a constant (max_new_tokens x sequences), no KL.
"""

from __future__ import annotations

PRESETS: dict[str, dict[str, object]] = {
    "grpo": dict(
        scale="group", aggregation="sequence_mean", eps_low=0.2, eps_high=0.2, beta=0.04, kl_estimator="k3"
    ),
    "dapo": dict(
        scale="group", aggregation="token_mean", eps_low=0.2, eps_high=0.28, beta=0.0, kl_estimator="k3"
    ),
    "dr_grpo": dict(
        scale="none", aggregation="token_sum_constant", eps_low=0.2, eps_high=0.2, beta=0.0, kl_estimator="k3"
    ),
}
