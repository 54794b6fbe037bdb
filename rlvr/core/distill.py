"""On-policy distillation: the student samples, a teacher scores every token the student sampled.

Per completion token t with prefix c_t = (prompt, y_<t), both distributions at the sampling temperature:

    delta_t = log pi_student(y_t | c_t) - log pi_teacher(y_t | c_t)

Its expectation over y_t ~ pi_student is the reverse KL, KL(pi_student(.|c_t) || pi_teacher(.|c_t)); delta_t alone
is that KL's single-sample ("k1") estimate, and can be negative.

- ``teacher_advantage``: A_t = -coef * delta_t, a per-token advantage (discount 0: each token is credited with its
  own log-ratio only), added to the verifier's group advantage (times a weight; 0 is distillation alone). Both
  log-probs are constants of the step: the gradient flows through the policy objective's ratio only, never
  through the teacher (back-propagating delta_t itself would not depend on the teacher at all).
- ``generalized_jsd``: GKD's divergence over the whole vocabulary, with M = beta * P_teacher + (1 - beta) *
  P_student: JSD_beta = beta * KL(P_teacher || M) + (1 - beta) * KL(P_student || M); beta = 0 is taken as the
  forward KL(P_teacher || P_student) and beta = 1 as the reverse KL(P_student || P_teacher) (TRL's convention).
"""

from __future__ import annotations

import math

import torch


def teacher_advantage(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor,
                      coef: float) -> torch.Tensor:
    """[N, T] per-token advantages -coef * (student_logp - teacher_logp) on the ``mask``ed tokens, 0 elsewhere.

    student_logp, teacher_logp: [N, T] log-probs of the sampled tokens (no gradient); mask: [N, T] 1 where trained.
    """
    delta = (student_logp.detach() - teacher_logp.detach()).to(torch.float64 if student_logp.dtype == torch.float64
                                                                else torch.float32)
    return torch.where(mask.bool(), -coef * delta, torch.zeros_like(delta))


def sampled_reverse_kl(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of delta_t over the ``mask``ed tokens [N, T]: the batch's k1 estimate of the reverse KL per token."""
    m = mask.bool()
    return float((student_logp - teacher_logp)[m].double().mean()) if m.any() else 0.0


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """[M] exact KL(P_student || P_teacher) per position from logits [M, V] (already divided by the temperature)."""
    s, t = torch.log_softmax(student_logits, dim=-1), torch.log_softmax(teacher_logits, dim=-1)
    return (s.exp() * (s - t)).sum(dim=-1)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """[M] GKD's generalised Jensen-Shannon divergence per position, over the whole vocabulary.

    student_logits, teacher_logits: [M, V], already divided by the temperature; differentiable in both.
    beta in [0, 1]: 0 is KL(P_teacher || P_student), 1 is KL(P_student || P_teacher).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1]; got {beta}")
    s, t = torch.log_softmax(student_logits, dim=-1), torch.log_softmax(teacher_logits, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(dim=-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(dim=-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)  # log M, [M, V]
    return beta * (t.exp() * (t - m)).sum(dim=-1) + (1 - beta) * (s.exp() * (s - m)).sum(dim=-1)
