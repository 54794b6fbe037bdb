"""The config's documentation, read from the code: every section and key with its type, default and docstring.

A field's docstring is the string literal right after the field in the body of the class that defines it. The
reader walks each section's MRO, so a field inherited from a base class, or a section whose class lives in another
module (rlvr.core, for instance), is read from that class's own source. ``rlvr config [SECTION | SECTION.KEY]``
prints it as text (``describe``); scripts/config_reference.py writes it as docs/reference/config.md.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing

import yaml

from rlvr.config.loading import ConfigError, to_dict
from rlvr.config.schema import PRESETS, RunConfig

YAML_KEYS = {"asynchronous": "async"}  # field names that differ from the key written in YAML and overrides


@dataclasses.dataclass(frozen=True)
class Field:
    key: str  # dotted key as written in overrides: algo.eps_low, rewards[].name
    type: str
    default: str
    doc: str
    owner: type  # the class whose body defines the field


@dataclasses.dataclass(frozen=True)
class Section:
    key: str  # as written in YAML: algo, async, rewards; "top level" for the keys outside any section
    doc: str  # the RunConfig field's docstring
    cls: type | None  # the section's dataclass; None for the top level
    fields: list[Field]

    @property
    def is_list(self) -> bool:
        """A list of items (rewards): its keys are written ``rewards[].name``."""
        return bool(self.fields) and self.fields[0].key.startswith(f"{self.key}[].")


@functools.cache
def _own_docstrings(cls: type) -> dict[str, str]:
    """Attribute docstrings in the body of ``cls`` itself: {field name: docstring}."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    node = next((n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)), None)
    if node is None:
        return {}
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def field_doc(cls: type, name: str) -> tuple[str, type]:
    """The docstring of field ``name`` of dataclass ``cls`` and the class that defines the field (the first class
    in the MRO whose body annotates it; a docstring is taken from the first class in the MRO that has one)."""
    owner = next((k for k in cls.__mro__ if name in vars(k).get("__annotations__", {})), cls)
    doc = next((d for k in cls.__mro__ if (d := _own_docstrings(k).get(name))), "")
    return doc, owner


def type_name(tp: typing.Any) -> str:
    """A type as a config user writes it: str (a, b) for a choice, list[...], mapping, null."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"str ({', '.join(str(a) for a in args)})"
    if origin is tuple:
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if tp is typing.Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def value_text(value: typing.Any) -> str:
    """A value as written in YAML (flow style for lists and mappings; '' for the empty string)."""
    if dataclasses.is_dataclass(value) or isinstance(value, (tuple, list, dict)):
        value = to_dict(value)
        if isinstance(value, dict) and not value:
            return "{}"
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value if value else "''"
    return repr(value)


def _default(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def section_fields(cls: type, prefix: str, instance: typing.Any = None) -> list[Field]:
    """One row per field of dataclass ``cls``; ``prefix`` is the section's key (``algo``, ``rewards[]``). Defaults
    are those of ``instance`` when given (the section of ``RunConfig()``: algo's knobs as the default preset sets
    them), else the fields' own."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else YAML_KEYS.get(f.name, f.name)
        tp = type_name(hints.get(f.name, f.type))  # a Literal's values included
        default = _default(f) if instance is None else getattr(instance, f.name)
        doc, owner = field_doc(cls, f.name)
        rows.append(Field(key, tp, "(required)" if default is dataclasses.MISSING else value_text(default), doc, owner))
    return rows


def sections() -> list[Section]:
    """Every section in RunConfig order, the keys outside any section first (as "top level")."""
    hints = typing.get_type_hints(RunConfig)
    top, out = [], []
    for f in dataclasses.fields(RunConfig):
        tp, key = hints[f.name], YAML_KEYS.get(f.name, f.name)
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out.append(Section(key, field_doc(RunConfig, f.name)[0], tp,
                               section_fields(tp, key, getattr(RunConfig(), f.name))))
        elif typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
            out.append(Section(key, field_doc(RunConfig, f.name)[0], args[0],
                               section_fields(args[0], f"{key}[]")))
        else:
            top.extend(r for r in section_fields(RunConfig, "") if r.key == key)
    return [Section("top level", "Keys outside any section.", None, top), *out]


def all_fields() -> list[Field]:
    return [row for section in sections() for row in section.fields]


def list_default(section: Section) -> str:
    """The default of a list section (rewards) as a whole."""
    name = {v: k for k, v in YAML_KEYS.items()}.get(section.key, section.key)
    return value_text(getattr(RunConfig(), name))


# ---- text for `rlvr config` ----

WIDTH = 100


def _wrap(text: str, indent: int) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * indent) or []


def _presets_of(key: str) -> str:
    """'grpo 0.04, dapo 0.0, ...' for an algo key that the presets set, else ''."""
    section, _, name = key.partition(".")
    presets = PRESETS
    if section != "algo" or not any(name in values for values in presets.values()):
        return ""
    return ", ".join(f"{p} {value_text(values[name])}" for p, values in presets.items() if name in values)


def _field_text(f: Field) -> list[str]:
    lines = [f"  {f.key}: {f.type} = {f.default}"]
    if presets := _presets_of(f.key):
        lines += _wrap(f"set by algo.preset unless the config sets it: {presets}", 6)
    return lines + _wrap(f.doc, 6)


def _section_text(s: Section) -> list[str]:
    lines = _wrap(f"{s.key}: {s.doc}" if s.doc else s.key, 0)
    if s.is_list:
        lines += _wrap(f"A list; each item has the keys below (written {s.key}[].KEY here). Default: "
                       f"{list_default(s)}.", 2)
    if s.cls is not None and s.key == "algo" and PRESETS:
        lines += _wrap(f"algo.preset ({', '.join(PRESETS)}; grpo unless algo.name=ppo) sets each key "
                       "marked 'set by algo.preset' that the config does not set itself; the value after = is the "
                       "one no preset sets.", 2)
    for f in s.fields:
        lines += _field_text(f)
    return lines


def _section_key(target: str) -> str:
    return "top level" if target in ("top", "top-level", "top level") else target


def describe(target: str = "") -> str:
    """``rlvr config`` (every section), ``rlvr config SECTION`` or ``rlvr config SECTION.KEY`` as text; a
    ConfigError naming the sections or keys when ``target`` matches none."""
    secs = sections()
    if not target:
        head = ("Every config key: type = default, then what it does. Set a key in the YAML file, or on the command "
                "line as a dotted override (rlvr train CONFIG algo.beta=0.1). One section: rlvr config SECTION; one "
                "key: rlvr config SECTION.KEY. The same as docs/reference/config.md.")
        return "\n".join(_wrap(head, 0) + [line for s in secs for line in ["", *_section_text(s)]]) + "\n"
    by_key = {s.key: s for s in secs}
    key = _section_key(target.strip())
    if key in by_key:
        return "\n".join(_section_text(by_key[key])) + "\n"
    fields = {f.key: f for f in all_fields()}
    fields.update({f.key.replace("[].", "."): f for f in fields.values() if "[]." in f.key})  # rewards.name too
    if key in fields:
        return "\n".join(_field_text(fields[key])) + "\n"
    section = key.partition(".")[0]
    close = difflib.get_close_matches(key, sorted(fields) + sorted(by_key), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    if section in by_key:
        known = ", ".join(f.key for f in by_key[section].fields)
        raise ConfigError(f"no config key {target!r}{hint} (the keys of {section}: {known})")
    raise ConfigError(f"no config section or key {target!r}{hint} (sections: {', '.join(by_key)})")
