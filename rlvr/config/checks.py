"""The checks config sections run on their own fields, each message starting with the field's name (the config
loader prefixes the section): a ``Literal[...]`` field holds one of its values; a count is at least its bound."""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal


@functools.cache
def choices(cls: type) -> dict[str, tuple]:
    """The allowed values of each field of ``cls`` typed ``Literal[...]``."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


def check_choices(section: Any) -> None:
    """Each field of ``section`` typed ``Literal[...]`` holds one of its values."""
    for name, allowed in choices(type(section)).items():
        if getattr(section, name) not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(section, name)!r}")


def at_least(section: Any, low: float, *names: str) -> None:
    """Each of ``names`` is >= ``low``."""
    for name in names:
        if getattr(section, name) < low:
            raise ValueError(f"{name} must be >= {low}; got {getattr(section, name)}")


def switch(section: Any, name: str) -> None:
    """Field ``name`` is auto, true or false (the strings 'true' / 'false' become booleans)."""
    value = getattr(section, name)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        object.__setattr__(section, name, value.lower() == "true")
    elif value not in ("auto", True, False) or isinstance(value, int) and not isinstance(value, bool):
        raise ValueError(f"{name} must be auto, true or false; got {value!r}")
