#!/usr/bin/env python
"""Write docs/reference/config.md from the run config's dataclasses and their field docstrings.

    python scripts/config_reference.py           # rewrite docs/reference/config.md
    python scripts/config_reference.py --check   # exit 1 if docs/reference/config.md is stale

A field's docstring is the string literal right after the field in the body of the class that defines it. The
script walks each section's MRO, so a field inherited from a base class, or a section whose class lives in another
module (rlvr.core, for instance), is read from that class's own source. tests/test_docs.py checks that the file is
current and that every field has a docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import textwrap
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # works from a checkout without an install

from rlvr import config

OUT = ROOT / "docs" / "reference" / "config.md"
YAML_KEYS = {"asynchronous": "async"}  # field names that differ from the key written in YAML and overrides


@dataclasses.dataclass(frozen=True)
class Field:
    key: str  # dotted key as written in overrides: algo.eps_low, rewards[].name
    type: str
    default: str
    doc: str
    owner: type  # the class whose body defines the field


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


def _type_name(tp: typing.Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"str ({', '.join(str(a) for a in args)})"
    if origin is tuple:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if tp is typing.Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _value(value: typing.Any) -> str:
    if dataclasses.is_dataclass(value) or isinstance(value, (tuple, list, dict)):
        value = config.to_dict(value)
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


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def _default(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def section_fields(cls: type, prefix: str) -> list[Field]:
    """One row per field of dataclass ``cls``; ``prefix`` is the section's key (``algo``, ``rewards[]``)."""
    hints = typing.get_type_hints(cls)
    choices = getattr(config, "CHOICES", {})
    rows = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else YAML_KEYS.get(f.name, f.name)
        tp = _type_name(hints.get(f.name, f.type))
        if key in choices and "(" not in tp:
            tp = f"{tp} ({', '.join(str(c) for c in choices[key])})"
        default = _default(f)
        doc, owner = field_doc(cls, f.name)
        rows.append(Field(key, tp, "(required)" if default is dataclasses.MISSING else _value(default), doc, owner))
    return rows


def sections() -> list[tuple[str, str, type | None, list[Field]]]:
    """(key, the RunConfig field's docstring, section class or None for the top level, rows), in RunConfig order."""
    hints = typing.get_type_hints(config.RunConfig)
    top, out = [], []
    for f in dataclasses.fields(config.RunConfig):
        tp, key = hints[f.name], YAML_KEYS.get(f.name, f.name)
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out.append((key, field_doc(config.RunConfig, f.name)[0], tp, section_fields(tp, key)))
        elif typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
            out.append((key, field_doc(config.RunConfig, f.name)[0], args[0], section_fields(args[0], f"{key}[]")))
        else:
            top.extend(r for r in section_fields(config.RunConfig, "") if r.key == key)
    return [("top level", "Keys outside any section.", None, top), *out]


def all_fields() -> list[Field]:
    return [row for _, _, _, rows in sections() for row in rows]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _presets() -> list[str]:
    presets = getattr(config, "PRESETS", None)
    if not presets:
        return []
    knobs = list(dict.fromkeys(k for values in presets.values() for k in values))
    intro = ("`algo.preset` fills every `algo` key in this table that the config does not set itself (`PRESETS` in "
             "rlvr/config.py). With `algo.name: ppo` the default preset is `ppo`. A dash: the preset leaves the "
             "key at its default.")
    lines = ["## Presets", "", intro, "",
             "| key | " + " | ".join(f"`{p}`" for p in presets) + " |",
             "|---|" + "---|" * len(presets)]
    for knob in knobs:
        cells = [_cell(_value(presets[p][knob])) if knob in presets[p] else "-" for p in presets]
        lines.append(f"| `algo.{knob}` | " + " | ".join(cells) + " |")
    return lines + [""]


def render() -> str:
    """The whole of docs/reference/config.md."""
    secs = sections()
    intro = ("A run is configured by one YAML file plus dotted overrides on the command line "
             "(`rlvr train examples/demo.yaml algo.preset=dapo train.steps=40`). Every key below can be set either "
             "way. Unknown keys and ill-typed or out-of-range values stop the run with an error naming the key. The "
             "resolved config is written to `OUTPUT_DIR/config.yaml`; `rlvr train OUTPUT_DIR/config.yaml` runs it "
             "again.")
    lines = [
        "<!-- Generated by scripts/config_reference.py from the field docstrings; do not edit by hand. -->",
        "# Config reference",
        "",
        intro,
        "",
        "Sections: " + ", ".join(f"[{k}](#{k.replace(' ', '-')})" for k, _, _, _ in secs) + ", [presets](#presets).",
        "",
    ]
    for key, doc, cls, rows in secs:
        lines += [f"## {key}", "", doc]
        if cls is not None:
            owners = list(dict.fromkeys(r.owner for r in rows if r.owner is not cls))
            source = f"`{_qualname(cls)}`" + (
                f", with fields from {', '.join(f'`{_qualname(o)}`' for o in owners)}" if owners else "")
            if rows and rows[0].key.startswith(f"{key}[]."):
                default = _value(getattr(config.RunConfig(), {v: k for k, v in YAML_KEYS.items()}.get(key, key)))
                lines += ["", f"A list; each item has the keys below. Default: `{default}`."]
            lines += ["", f"Defined in {source}."]
        lines += ["", "| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{r.key}` | {_cell(r.type)} | `{_cell(r.default)}` | {_cell(r.doc)} |" for r in rows]
        lines.append("")
    lines += _presets()
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.is_file() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
