"""Reading a run configuration: YAML plus dotted ``key.sub=value`` overrides into the frozen sections of
rlvr/config/schema.py, and writing it back.

Unknown keys and ill-typed values are errors that name the key and what is allowed; checks across sections are in
``_validate``. ``algo.preset`` fills every algorithm knob the user did not set explicitly (``PRESETS``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlvr.config.algo import PRESETS, AlgoConfig
from rlvr.config.schema import RunConfig, TaskConfig


class ConfigError(ValueError):
    pass


# Keys that were removed: what to write instead (one line; no silent aliases).
REMOVED_KEYS = {"log.tensorboard": "list the trackers in log.trackers, e.g. log.trackers=[] for none"}
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_BOOL = {"true": True, "false": False}


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (types.UnionType, typing.Union, typing.Literal):  # a Literal's values: checked by the class
        return value
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    # A quoted number or boolean ("1", '1e-3', "true"; YAML 1.1 also reads 1e-3 as a string) is taken for what it
    # spells when the whole string is exactly one; anything else stays an error naming the key.
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value):
        return float(value)
    if tp is int and isinstance(value, str) and _INT.fullmatch(value):
        return int(value)
    if tp is bool and isinstance(value, str) and value.lower() in _BOOL:
        return _BOOL[value.lower()]
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    if tp is str and isinstance(value, (int, float)):
        return str(value)
    raise ConfigError(f"{key} must be {tp.__name__}, got {value!r}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        if key in REMOVED_KEYS:
            raise ConfigError(f"{key} was removed: {REMOVED_KEYS[key]}")
        section = f" in {prefix}" if prefix else ""
        raise ConfigError(f"unknown config key {key!r}; allowed keys{section}: {', '.join(names)}")
    shown = {"asynchronous": "async"}  # field names that differ from the config key users write
    values = {k: _convert(v, hints[k], f"{prefix}.{k}" if prefix else shown.get(k, k)) for k, v in data.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as err:  # a section's own check; its message starts with the field's name
        raise ConfigError(f"{prefix}.{err}" if prefix else str(err)) from None


def _validate(cfg: RunConfig) -> None:
    """Checks across sections, of the rewards list and of the task's combinations of keys (after build_config settles
    hf's eval_split); each section checks its own fields in ``__post_init__``."""
    distilled = cfg.distill.enabled and cfg.distill.reward_weight == 0  # the teacher is the signal: any group size
    if cfg.rollout.group_size < 2 and cfg.algo.name == "grpo" and not distilled:  # PPO's critic: any group size
        raise ConfigError(f"rollout.group_size must be >= 2; got {cfg.rollout.group_size}: GRPO scores each completion "
                          "against the others of its group, so a group of one has no signal (8 is usual)")
    if not cfg.rewards:
        raise ConfigError("rewards must list at least one reward function")
    trained = [r.name for r in cfg.rewards if r.weight > 0]
    unknown = [n for n in cfg.eval.gaming_rewards if n not in trained]
    if unknown:
        raise ConfigError(f"eval.gaming_rewards names {', '.join(map(repr, unknown))}, which is not a reward the run "
                          f"trains on (weight > 0): name some of {', '.join(map(repr, trained))}, or leave it empty to "
                          "watch them all")
    if cfg.algo.name == "ppo":
        if cfg.algo.beta != 0:
            raise ConfigError(f"algo.name=ppo puts the KL penalty in the reward (ppo.kl_coef), but algo.beta is "
                              f"{cfg.algo.beta} (preset {cfg.algo.preset}): use algo.preset=ppo, or set algo.beta=0")
        if cfg.algo.num_iterations != 1 or cfg.asynchronous.enabled or cfg.algo.dynamic_sampling:
            raise ConfigError("algo.name=ppo supports algo.num_iterations=1, synchronous runs and no dynamic "
                              "sampling (it is the memory baseline, not a second trainer)")
    a = cfg.asynchronous
    if a.enabled:
        if not cfg.model.lora:
            raise ConfigError("async.enabled=true ships LoRA adapters to the rollout servers; set model.lora=true")
        if not cfg.rollout.servers and a.servers < 1:
            raise ConfigError("async.enabled=true needs servers: async.servers >= 1, or rollout.servers=[URL, ...]")
    if cfg.rollout.backend == "vllm_colocate" and a.enabled:
        raise ConfigError("rollout.backend=vllm_colocate samples between the learner's steps, in its process; "
                          "async.enabled=true samples on rollout servers meanwhile: set one of them")
    if cfg.rollout.backend == "server":
        if not cfg.rollout.servers:
            raise ConfigError("rollout.backend=server needs rollout.servers=[URL, ...] (rlvr serve or vLLM servers)")
        if not cfg.model.lora:
            raise ConfigError("rollout.backend=server ships LoRA adapters to the servers after each update; set "
                              "model.lora=true (full weights cannot be hot-loaded over HTTP)")
    if cfg.diloco.learner or cfg.diloco.placement == "ray":
        if not cfg.diloco.bucket:
            raise ConfigError("diloco.learner needs diloco.bucket: the directory or URL the learners share")
        if a.enabled or cfg.algo.name == "ppo":
            raise ConfigError("diloco.learner runs the synchronous GRPO loop; set async.enabled=false and a GRPO "
                              "preset")
        if cfg.diloco.rollouts != "off" and (cfg.env.enabled or cfg.task.curriculum):
            raise ConfigError("diloco.rollouts shares single completions of the task's rows; episodes (env.*) and "
                              "task.curriculum are not shared yet: set diloco.rollouts=off")
    if cfg.distill.enabled:
        _validate_distill(cfg)
    t = cfg.task
    if t.eval_fraction and t.name not in ("jsonl", "math_jsonl", "code_jsonl", "hf"):
        raise ConfigError(f"task.eval_fraction splits the rows of a file or split (jsonl tasks, hf); task.name="
                          f"{t.name} makes its own held-out set (task.eval_size)")
    if t.curriculum and (a.enabled or cfg.algo.name == "ppo"):
        raise ConfigError("task.curriculum runs in the synchronous GRPO loop; set async.enabled=false (or drop the "
                          "curriculum)")
    if t.name.endswith("jsonl"):
        _validate_jsonl(t)
    if t.name in ("jsonl", "math_jsonl", "code_jsonl", "hf"):
        if t.prompt_template and t.prompt_column != "prompt":
            raise ConfigError("set task.prompt_column or task.prompt_template, not both")
        if t.answer_format != "raw" and not t.answer_column:
            raise ConfigError(f"task.answer_format={t.answer_format} reads task.answer_column; name the column")
    if t.name == "hf":
        _validate_hf(cfg)


def _validate_distill(cfg: RunConfig) -> None:
    if cfg.algo.name == "ppo" or cfg.diloco.learner or cfg.diloco.placement == "ray":
        raise ConfigError("distill.* adds the teacher's per-token advantage to GRPO's update on one learner; use a "
                          "GRPO preset without diloco.learner")
    if cfg.algo.dynamic_sampling:
        raise ConfigError("algo.dynamic_sampling drops groups whose rewards are all equal, which the teacher still "
                          "teaches; set algo.dynamic_sampling=false with distill.*")
    if cfg.distill.teacher == "self" and not cfg.model.lora:
        raise ConfigError("distill.teacher=self reads the base model under the student's LoRA adapter; set "
                          "model.lora=true (full fine-tuning keeps no copy of the starting weights)")
    if cfg.distill.hint and (cfg.env.enabled or cfg.asynchronous.enabled):
        raise ConfigError("distill.hint builds the teacher's prompt from the dataset row of each group, which the "
                          "synchronous loop of single completions keeps; unset env.* and async.enabled")
    r = cfg.rollout
    if r.top_p < 1 or r.top_k or r.temperature == 0:
        raise ConfigError(f"distillation compares the student's and the teacher's log-probs of tokens the student "
                          f"sampled from its whole distribution: set rollout.top_p=1, rollout.top_k=0 and a "
                          f"temperature > 0 (got top_p={r.top_p}, top_k={r.top_k}, temperature={r.temperature})")


def _validate_jsonl(t: TaskConfig) -> None:
    if t.eval_fraction:
        if not t.train_path or t.eval_path:
            raise ConfigError(f"task.eval_fraction={t.eval_fraction} holds out rows of task.train_path, so it needs "
                              "task.train_path and no task.eval_path (set one of eval_path and eval_fraction)")
    elif not (t.train_path and t.eval_path):
        raise ConfigError(f"task.name={t.name} needs task.train_path and task.eval_path (or task.eval_fraction to "
                          "hold out a share of the train_path rows)")
    if t.name == "math_jsonl" and not t.answer_column:
        raise ConfigError("task.name=math_jsonl needs the gold answer: set task.answer_column (or use task.name=jsonl)")


def _validate_hf(cfg: RunConfig) -> None:
    t = cfg.task
    if not t.source:
        raise ConfigError("task.name=hf needs task.source: a local parquet / arrow / json / jsonl / csv file or "
                          "directory, a save_to_disk directory, or a Hub dataset id")
    if t.eval_fraction and t.eval_split:
        raise ConfigError(f"task.eval_fraction={t.eval_fraction} holds out rows of task.train_split, and "
                          f"task.eval_split={t.eval_split!r} names a held-out split too: set one of them")
    if t.eval_split and t.eval_split == t.train_split:
        raise ConfigError(f"task.eval_split and task.train_split are both {t.eval_split!r}: held-out rows would be "
                          "trained on; name another split, or set task.eval_split='' to hold out task.eval_size rows")
    if t.eval_fraction and t.streaming:
        raise ConfigError("task.eval_fraction needs the length of the split, which task.streaming=true does not "
                          "know; set task.eval_split='' and task.eval_size instead")
    if t.streaming and t.train_size < 1:
        needed = cfg.train.steps * cfg.train.prompts_per_step
        raise ConfigError(f"task.streaming=true reads only the rows a run needs: set task.train_size (this run "
                          f"draws train.steps x train.prompts_per_step = {needed} prompts)")


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else "")
    return tree


class _TreeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses aliases (``*name``): each alias reuses a node, so 1 KB of them can make a graph
    of a billion nodes (an "alias bomb") that hangs whatever walks it, such as a resumed checkpoint's config.yaml
    compared with the run's. rlvr's configs never need one; without aliases the tree is no larger than the text."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise ConfigError(f"line {self.peek_event().start_mark.line + 1}: a YAML alias (*name); rlvr reads no "
                              "aliases or merge keys (<<: *name): write the values out in full")
        return super().compose_node(parent, index)


def load_yaml(text: str, source: str) -> Any:
    """The YAML value in ``text`` (``source`` names it in errors), without aliases: ``ConfigError`` for one."""
    try:
        return yaml.load(text, Loader=_TreeLoader)  # a SafeLoader: plain values only
    except ConfigError as err:  # an alias
        raise ConfigError(f"{source}, {err}") from None
    except yaml.YAMLError as err:  # malformed: one line naming where
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{source} is not valid YAML{where}: {what}; fix that line (indentation, a ':' or a "
                          "quote)") from None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_config(data: dict) -> RunConfig:
    """A validated RunConfig from a nested dict; the algo preset fills knobs not given explicitly."""
    data = dict(data)
    if "async" in data:  # a Python keyword, so the field is named asynchronous
        data["asynchronous"] = _merge(data.get("asynchronous") or {}, data.pop("async") or {})
    algo = dict(data.get("algo") or {})
    preset = algo.get("preset", "ppo" if algo.get("name") == "ppo" else AlgoConfig.preset)
    algo["preset"] = preset  # an unknown preset fills nothing; AlgoConfig names the presets
    if algo.get("ratio_to") == "behaviour":  # the ratio is the correction: no importance weight unless asked
        algo.setdefault("is_level", "none")
    data["algo"] = {**PRESETS.get(preset, {}), **algo}
    cfg = _build(RunConfig, data, "")
    task = data.get("task") if isinstance(data.get("task"), dict) else {}
    if cfg.task.name == "hf" and cfg.task.eval_fraction and "eval_split" not in task:  # from train_split, not test
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, eval_split=""))
    _validate(cfg)
    _check_explicit(cfg, data)
    return cfg


def _check_explicit(cfg: RunConfig, data: dict) -> None:
    """Checks that depend on what the config states rather than on the defaults it fell back to."""
    if "rewards" not in data and cfg.task.name != "arithmetic":
        fit = ("[{name: code_tests}] (the completion's code run against the row's tests)" if cfg.task.name ==
               "code_jsonl" else "[{name: math_correct}] (the final answer against the answer column, via math-verify)")
        raise ConfigError(f"task.name={cfg.task.name} lists no rewards, and the default, arithmetic_correct, fits only "
                          f"task.name=arithmetic: list the reward that scores your answers, e.g. rewards: {fit}, or "
                          "your own function: rewards: [{name: 'my_module:my_reward'}]")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        data = load_yaml(path.read_text(), str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a YAML mapping")
    return build_config(_merge(data, parse_overrides(list(overrides))))


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {("async" if f.name == "asynchronous" else f.name): to_dict(getattr(cfg, f.name))
                for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flatten(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def config_changes(old_yaml: str, cfg: RunConfig) -> list[str]:
    """``key old -> new`` for every setting of ``cfg`` that differs from a saved config (output_dir, resume and
    import_dirs excluded); a key the old config lacks counts as changed from its default."""
    old = _flatten(load_yaml(old_yaml, "the checkpoint's config.yaml") or {})
    new = _flatten(to_dict(cfg))
    return [f"{k} {old.get(k, '(unset)')} -> {v}" for k, v in new.items()
            if k not in ("output_dir", "resume", "import_dirs") and old.get(k) != v]


def save_config(cfg: RunConfig, path: Path) -> None:
    path.write_text(to_yaml(cfg))
