"""On-policy distillation's update: GRPO's, with the teacher's per-token advantage added to the verifier's.

    batch      = the step's completions, the verifier's group advantages [N] times distill.reward_weight
    teacher    = log p_teacher of every sampled token [N, T]       (in process, or a served teacher over HTTP)
    student    = log p_student of the same tokens [N, T]           (the weights the step begins with, no gradient)
    adv        = batch.adv + teacher_advantage(student, teacher)   [N, T]  (rlvr/core/distill.py)
    train_step(adv)                                                 GRPO's step, unchanged (rlvr/learn/step.py)

distill.objective=jsd instead: GRPO's step on batch.adv, plus coef x GKD's generalised JSD over the whole vocabulary
at every trained token (its own loss beside the policy's, ``divergence_sum``), with an in-process teacher.

Both log-probs come from the same forward code at the sampling temperature, so a teacher equal to the student gives
an advantage of exactly 0 (and, alone, no update).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Protocol

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlvr.config.schema import RunConfig
from rlvr.core.distill import generalized_jsd, sampled_reverse_kl, teacher_advantage
from rlvr.learn.batch import StepBatch
from rlvr.learn.collected import Collected
from rlvr.learn.forward import completion_hidden, uniform_temperature
from rlvr.learn.learner import Learner
from rlvr.learn.step import (
    GRPOUpdate,
    chunk_for_vocab,
    frozen_logprobs,
    micro_batches,
    row_width,
    step_batch,
    train_step,
)
from rlvr.models.policy import autocast, backbone_and_head, resolve_model_dir
from rlvr.models.prompts import encode_prompts
from rlvr.models.teacher import load_teacher, vocabulary_mismatch
from rlvr.platform.devices import model_device, weight_dtype
from rlvr.rollout.teacher_client import TeacherClient


class Teacher(Protocol):
    def logprobs(self, batch: StepBatch, rows: list[torch.Tensor], chunk_tokens: int) -> torch.Tensor:
        """[N, T] log-probs of the batch's completion tokens (0 outside the rows), at the batch's temperatures."""


class LocalTeacher:
    """A teacher model in this process, on the student's device."""

    def __init__(self, model: nn.Module):
        self.model = model

    def logprobs(self, batch: StepBatch, rows: list[torch.Tensor], chunk_tokens: int) -> torch.Tensor:
        return frozen_logprobs(self.model, batch, rows, chunk_tokens, share_prompt=True)


class SelfTeacher:
    """The student's own starting weights: the base model under its LoRA adapter (self-distillation with
    privileged context, ``distill.hint``: no second model)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def logprobs(self, batch: StepBatch, rows: list[torch.Tensor], chunk_tokens: int) -> torch.Tensor:
        with self.model.disable_adapter():
            return frozen_logprobs(self.model, batch, rows, chunk_tokens, share_prompt=True)


class ServedTeacher:
    """A teacher behind a vLLM-compatible server: each completion's prompt and completion ids are sent, its
    log-probs come back (rlvr/rollout/teacher_client.py)."""

    def __init__(self, client: TeacherClient):
        self.client = client

    def logprobs(self, batch: StepBatch, rows: list[torch.Tensor], chunk_tokens: int) -> torch.Tensor:
        out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device="cpu")  # filled here, then moved
        wanted = sorted(int(i) for r in rows for i in r.tolist())
        lengths = batch.completion_mask.sum(dim=1).tolist()
        sequences = []
        for i in wanted:
            g = i // batch.group_size
            prompt = batch.prompt_ids[g][batch.prompt_mask[g].bool()].tolist()
            sequences.append((prompt, batch.completion_ids[i, :int(lengths[i])].tolist(),
                              float(batch.temperature[i, 0])))
        for i, logp in zip(wanted, self.client.score(sequences)):
            out[i, :len(logp)] = torch.tensor(logp, dtype=torch.float32, device="cpu")
        return out.to(batch.completion_ids.device)


class DistillUpdate(GRPOUpdate):
    """GRPO's update with a teacher (distill.*); the teacher is loaded when the run attaches its model."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.cfg, self.distill = cfg, cfg.distill
        self.teacher: Teacher | None = None
        self.rows: list[dict] | None = None  # the dataset, for distill.hint
        self.tokenizer = None

    def attach(self, model: nn.Module) -> tuple[nn.Module, list[nn.Parameter]]:
        if self.teacher is None:
            self.teacher = SelfTeacher(model) if self.distill.teacher == "self" else \
                build_teacher(self.cfg, model_device(model))
        return super().attach(model)

    def bind(self, rows: list[dict], tokenizer) -> None:
        """The training rows and tokenizer the teacher's hinted prompts are built from (distill.hint); the hint is
        formatted with every row now, so a column it names and a row lacks is an error before the first step."""
        if self.distill.hint:
            for i, row in enumerate(rows):
                hinted_prompt(row, self.distill.hint, i)
        self.rows, self.tokenizer = rows, tokenizer

    def teacher_batch(self, sb: StepBatch, row_ids: list[int]) -> StepBatch:
        """``sb`` with each group's prompt as the teacher reads it: the row's prompt with distill.hint added."""
        if not self.distill.hint:
            return sb
        if self.rows is None or len(row_ids) != sb.prompt_ids.shape[0]:
            raise RuntimeError("distill.hint needs the training rows (DistillUpdate.bind) and a row per group")
        prompts = [hinted_prompt(self.rows[i], self.distill.hint, i) for i in row_ids]
        ids, mask = encode_prompts(self.tokenizer, prompts)
        return replace(sb, prompt_ids=ids.to(sb.prompt_ids.device), prompt_mask=mask.to(sb.prompt_mask.device))

    def __call__(self, learner: Learner, batch: Collected) -> dict[str, float]:
        if self.teacher is None:
            raise RuntimeError("DistillUpdate.attach(model) loads the teacher before the first step")
        adv = batch.adv if batch.adv is not None else torch.zeros(batch.groups.completion_ids.shape[0], device="cpu")
        model = learner.model
        sb = step_batch(batch, adv * self.distill.reward_weight, self.mask_truncated).to(model_device(model))
        chunk = chunk_for_vocab(self.options.chunk_tokens, backbone_and_head(model)[1].weight.shape[0])
        if self.distill.objective == "jsd":
            return self._jsd_step(learner, sb, self.teacher_batch(sb, batch.row_ids), chunk)
        rows = micro_batches(sb, self.options.micro_batch_size, skip_zero_advantage=False)
        with autocast(model, self.autocast):
            teacher = self.teacher.logprobs(self.teacher_batch(sb, batch.row_ids), rows, chunk)
            student = frozen_logprobs(model, sb, rows, chunk, self.options.share_prompt)
            taught = teacher_advantage(student, teacher.to(student.dtype), sb.loss_mask, self.distill.coef)
            token_adv = sb.token_adv(torch.arange(sb.num_completions, device=taught.device)).to(taught.dtype)
            metrics = train_step(learner, replace(sb, adv=token_adv + taught), self.settings, self.options)
        metrics["distill/reverse_kl"] = sampled_reverse_kl(student, teacher.to(student.dtype), sb.loss_mask)
        return metrics

    def _jsd_step(self, learner: Learner, sb: StepBatch, taught: StepBatch, chunk: int) -> dict[str, float]:
        """GRPO's step on the (weighted) verifier's advantages plus, per micro-batch, coef x the generalised JSD
        summed over its trained tokens and divided by the step's trained tokens (a token mean over the step)."""
        teacher = self.teacher  # objective=jsd: an in-process teacher (checked)
        tokens = max(float(sb.loss_mask.sum()), 1.0)
        total = {"jsd": 0.0}

        def jsd_loss(rows: torch.Tensor) -> torch.Tensor:
            value = divergence_sum(learner.model, teacher, sb, taught, rows, self.distill.beta, chunk) / tokens
            total["jsd"] += float(value.detach())
            return self.distill.coef * value

        with autocast(learner.model, self.autocast):
            metrics = train_step(learner, sb, self.settings, self.options, extra_loss=jsd_loss)
        metrics["distill/jsd"] = total["jsd"] / max(self.options.num_iterations, 1)
        return metrics


def divergence_sum(model: nn.Module, teacher: LocalTeacher | SelfTeacher, batch: StepBatch, taught: StepBatch,
                   rows: torch.Tensor, beta: float, chunk: int) -> torch.Tensor:
    """Sum over the trained tokens of ``rows`` of GKD's generalised JSD between the student's and the teacher's
    distributions at the sampling temperature; differentiable in the student only. ``taught``: the batch as the
    teacher reads it (its prompts may carry a hint). The output layers run a chunk of tokens at a time, each chunk
    recomputed in the backward pass (never [M, V] logits held for the whole micro-batch)."""
    w = row_width(batch, rows)
    m = batch.loss_mask[rows, :w].bool()  # [n, W]
    hidden = completion_hidden(model, batch, rows, True, width=w)[m]  # [M, H]
    with torch.no_grad(), teacher_weights(teacher) as teacher_model:
        target_hidden = completion_hidden(teacher_model, taught, rows, True, width=w)[m]  # [M, H_teacher]
    temperature = uniform_temperature(batch.temperature[rows, :w][m])  # a float, or [M]
    head = backbone_and_head(model)[1]
    with teacher_weights(teacher) as teacher_model:
        teacher_head = backbone_and_head(teacher_model)[1]
    total = hidden.new_zeros(())
    for start in range(0, hidden.shape[0], chunk):
        part = slice(start, start + chunk)
        scale = temperature if isinstance(temperature, float) else temperature[part, None]
        with torch.no_grad():
            target = _at_least_fp32(teacher_head(target_hidden[part])) / scale  # [c, V]

        def piece(h: torch.Tensor, target: torch.Tensor = target, scale=scale) -> torch.Tensor:
            return generalized_jsd(_at_least_fp32(head(h)) / scale, target, beta).sum()

        total = total + checkpoint(piece, hidden[part], use_reentrant=False)
    return total


@contextlib.contextmanager
def teacher_weights(teacher: LocalTeacher | SelfTeacher):
    """The teacher as a model: its own, or the student's with the adapter off."""
    if isinstance(teacher, SelfTeacher):
        with teacher.model.disable_adapter():
            yield teacher.model
    else:
        yield teacher.model


def hinted_prompt(row: dict, hint: str, index: int):
    """Row ``index``'s prompt with ``hint`` (formatted with the row's columns) at the end of its last user turn, or
    of its text; a ValueError naming a column the hint reads and the row lacks."""
    try:
        text = hint.format_map(row)
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"distill.hint {hint!r} cannot be formatted with row {index} (columns {sorted(row)}): "
                         f"{err!r}") from None
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return f"{prompt}\n\n{text}"
    users = [i for i, message in enumerate(prompt) if message.get("role") == "user"]
    if not users:
        raise ValueError(f"distill.hint: row {index}'s prompt has no user turn to add the hint to")
    messages = [dict(message) for message in prompt]
    messages[users[-1]]["content"] = f"{messages[users[-1]]['content']}\n\n{text}"
    return messages


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def build_teacher(cfg: RunConfig, device: torch.device) -> Teacher:
    """The configured teacher, after checking that it reads the student's token ids as the student does."""
    d = cfg.distill
    if d.url:
        client = TeacherClient(d.url, d.model, d.api_key_env, d.request_timeout_s)
        client.check_tokens(cfg.model.name)
        return ServedTeacher(client)
    student_dir, teacher_dir = resolve_model_dir(cfg.model.name), resolve_model_dir(d.teacher)
    why = vocabulary_mismatch(student_dir, teacher_dir)
    if why:
        raise ValueError(f"distill.teacher {d.teacher!r} cannot score the student's tokens: {why}; rlvr distils "
                         "between models of one tokenizer (no cross-tokenizer mode yet)")
    return LocalTeacher(load_teacher(d.teacher, d.adapter, weight_dtype(cfg.model.dtype, device, lora=True), device))
