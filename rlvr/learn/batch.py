"""The batch one update trains on, built from Groups by one constructor."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from rlvr.rollout import Groups


@dataclass
class StepBatch:
    """Everything an update needs; completion row i belongs to prompt i // group_size.

    Per completion token ([N, T]) it carries the token, whether it is attended to (``completion_mask``),
    whether it is trained on (``loss_mask``: tool or observation tokens are attended to but not trained;
    excluded completions are all zero), the behaviour log-prob recorded when it was sampled and the temperature
    it was sampled at (the trainer scores it at the same one). Which policy version sampled a completion stays on
    ``Groups.version`` (the staleness metrics read it); the update never needs it.
    """

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [N, T] right-padded, N = B * G
    completion_mask: torch.Tensor  # [N, T] attention mask
    loss_mask: torch.Tensor  # [N, T] 1 where the token is trained on (a subset of completion_mask)
    behaviour_logp: torch.Tensor  # [N, T] float
    temperature: torch.Tensor  # [N, T] float > 0
    adv: torch.Tensor  # [N] one per completion, or [N, T] one per token
    group_size: int

    def __post_init__(self) -> None:
        n, t = self.completion_ids.shape
        if self.prompt_ids.shape[0] * self.group_size != n:
            raise ValueError(f"{self.prompt_ids.shape[0]} prompts x group_size {self.group_size} != {n} completions")
        for name in ("completion_mask", "loss_mask", "behaviour_logp", "temperature"):
            if tuple(getattr(self, name).shape) != (n, t):
                raise ValueError(f"StepBatch.{name} must be [N, T] = {[n, t]}, got {list(getattr(self, name).shape)}")
        if self.adv.shape not in ((n,), (n, t)):
            raise ValueError(f"StepBatch.adv must be [N] or [N, T] = {[n, t]}, got {list(self.adv.shape)}")
        if bool((self.loss_mask.bool() & ~self.completion_mask.bool()).any()):
            raise ValueError("StepBatch.loss_mask marks tokens that completion_mask leaves out")

    def to(self, device: torch.device) -> StepBatch:
        """This batch with every tensor on ``device`` (itself when they are there already): the one crossing of the
        step's tensors from the CPU to the model's device."""
        if self.completion_ids.device == device:
            return self
        moved = copy.copy(self)  # checked when it was built: no second check (a host sync on a GPU)
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), torch.Tensor):
                setattr(moved, f.name, getattr(self, f.name).to(device))
        return moved

    @property
    def num_completions(self) -> int:
        return self.completion_ids.shape[0]

    def token_adv(self, rows: torch.Tensor) -> torch.Tensor:
        """Advantages of ``rows`` per token, [n, T]."""
        adv = self.adv[rows]
        return adv[:, None].expand(-1, self.completion_ids.shape[1]) if adv.dim() == 1 else adv

    @classmethod
    def from_groups(cls, groups: Groups, adv: torch.Tensor, include: torch.Tensor | None = None,
                    mask_truncated: bool = False) -> StepBatch:
        """The batch for ``groups`` with advantages ``adv`` ([N] or [N, T]); only the tokens the model sampled are
        trained on (``Groups.sampled_mask``: an episode's observation tokens are attended to, not trained).
        Completions where ``include`` [N] is False (e.g. no reward) stay in the batch but are not trained on, nor
        (``mask_truncated``, DAPO's overlong filtering) are completions cut at max_new_tokens. Greedy rows
        (temperature 0) are scored at temperature 1, the distribution their log-probs were recorded from."""
        if mask_truncated:
            include = ~groups.truncated if include is None else include & ~groups.truncated
        mask = groups.completion_mask.long()
        sampled = groups.sampled_mask.long()
        loss_mask = sampled if include is None else sampled * include[:, None].long()
        width = mask.shape[1]
        temperature = torch.where(groups.temperature > 0, groups.temperature, torch.ones_like(groups.temperature))
        return cls(
            prompt_ids=groups.prompt_ids,
            prompt_mask=groups.prompt_mask,
            completion_ids=groups.completion_ids,
            completion_mask=mask,
            loss_mask=loss_mask,
            behaviour_logp=groups.behaviour_logp.float(),
            temperature=temperature.float()[:, None].expand(-1, width),
            adv=adv,
            group_size=groups.group_size,
        )
