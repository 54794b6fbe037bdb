"""The files a run writes for people to read: samples.jsonl records (``sample_records``), config.yaml with the
task fields the task does not read marked (``config_yaml``) and its local paths absolute (``absolute_paths``), and
the model card of the saved weights (``model_card``)."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from rlvr.config.loading import to_dict
from rlvr.config.schema import ARITHMETIC_SYSTEM_PROMPT, RunConfig, TaskConfig
from rlvr.learn.collected import Collected
from rlvr.models.offline import OFFLINE_MODELS, original_name

COLUMN_CHARS = 2000  # samples.jsonl: a dataset column's string is cut to this many characters
COLUMN_ITEMS = 100  # ... and a list or mapping to this many items


def loggable(value: Any) -> Any:
    """A dataset value as bounded JSON: strings cut to COLUMN_CHARS characters and lists and mappings to COLUMN_ITEMS
    items (each cut says how much it left out), non-finite floats as null, numpy and torch values as Python ones,
    anything else as its string."""
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        cut = len(value) - COLUMN_CHARS
        return value if cut <= 0 else f"{value[:COLUMN_CHARS]}... [{cut} more characters]"
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k): loggable(v) for k, v in items[:COLUMN_ITEMS]}
        return out | ({"...": f"{len(items) - COLUMN_ITEMS} more items"} if len(items) > COLUMN_ITEMS else {})
    if isinstance(value, (list, tuple)):
        out = [loggable(v) for v in value[:COLUMN_ITEMS]]
        return out + ([f"... {len(value) - COLUMN_ITEMS} more items"] if len(value) > COLUMN_ITEMS else [])
    if isinstance(value, (np.ndarray, np.generic, torch.Tensor)):
        return loggable(value.tolist())
    return loggable(str(value))


def _reward(value: float) -> float | None:
    return None if math.isnan(value) else value


def sample_records(c: Collected, rows: list[dict], with_token_ids: bool) -> list[dict]:
    """Every completion sampled this step (all rounds): its group's row (an index into ``rows``, the training rows;
    and the uid in asynchronous runs), its text, its total reward and each reward function's own value
    (unweighted; null where the function gave none). The first completion of each group also carries the prompt
    (a string, or chat messages) and the row's other columns (what reward functions receive; ``loggable``), once
    per group rather than G times."""
    records = []
    for r in c.rounds:
        G = r.groups.group_size
        ids = r.groups.completion_token_ids() if with_token_ids else None
        per_function = {name: values.tolist() for name, values in r.scores.per_function.items()}
        for i, (text, reward) in enumerate(zip(r.groups.texts, r.scores.total.tolist())):
            g = i // G
            record = {"row": r.row_ids[g], **({"uid": r.uids[g]} if r.uids else {})}
            if i % G == 0:
                row = rows[r.row_ids[g]]
                columns = {k: loggable(v) for k, v in row.items() if k != "prompt"}
                record |= {"prompt": row["prompt"], "columns": columns}
            record |= {"text": text, "reward": _reward(reward),
                       "rewards": {name: _reward(values[i]) for name, values in per_function.items()}}
            if ids:
                record["token_ids"] = ids[i]
            records.append(record)
    return records


# The task fields each task.name reads (rlvr/tasks: load_task and what it calls), beside those every task reads;
# config.yaml lists the rest under a comment that says they are unused. tests/test_outputs.py checks that every
# TaskConfig field is in one of them, so a new field must be entered here.
TASK_COMMON_FIELDS = ("name", "eval_size", "chat_template", "drop_long_prompts", "eval_reward")
_COLUMN_MAP = ("system_prompt", "prompt_column", "prompt_template", "answer_column", "answer_format")
_JSONL_FIELDS = ("train_path", "eval_path", "eval_fraction", "seed", *_COLUMN_MAP)
TASK_FIELDS: dict[str, tuple[str, ...]] = {
    "arithmetic": ("digits", "operators", "train_size", "seed", "system_prompt"),
    "word_problems": ("train_size", "seed", "system_prompt", "train_steps", "eval_steps", "few_shot", "max_number",
                      "grammar", "curriculum", "curriculum_pass_rate", "curriculum_stage_steps"),
    "tool_problems": ("train_size", "seed", "system_prompt", "few_shot", "problem_kind", "example_kind"),
    "jsonl": _JSONL_FIELDS,
    "math_jsonl": _JSONL_FIELDS,
    "code_jsonl": _JSONL_FIELDS,
    "hf": ("source", "subset", "train_split", "eval_split", "eval_fraction", "train_size", "seed", "streaming",
           *_COLUMN_MAP),
}


def replaces_system_prompt(task: TaskConfig) -> bool:
    """Whether the task sends something else (an instruction of its own, or none) in place of task.system_prompt:
    every task but arithmetic does when it is left at the arithmetic default."""
    return task.name != "arithmetic" and task.system_prompt == ARITHMETIC_SYSTEM_PROMPT


def unused_task_fields(task: TaskConfig) -> list[str]:
    """The fields of ``task`` that its task.name does not read (none for a task missing from TASK_FIELDS)."""
    names = [f.name for f in dataclasses.fields(task)]
    used = set(TASK_COMMON_FIELDS) | set(TASK_FIELDS.get(task.name, names))
    return [n for n in names if n not in used]


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path)) if path else path


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with every local path made absolute against the working directory, so that a run's config.yaml (and
    its checkpoints' copies) names the same files from any directory: output_dir, resume (a checkpoint path),
    model.name (a local directory, not an alias or a Hub id), task.train_path / eval_path, task.source (a local
    file, directory or glob, not a Hub id), eval.extra_path and a local diloco.bucket (not a URL)."""
    from rlvr.models.offline import ALIASES

    name, source = cfg.model.name, cfg.task.source
    if name not in ALIASES and Path(name).expanduser().exists():
        name = _absolute(name)
    if source and (Path(source).expanduser().exists() or glob.has_magic(source)):
        source = _absolute(source)
    task = dataclasses.replace(cfg.task, source=source, train_path=_absolute(cfg.task.train_path),
                               eval_path=_absolute(cfg.task.eval_path))
    return dataclasses.replace(
        cfg, output_dir=_absolute(cfg.output_dir), resume=cfg.resume if cfg.resume in ("", "auto") else
        _absolute(cfg.resume), model=dataclasses.replace(cfg.model, name=name), task=task,
        eval=dataclasses.replace(cfg.eval, extra_path=_absolute(cfg.eval.extra_path)),
        diloco=dataclasses.replace(cfg.diloco, bucket=cfg.diloco.bucket if "://" in cfg.diloco.bucket else
                                   _absolute(cfg.diloco.bucket)))


def module_dirs(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``import_dirs`` extended by the folders this run's own modules were imported from (the
    ``module:name`` rewards, held-out check, tools and environment class; not installed packages, nor
    ``__main__``), absolute, so that ``rlvr eval RUN`` and ``rlvr train RUN/config.yaml`` import them from any
    directory."""
    import sys
    import sysconfig

    names = [r.name for r in cfg.rewards] + [cfg.task.eval_reward, cfg.env.factory, *cfg.env.tools]
    installed = {Path(p).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
                 if (p := sysconfig.get_paths().get(key))}
    found = list(cfg.import_dirs)
    for name in names:
        module_name = name.partition(":")[0] if ":" in name else ""
        file = getattr(sys.modules.get(module_name), "__file__", None) if module_name != "__main__" else None
        if not module_name or not file:
            continue
        depth = module_name.count(".") + (Path(file).name == "__init__.py")
        root = Path(file).resolve().parents[depth]  # the folder the top package is found in
        if not any(root == p or p in root.parents for p in installed) and str(root) not in found:
            found.append(str(root))
    return dataclasses.replace(cfg, import_dirs=tuple(found))


def sent_system_prompt(cfg: RunConfig, rows: list[dict]) -> RunConfig:
    """``cfg`` with task.system_prompt set to what the column-map tasks (hf, jsonl, math_jsonl, code_jsonl) actually
    sent in place of the arithmetic default: their own instruction when the prompts were built from a question
    column, '' when the rows brought their own prompts. config.yaml then records what the model saw, and reruns
    the same."""
    from rlvr.tasks import JSONL_TASKS
    from rlvr.tasks.columns import STEP_BY_STEP_SYSTEM_PROMPT

    task = cfg.task
    if not replaces_system_prompt(task) or task.name not in (*JSONL_TASKS, "hf") or not rows:
        return cfg
    own = STEP_BY_STEP_SYSTEM_PROMPT if task.name == "hf" else JSONL_TASKS[task.name][1]
    first = rows[0]["prompt"]
    sent = isinstance(first, list) and first and first[0].get("role") == "system" and first[0].get("content") == own
    return dataclasses.replace(cfg, task=dataclasses.replace(task, system_prompt=own if sent else ""))


def _yaml_lines(key: str, value: Any, indent: str = "") -> str:
    return "".join(indent + line + "\n" for line in yaml.safe_dump({key: value}, sort_keys=False).splitlines())


def config_yaml(cfg: RunConfig) -> str:
    """config.yaml: every setting, as ``to_yaml``, except that the task fields this run's task does not read come
    last in the task section, under a comment saying so (and a system prompt the task does not send says so).
    Comments only: ``load_config`` of the text gives ``cfg`` back exactly."""
    text = ""
    for key, value in to_dict(cfg).items():
        if key != "task":
            text += _yaml_lines(key, value)
            continue
        task = cfg.task
        unused = unused_task_fields(task)
        text += "task:\n"
        for name, v in value.items():
            if name in unused:
                continue
            if name == "system_prompt" and replaces_system_prompt(task):
                text += f"  # task {task.name} does not send this arithmetic default: it uses its own (or none)\n"
            text += _yaml_lines(name, v, "  ")
        if unused:
            text += f"  # unused by task {task.name} (settings of other tasks):\n"
            text += "".join(_yaml_lines(name, value[name], "  ") for name in unused)
    return text


def write_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(config_yaml(cfg), encoding="utf-8")


def _percent(accuracy: float | None) -> str:
    return "not measured" if accuracy is None else f"{100 * accuracy:.1f} %"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def model_card(cfg: RunConfig, state: dict, run_dir: Path, eval_size: int, date: datetime.date | None = None) -> str:
    """README.md of the saved adapter or model: base model, method, task, rewards, steps, held-out accuracy before
    and after (from the run ``state``), the command that reproduces the run, and the date (default: today, UTC)."""
    m, a, t = cfg.model, cfg.algo, cfg.train
    base = original_name(m.name)
    meta: dict[str, Any] = {"base_model": base} if m.name in OFFLINE_MODELS else {}  # a Hub id, never a local path
    meta |= {"library_name": "peft" if m.lora else "transformers", "pipeline_tag": "text-generation",
             "tags": ["rlvr", a.name, "reinforcement-learning"]}
    method = "GRPO" if a.name == "grpo" else a.name.upper()
    weights = f"LoRA r={m.lora_r}, alpha={m.lora_alpha:g}, on {', '.join(m.lora_targets)}" if m.lora else "all weights"
    values = {k: to_dict(getattr(cfg.task, k)) for k in TASK_FIELDS.get(cfg.task.name, ())}
    if replaces_system_prompt(cfg.task):
        values.pop("system_prompt", None)  # not what the prompts carry
    task = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in values.items())
    rewards = ", ".join(f"`{r.name}` × {r.weight:g}" + (f" {json.dumps(r.kwargs)}" if r.kwargs else "")
                        for r in cfg.rewards)
    before, after = _percent(state["eval_accuracy_before"]), _percent(state["eval_accuracy"])
    alias = (f" (as rlvr's offline alias `{m.name}`: weights de-quantised from a 4-bit GGUF, so they differ slightly "
             "from the Hub's)") if base != m.name else ""
    table = {
        "base model": f"`{base}`" + alias,
        "method": f"{method} with rlvr, preset `{a.preset}`; {weights}",
        "task": f"`{cfg.task.name}`" + (f": {task}" if task else ""),
        "rewards": f"{rewards} (the total is their weighted sum)",
        "steps": f"{t.steps} × {t.prompts_per_step} prompts × {cfg.rollout.group_size} completions each",
        "held-out accuracy": f"{before} before → {after} after (greedy, {eval_size} held-out prompts)",
        "date": (date or datetime.datetime.now(datetime.timezone.utc).date()).isoformat(),
    }
    if m.lora:
        load = ["from peft import PeftModel", "from transformers import AutoModelForCausalLM", "",
                f'base = AutoModelForCausalLM.from_pretrained("{base}")',
                f'model = PeftModel.from_pretrained(base, "{run_dir / "adapter"}")']
    else:
        load = ["from transformers import AutoModelForCausalLM", "",
                f'model = AutoModelForCausalLM.from_pretrained("{run_dir / "model"}")']
    kind = "a LoRA adapter for" if m.lora else "a fine-tune of"
    return "\n".join([
        "---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
        f"# {run_dir.name}: {kind} {base}", "",
        f"Trained with rlvr's {method} on verifiable rewards.", "",
        "| | |", "|---|---|", *(f"| {k} | {_cell(v)} |" for k, v in table.items()), "",
        "## Reproduce", "", "```bash", f"rlvr train {run_dir / 'config.yaml'}", "```", "",
        "Beside config.yaml, the run directory holds metrics.jsonl, samples.jsonl, summary.json and plot.png.", "",
        "## Load", "", "```python", *load, "```", "",
    ])
