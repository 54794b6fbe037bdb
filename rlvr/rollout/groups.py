"""Groups of completions - what every sampler returns - and the in-process sampling of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlvr.models.prompts import Prompt, encode_prompts
from rlvr.rollout.decode_weights import decoding, fold_choice
from rlvr.rollout.engine import Generators, SamplingParams, generate_groups


@dataclass
class Groups:
    """G completions for each of B prompts; completion row i belongs to prompt i // G.

    Padding ids (prompt left, completion right) are arbitrary: they are masked everywhere.
    """

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B*G, T] right-padded
    completion_mask: torch.Tensor  # [B*G, T] 1 on generated tokens (EOS included)
    behaviour_logp: torch.Tensor  # [B*G, T] log-probs of the sampled tokens under the sampling policy, 0 on padding
    truncated: torch.Tensor  # [B*G] bool: hit max_new_tokens without EOS or a stop string
    texts: list[str]  # [B*G] decoded completions, special tokens removed
    group_size: int
    version: torch.Tensor  # [B*G] long: policy version that sampled each completion
    temperature: torch.Tensor  # [B*G] float: sampling temperature (0 = greedy) behaviour_logp was taken at
    # [B*G, T] 1 on tokens the model sampled; completion_mask when not given. An episode's observation tokens
    # (tool results) are attended to (completion_mask 1) but not sampled (0 here), so never trained on.
    sampled_mask: torch.Tensor = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.sampled_mask is None:
            self.sampled_mask = self.completion_mask
        if self.sampled_mask.shape != self.completion_mask.shape:
            raise ValueError(f"Groups.sampled_mask must be [B*G, T] = {list(self.completion_mask.shape)}, "
                             f"got {list(self.sampled_mask.shape)}")
        if bool((self.sampled_mask.bool() & ~self.completion_mask.bool()).any()):
            raise ValueError("Groups.sampled_mask marks tokens that completion_mask leaves out")

    @property
    def num_groups(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, groups: Sequence[int]) -> Groups:
        """The given groups (by index), whole, in the given order."""
        g = torch.as_tensor(list(groups), dtype=torch.long, device="cpu")
        rows = (g[:, None] * self.group_size + torch.arange(self.group_size, device="cpu")).reshape(-1)  # [len(g) * G]
        return Groups(
            prompt_ids=self.prompt_ids[g], prompt_mask=self.prompt_mask[g],
            completion_ids=self.completion_ids[rows], completion_mask=self.completion_mask[rows],
            behaviour_logp=self.behaviour_logp[rows], truncated=self.truncated[rows],
            texts=[self.texts[i] for i in rows.tolist()], group_size=self.group_size,
            version=self.version[rows], temperature=self.temperature[rows],
            sampled_mask=self.sampled_mask[rows],
        )

    @staticmethod
    def concat(parts: Sequence[Groups]) -> Groups:
        """One Groups from several with the same group size (prompts re-padded left, completions right)."""
        if not parts:
            raise ValueError("nothing to concatenate")
        if len({p.group_size for p in parts}) != 1:
            raise ValueError(f"group sizes differ: {[p.group_size for p in parts]}")
        width_p = max(p.prompt_ids.shape[1] for p in parts)
        width_t = max(p.completion_ids.shape[1] for p in parts)

        def left(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (width_p - x.shape[1], 0))

        def right(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, width_t - x.shape[1]))

        return Groups(
            prompt_ids=torch.cat([left(p.prompt_ids) for p in parts]),
            prompt_mask=torch.cat([left(p.prompt_mask) for p in parts]),
            completion_ids=torch.cat([right(p.completion_ids) for p in parts]),
            completion_mask=torch.cat([right(p.completion_mask) for p in parts]),
            behaviour_logp=torch.cat([right(p.behaviour_logp) for p in parts]),
            truncated=torch.cat([p.truncated for p in parts]),
            texts=[t for p in parts for t in p.texts],
            group_size=parts[0].group_size,
            version=torch.cat([p.version for p in parts]),
            temperature=torch.cat([p.temperature for p in parts]),
            sampled_mask=torch.cat([right(p.sampled_mask) for p in parts]),
        )

    def completion_token_ids(self) -> list[list[int]]:
        """Each completion's tokens, padding removed."""
        return [ids[m.bool()].tolist() for ids, m in zip(self.completion_ids, self.completion_mask)]



def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


def stop_string_checker(tokenizer, stops: tuple[str, ...]):
    """True once the decoded tail of a completion contains a stop string (tail: enough tokens to hold the
    longest stop string, since every token decodes to at least one character); None without stop strings."""
    if not stops:
        return None
    window = max(len(s) for s in stops) + 1

    def stopped(token_ids: list[int]) -> bool:
        tail = tokenizer.decode(token_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    return stopped


def sample_groups(
    model: nn.Module,
    tokenizer,
    prompts: list[Prompt],
    group_size: int,
    params: SamplingParams,
    generator: Generators = None,
    version: int = 0,
    dtype: torch.dtype = torch.float32,
    fold: bool | str = True,
) -> Groups:
    """G completions per prompt from an in-process model, tagged with ``version``; decoded with LoRA folded into
    the weights and the matmuls in ``dtype``, or through peft in the model's dtype when not ``fold``
    (rlvr.rollout.decode_weights; "auto": whether the copies fit beside this generation's KV cache)."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts)  # [B, P] on the CPU
    rows, tokens = prompt_ids.shape[0] * group_size, prompt_ids.shape[1] + params.max_new_tokens
    fold = fold_choice(fold, model, dtype, rows, tokens)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with decoding(model, dtype, fold=fold) as (backbone, head):
            out = generate_groups(
                backbone, head, prompt_ids.to(device), prompt_mask.to(device), group_size, params,
                eos_ids=eos_token_ids(model, tokenizer), pad_id=tokenizer.pad_token_id, generator=generator,
                stop=stop_string_checker(tokenizer, params.stop),
            )
    finally:
        model.train(was_training)
    ids, mask = out.ids.cpu(), out.mask.cpu()  # the groups cross to the CPU once, for rewards and bookkeeping
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True)
    n = ids.shape[0]
    return Groups(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        completion_mask=mask.long(),
        behaviour_logp=out.behaviour_logp.cpu(),
        truncated=out.truncated.cpu(),
        texts=texts,
        group_size=group_size,
        version=torch.full((n,), version, dtype=torch.long, device="cpu"),
        temperature=torch.full((n,), float(params.temperature), device="cpu"),
    )
