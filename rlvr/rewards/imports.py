"""Import what a config names as ``package.module:attribute`` (a reward function, a checker, an environment class):
the folders searched first (``reward_search_path``) and every failure as one ``RewardImportError`` line."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlvr.rewards.base import RewardError


class RewardImportError(RewardError, ValueError):
    """A reward named in the config cannot be built: an unknown built-in, a module that is not found or fails to
    import, a missing function, or kwargs the function does not take. A ValueError too, as before."""


_extra_dirs: list[Path] = []  # set by reward_search_path; the working directory always comes first


def reward_search_path(dirs: Iterable[str | os.PathLike[str]] | None = None) -> tuple[Path, ...]:
    """The folders a ``module:function`` reward is imported from before ``sys.path``, in order; ``dirs`` (when
    given) replaces the folders set by an earlier call.

    The order is the working directory (always, as ``python -m`` and the interactive interpreter have it), then
    ``dirs`` - ``rlvr train`` and ``rlvr eval`` pass the config file's folder - then ``sys.path`` as it is
    (PYTHONPATH, installed packages, the folder of the script that is running). A run directory's
    ``config.yaml`` is a copy: its folder holds no reward module, so rerun it from the folder that holds the
    module, or put that folder on PYTHONPATH.

    While a reward module is imported these folders go at the front of ``sys.path`` (a file there wins over an
    installed package of the same name, as the script's folder does for ``python script.py``); afterwards they
    stay at the end of ``sys.path``, so the module's own later imports of its neighbours still find them, while
    no file in the working directory can shadow a library the trainer imports later. Returns the folders in effect.
    """
    if dirs is not None:
        _extra_dirs[:] = [Path(d).resolve() for d in dirs]
    return tuple(dict.fromkeys([Path.cwd().resolve(), *_extra_dirs]))


def _where(dirs: tuple[Path, ...]) -> str:
    named = {Path.cwd().resolve(): "the working directory"}
    return ", ".join(f"{d} ({named[d]})" if d in named else str(d) for d in dirs)


def _failed_at(err: BaseException) -> str:
    """' at file:line' where the module's import raised (outside the import machinery and this file), or ''."""
    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith("<frozen") and "importlib" not in Path(f.filename).parts
              and f.filename != __file__]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _import_module(name: str, module_name: str, what: str = "reward") -> Any:
    """Import ``module_name`` with the search folders at the front of sys.path (see ``reward_search_path``);
    errors name ``what`` (the setting) and ``name``."""
    if module_name in sys.modules:  # __main__, or imported already
        return sys.modules[module_name]
    dirs = reward_search_path()
    before, front = list(sys.path), [str(d) for d in dirs]
    sys.path[:] = front + [p for p in before if p not in front]  # the search folders first, for every import
    importlib.invalidate_caches()  # a file written after the interpreter started (tests, notebooks)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            file = module_name.replace(".", "/") + ".py"
            raise RewardImportError(
                f"{what} {name!r}: no module named {missing!r} in {_where(dirs)} or on sys.path; put {file} in "
                "the working directory or the config's folder, install the package that provides it, or add "
                "its folder to PYTHONPATH"
            ) from None
        raise RewardImportError(
            f"{what} {name!r}: importing module {module_name!r} failed{_failed_at(err)}: ModuleNotFoundError: "
            f"{err} (a module it imports is missing: install it)"
        ) from err
    except Exception as err:
        raise RewardImportError(
            f"{what} {name!r}: importing module {module_name!r} failed{_failed_at(err)}: {type(err).__name__}: {err}"
        ) from err
    finally:  # sys.path as it was, plus the folders last: the module's later imports of its neighbours still work,
        # and no local file shadows a library
        sys.path[:] = before + [d for d in front if d not in before]


def _public_callables(module: Any) -> list[str]:
    """Public functions and classes defined in ``module`` itself (not imported into it)."""
    return sorted(k for k, v in vars(module).items()
                  if not k.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__)


def import_object(name: str, what: str) -> Any:
    """The object ``package.module:attribute`` names (an environment class, a tool function), imported as reward
    modules are (``reward_search_path``); every failure is one ``RewardImportError`` line naming ``what``."""
    module_name, colon, attr = name.partition(":")
    if not colon or not module_name or not attr:
        raise RewardImportError(f"{what} {name!r}: write it as 'package.module:attribute'")
    module = _import_module(name, module_name, what)
    if not hasattr(module, attr):
        public = _public_callables(module)
        listing = f"its public callables: {', '.join(public)}" if public else "it defines no public callable"
        raise RewardImportError(f"{what} {name!r}: module {module_name!r} has no attribute {attr!r}; {listing}")
    return getattr(module, attr)
