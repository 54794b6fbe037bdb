"""A distillation teacher held in this process: loaded frozen, and checked to read the student's tokens as the student
does (the same vocabulary id for id, the same special tokens and chat template) before a run starts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rlvr.models.policy import _one_line, load_causal_lm, load_tokenizer, resolve_model_dir


def load_teacher(name: str, adapter: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The teacher model ``name`` (a directory or an alias, as model.name), with the LoRA ``adapter`` directory merged
    into it when given; in eval mode, without gradients, on ``device``."""
    model = load_causal_lm(resolve_model_dir(name), dtype)
    if adapter:
        path = Path(adapter).expanduser()
        if not (path / "adapter_config.json").is_file():
            raise ValueError(f"distill.adapter {adapter!r} is not a LoRA adapter directory (no adapter_config.json); "
                             "pass a directory saved by peft, e.g. a run's adapter/")
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, path).merge_and_unload()
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise ValueError(f"distill.adapter {adapter!r} does not fit the teacher {name!r}: "
                             f"{_one_line(err)}") from err
    return model.to(device).eval().requires_grad_(False)


def vocabulary_mismatch(student_dir: Path, teacher_dir: Path) -> str | None:
    """Why the teacher cannot score the student's token ids, in one line, or None when it can: the tokenizers' id
    maps, special tokens and chat templates must be equal, and so must the models' vocabulary sizes (the teacher's
    log-probs are of the student's ids; a different vocabulary is silent garbage, not an error)."""
    if Path(student_dir).resolve() == Path(teacher_dir).resolve():
        return None
    student, teacher = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    if student.get_vocab() != teacher.get_vocab():
        return f"its tokenizer's vocabulary differs from the student's ({len(teacher)} tokens vs {len(student)})"
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"its {name} is {getattr(teacher, name)}, the student's {getattr(student, name)}"
    if (student.chat_template or "") != (teacher.chat_template or ""):
        return "its chat template differs from the student's (the same ids would render other turns)"
    sizes = [_vocab_size(d) for d in (student_dir, teacher_dir)]
    if sizes[0] != sizes[1]:
        return f"its output layer has {sizes[1]} rows, the student's {sizes[0]}"
    return None


def _vocab_size(model_dir: Path) -> int | None:
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
