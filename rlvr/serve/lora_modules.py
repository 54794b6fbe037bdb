"""``rlvr serve --lora-modules``: adapters the operator names at start, as vLLM's flag takes them, and the one line
for an adapter folder given as the model.

Each argument is ``NAME=PATH`` or a JSON object ``{"name": NAME, "path": PATH, "base_model_name": BASE}`` (vLLM's
two forms; ``base_model_name``, when given, must name the model this server serves: it serves one). PATH is a
local adapter folder (what ``save_pretrained`` or an rlvr run writes: adapter_config.json and
adapter_model.safetensors); it is checked before the model loads, and its folder is added to the allowed adapter
roots (the operator named it). Clients then ask for the adapter by NAME, as for one loaded over HTTP."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from rlvr.serve.admission import EngineError
from rlvr.serve.engine import check_adapter_files

MAX_NAME_CHARS = 256


def _shown(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:200])


def parse_lora_modules(specs: Sequence[str], served_names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(name, absolute path) per ``--lora-modules`` argument, each checked: ValueError in one line otherwise."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, path = _one(spec.strip(), served_names)
        if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise ValueError(f"--lora-modules {_shown(spec)}: NAME must be 1-{MAX_NAME_CHARS} printable characters")
        if name in served_names:
            raise ValueError(f"--lora-modules {_shown(name)}: that is the base model's name; choose another")
        if name in modules:
            raise ValueError(f"--lora-modules names {_shown(name)} twice; give each adapter its own name")
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--lora-modules {_shown(name)}={_shown(path)}: no such folder; give the folder that "
                             "holds adapter_config.json and adapter_model.safetensors")
        try:
            check_adapter_files(folder)
        except EngineError:
            raise ValueError(f"--lora-modules {_shown(name)}={_shown(path)}: no readable LoRA adapter there "
                             "(adapter_config.json and adapter_model.safetensors; details above)") from None
        modules[name] = os.path.realpath(folder)
    return tuple(modules.items())


def _one(spec: str, served_names: Sequence[str]) -> tuple[str, str]:
    if not spec.startswith("{"):
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules {_shown(spec)}: write NAME=PATH (e.g. --lora-modules "
                             'math=runs/gsm/adapter) or JSON {"name": "math", "path": "runs/gsm/adapter"}')
        return name.strip(), path.strip()
    try:
        data = json.loads(spec)
    except (ValueError, RecursionError):
        raise ValueError(f"--lora-modules {_shown(spec)}: not valid JSON; write NAME=PATH or "
                         '{"name": NAME, "path": PATH}') from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
        raise ValueError(f"--lora-modules {_shown(spec)}: the JSON form needs string fields \"name\" and \"path\"")  # noqa: TRY004
    base = data.get("base_model_name")
    if base is not None and base not in served_names:
        raise ValueError(f"--lora-modules {_shown(data['name'])}: base_model_name {_shown(str(base))!r} is not the "
                         f"model this server serves ({_shown(served_names[0])}); leave it out or name that model")
    return data["name"], data["path"]


def refuse_adapter_as_model(model: str) -> None:
    """ValueError in one line when ``model`` is a LoRA adapter's folder rather than a model's."""
    folder = Path(model).expanduser()
    if not (folder / "adapter_config.json").is_file() or (folder / "config.json").exists():
        return
    base = "BASE_MODEL"
    try:
        with (folder / "adapter_config.json").open("rb") as f:
            named = json.loads(f.read(1 << 20)).get("base_model_name_or_path")
        if isinstance(named, str) and named.strip():
            base = _shown(named.strip())
    except (OSError, ValueError, RecursionError, AttributeError):
        pass
    raise ValueError(f"{_shown(model)} is a LoRA adapter, not a model: serve its base model with --lora-modules "
                     f"NAME=PATH, e.g. rlvr serve {base} --lora-modules {_shown(folder.name or 'adapter')}="
                     f"{_shown(model)}")
