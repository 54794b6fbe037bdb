"""What ``GRPOTrainer`` (rlvr/api.py) makes of a user's Python objects: dataset rows checked as TRL reads them and
written as JSONL, and reward functions, tools and environment classes named by where ``rlvr train`` can import
them (``module:name`` in config.yaml), with why not when it cannot."""

from __future__ import annotations

import functools
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from rlvr.envs.environment import load_environment
from rlvr.rewards import BUILTINS, build_reward
from rlvr.rewards.judge import Judge
from rlvr.rewards.reward_model import SEQ_CLS, find_reward_model, reward_model
from rlvr.run.scoring import EnvironmentObjects, Tools

IN_MAIN = "it is defined in the script (or notebook) that is running"


def dataset_rows(dataset: Any, what: str, prompt_only: bool) -> list[dict]:
    """Rows of a ``datasets.Dataset`` or a list of dicts, checked as TRL's GRPOTrainer reads them."""
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(dataset, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise ValueError(f"GRPOTrainer: {what} is an IterableDataset; rlvr writes the rows to a file first: pass a "
                         "datasets.Dataset (e.g. without streaming=True) or a list of dicts")
    if isinstance(dataset, dict):
        splits = f" (its splits: {', '.join(map(str, dataset))})" if datasets and isinstance(
            dataset, datasets.DatasetDict) else ""
        raise TypeError(f"GRPOTrainer: {what} is a mapping{splits}; pass one split, e.g. dataset['train']")
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):
        rows = dataset.to_list()
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise ValueError(f"GRPOTrainer: {what} must be a datasets.Dataset or a list of dicts; got "
                         f"{type(dataset).__name__}")
    if not rows:
        raise ValueError(f"GRPOTrainer: {what} has no rows")
    columns = None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"GRPOTrainer: {what} row {i} is a {type(row).__name__}, not a dict")  # noqa: TRY004
        if "prompt" not in row:
            raise ValueError(f"GRPOTrainer: {what} row {i} has no 'prompt' column (columns: {', '.join(row)}); "
                             "GRPO reads the prompt from it: a string, or chat messages [{'role', 'content'}, ...]")
        if columns is None:
            columns = list(row)
        elif set(row) != set(columns):
            missing, extra = sorted(set(columns) - set(row)), sorted(set(row) - set(columns))
            raise ValueError(f"GRPOTrainer: {what} row {i} has other columns than row 0 (missing {missing}, extra "
                             f"{extra}); every row needs the same columns, since reward functions receive them all")
        check_prompt(row["prompt"], f"{what} row {i}")
    return [{"prompt": r["prompt"]} for r in rows] if prompt_only else rows


def check_prompt(prompt: Any, where: str) -> None:
    if isinstance(prompt, str) and prompt.strip():
        return
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return
    raise ValueError(f"GRPOTrainer: {where}: the prompt must be a non-empty string or chat messages "
                     f"[{{'role': ..., 'content': '...'}}, ...] with text content; got {prompt!r:.80}")


def dataset_jsonl(rows: list[dict], what: str) -> str:
    lines = []
    for i, row in enumerate(rows):
        try:
            lines.append(json.dumps(row, ensure_ascii=False))
        except (TypeError, ValueError):
            bad = next((k for k, v in row.items() if not json_ok(v)), "?")
            raise ValueError(f"GRPOTrainer: {what} row {i}, column {bad!r}: a {type(row.get(bad)).__name__} cannot be "
                             "written to JSON; rlvr writes the dataset to a JSONL file, so columns must hold text, "
                             "numbers, booleans, None, lists or dicts of them") from None
    return "\n".join(lines) + "\n"


def json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def reward_entry(fn: Any, i: int) -> tuple[str, dict, Any, str]:
    """(name for config.yaml, kwargs, the function to call, why it cannot be imported by that name or '')."""
    where = f"reward_funcs[{i}]"
    if isinstance(fn, str):  # an unknown built-in, a module that does not import, a missing function: one line now
        if fn not in BUILTINS and ":" not in fn and (path := find_reward_model(fn)) is not None:
            model = str(path.resolve()) if Path(fn).expanduser().is_dir() else fn  # TRL's reward model by path
            return "reward_model", {"model": model}, build_reward("reward_model", {"model": model}), ""
        return fn, {}, build_reward(fn), ""
    if isinstance(fn, functools.partial) and not fn.args:
        name, kwargs, _, why = reward_entry(fn.func, i)
        if not why and not json_ok(fn.keywords):
            why = "its bound keyword arguments cannot be written to config.yaml"
        return name, {**kwargs, **fn.keywords}, fn, why
    if hasattr(fn, "forward") and hasattr(fn, "parameters"):
        return model_entry(fn, where)
    if not callable(fn):
        raise TypeError(f"GRPOTrainer: {where} must be a function, a built-in reward's name "
                        f"({', '.join(sorted(BUILTINS))}) or 'module:function'; got {type(fn).__name__}")
    name, why = callable_name(fn)
    return name, {}, fn, why


def model_entry(model: Any, where: str) -> tuple[str, dict, Any, str]:
    """A reward model object (TRL takes a PreTrainedModel in reward_funcs): scored in process where it is, and
    named in config.yaml by its ``name_or_path`` (the directory or cached Hub id it was loaded from)."""
    if not type(model).__name__.endswith(SEQ_CLS) or not hasattr(model, "config"):
        raise ValueError(f"GRPOTrainer: {where} is a model ({type(model).__name__}) but not a reward model: pass an "
                         "AutoModelForSequenceClassification with num_labels=1, its directory, or a function "
                         "f(prompts, completions, **columns) -> list[float | None]")
    source = str(getattr(model, "name_or_path", "") or "")
    path = find_reward_model(source)
    if path is None:
        raise ValueError(f"GRPOTrainer: {where} is a {type(model).__name__} whose name_or_path ({source!r}) is not a "
                         "directory holding it and its tokenizer; save both with save_pretrained(DIR) and pass DIR")
    name = str(path.resolve()) if Path(source).expanduser().is_dir() else source
    return "reward_model", {"model": name}, reward_model(model), ""


def callable_name(obj: Any) -> tuple[str, str]:
    """(``module:qualname`` for config.yaml, why ``rlvr train`` could not import it by that name, or '')."""
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None:  # a callable object
        return f"{module}:{type(obj).__qualname__}()", "it is a callable object, not a function"
    name = f"{module}:{qualname}"
    if "<" in qualname or "." in qualname:
        return name, "it is a lambda, a nested function or a method"
    if getattr(sys.modules.get(module), qualname, None) is not obj:
        return name, f"{module}.{qualname} is not that object"
    return name, IN_MAIN if module == "__main__" else ""


def environment_objects(tools: Any, factory: Any, max_completion_length: int,
                        max_tool_calling_iterations: int | None) -> tuple[EnvironmentObjects | None, dict]:
    """TRL's ``tools`` and ``environment_factory`` as rlvr's environment objects, validated now, and the env section
    recording them by name."""
    tools = list(tools or [])
    if not tools and factory is None:
        return None, {}
    if factory is not None and not callable(factory):
        raise TypeError(f"GRPOTrainer: environment_factory must be a class or function, got {type(factory).__name__}")
    for i, tool in enumerate(tools):
        if not callable(tool) or isinstance(tool, str):
            raise TypeError(f"GRPOTrainer: tools[{i}] must be a function with type hints and a docstring, got "
                            f"{type(tool).__name__}")
    load_environment(factory or Tools, tools)  # schemas, reset, get_reward: one-line errors now, not at train()
    named = [callable_name(t) for t in tools] + ([callable_name(factory)] if factory is not None else [])
    unnamed = [f"{name} ({why})" for name, why in named if why]
    if unnamed:
        warnings.warn(f"rlvr: config.yaml cannot name {'; '.join(unnamed)} in a form `rlvr train` can import; this "
                      "run uses them as they are", UserWarning, stacklevel=3)
    env = {"tools": [name for name, _ in named[: len(tools)]], "max_episode_tokens": max_completion_length}
    if factory is not None:
        env["factory"] = named[-1][0]
    if max_tool_calling_iterations is not None:
        env["max_turns"] = max_tool_calling_iterations + 1
    return EnvironmentObjects(factory, tuple(tools)), env


def held_out_check(entries: list[tuple[str, dict, Any, str]]) -> str:
    """The reward whose 1.0 counts as correct in held-out accuracy: the first one rlvr can build again by name;
    '' when every reward is a reward model or a judge (no correctness check: accuracy is not measured)."""
    for name, kwargs, _, why in entries:
        # __main__:fn imports in this process, where the run evaluates; no_reward checks nothing
        if name != "no_reward" and not kwargs and why in ("", IN_MAIN):
            return name
    if all(name in ("reward_model", "judge", "no_reward") or isinstance(fn, Judge) for name, _, fn, _ in entries):
        return ""
    raise ValueError(
        "GRPOTrainer: rlvr measures accuracy before and after training with a reward function it can import by name "
        "(the first of reward_funcs that it can: a completion is correct when it scores 1.0), and none of "
        f"{[e[0] for e in entries]} can be (lambdas, nested functions, callable objects and functools.partial cannot, "
        "and a reward model's score is no correctness check); "
        "define your correctness reward at the top level of a module or script and list it first")
