"""The README's library example runs (on the tiny model, 2 steps), every example config is valid, the generated
config reference is current and every config field has a docstring, and relative links in the docs resolve."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from rlvr.config.loading import load_config

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


def _config_reference():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_layout_reference_is_current():
    """docs/reference/layout.md's layers and file list come from tests/test_layers.py's TIERS and the modules'
    docstrings (one source)."""
    spec = importlib.util.spec_from_file_location("layout_reference", ROOT / "scripts" / "layout_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "reference" / "layout.md").read_text()
    if module.updated(page) != page:
        pytest.fail("docs/reference/layout.md is stale: run python scripts/layout_reference.py", pytrace=False)
    for level_units in module.TIERS:  # every unit of the layers is in the package, so the page lists it
        for unit in level_units:
            assert (ROOT / "rlvr" / unit).is_dir() or (ROOT / "rlvr" / f"{unit}.py").is_file(), unit


def test_config_reference_is_current():
    path = ROOT / "docs" / "reference" / "config.md"
    expected = _config_reference().render()
    if not path.is_file() or path.read_text() != expected:
        pytest.fail("docs/reference/config.md is stale (the config's fields or their docstrings changed): "
                    "run python scripts/config_reference.py", pytrace=False)


def test_every_config_field_has_a_docstring():
    missing = [f"{row.key} ({row.owner.__module__}.{row.owner.__qualname__})"
               for row in _config_reference().all_fields() if not row.doc.strip()]
    assert not missing, ("config fields without a docstring (a string literal right after the field in its class): "
                         + ", ".join(missing))


def _markdown_files():
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    """Every relative link and image in the README, BENCHMARKS.md and docs/ points at a file that exists, and at a
    heading of a markdown file when it names one (web addresses are not checked)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code blocks hold no links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file) if file else path
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)):
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: links to missing files or headings: {broken}"
