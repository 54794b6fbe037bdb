"""The README's library example runs (on the tiny model, 2 steps) and every example config is valid."""

import re
from pathlib import Path

import pytest

from rlvr.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_readme_library_example_runs(tiny_model_dir, capsys):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"## Library\n\n```python\n(.*?)```", readme, re.DOTALL).group(1)
    assert "smollm2-135m-instruct" in code and "range(20)" in code
    code = code.replace('"smollm2-135m-instruct"', repr(str(tiny_model_dir))).replace("range(20)", "range(2)")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})  # noqa: S102 (our own README)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("0 reward")


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    if cfg.task.name.endswith("jsonl"):
        from rlvr.tasks import load_task

        train, held_out, _ = load_task(cfg.task)
        assert train and held_out and len(held_out) <= cfg.task.eval_size
