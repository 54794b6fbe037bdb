"""DiLoCo's outer step (Douillard et al., arXiv 2311.08105, Algorithm 1) over dicts of named tensors.

A round starts every learner from the same weights theta. Learner k trains H inner steps and reports its delta
``delta_k = theta_k - theta``. The outer gradient is the negated mean delta, ``g = -(1/K) sum_k delta_k``, and the
outer optimizer is SGD with Nesterov momentum (torch.optim.SGD's formulas, dampening 0)::

    m <- g                     (the first round)        m <- mu * m + g    (later rounds)
    theta <- theta - lr * (g + mu * m)

With lr = 1 and mu = 0 this is plain averaging (FedAvg). The paper's setting: lr 0.7, mu 0.9.

Departure from the paper: ``bound_norm`` scales a learner's delta down to a given L2 norm before averaging (a
learner cannot move the average by more than bound / K), a guard for learners that share only a bucket.
"""

from __future__ import annotations

import math

import torch

Tensors = dict[str, torch.Tensor]


def delta_norm(delta: Tensors) -> float:
    """The L2 norm of a delta over all its tensors (fp64 sum)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def bound_norm(delta: Tensors, max_norm: float) -> tuple[Tensors, bool]:
    """``delta`` scaled to L2 norm ``max_norm`` when larger (0: no bound); returns (delta, whether it was scaled)."""
    norm = delta_norm(delta)
    if max_norm <= 0 or norm <= max_norm:
        return delta, False
    return {k: t * (max_norm / norm) for k, t in delta.items()}, True


def outer_gradient(deltas: list[Tensors]) -> Tensors:
    """``g = -(1/K) sum_k delta_k`` (fp32), summed in the order given (callers sort by learner: deterministic)."""
    if not deltas:
        raise ValueError("an outer step needs at least one delta")
    total = {k: t.float().clone() for k, t in deltas[0].items()}
    for delta in deltas[1:]:
        for k, t in delta.items():
            total[k] += t.float()
    return {k: -t / len(deltas) for k, t in total.items()}


def nesterov_step(theta: Tensors, grad: Tensors, momentum: Tensors | None, lr: float,
                  mu: float) -> tuple[Tensors, Tensors]:
    """One outer step: (new theta, new momentum); nothing is modified in place."""
    new_momentum = {k: g.clone() if momentum is None else mu * momentum[k] + g for k, g in grad.items()}
    new_theta = {k: theta[k].float() - lr * (grad[k] + mu * new_momentum[k]) for k in theta}
    return new_theta, new_momentum
