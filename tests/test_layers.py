"""The package's layers: every import of rlvr (module level, inside functions, under TYPE_CHECKING) goes down the
declared order, so no two folders import each other. docs/reference/layout.md states the same order."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlvr"

# Bottom up. A unit (a folder of rlvr/, or a top-level module) imports only units of lower tiers.
TIERS = (
    ("core", "seeds", "faults", "memory", "offline_models", "trackers", "prompts", "verifiers", "bucket"),
    ("architecture", "checkpoint", "metrics", "envs"),
    ("models",),
    ("rollout", "rewards", "plan"),
    ("config",),
    ("tasks", "config_doc"),
    ("train",),
    ("serve", "baselines"),
    ("runtime",),
    ("launch", "api_inputs"),
    ("api",),
    ("cli", "__init__"),
    ("__main__",),
)
TIER = {unit: level for level, units in enumerate(TIERS) for unit in units}


def _unit(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> set[str]:
    """The rlvr units ``path`` imports (absolute imports; the package uses no relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("rlvr.")}
        found |= {"__init__" for n in names if n == "rlvr"}
    return found


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = _unit(path)
        graph.setdefault(unit, set()).update(_imports(path) - {unit})
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between units, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(unit: str, path: list[str]) -> list[str] | None:
        state[unit] = 1
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (found := visit(unit, [unit])):
            return found
    return None


def test_every_unit_has_a_tier():
    assert set(_graph()) <= set(TIER), f"add to TIERS: {sorted(set(_graph()) - set(TIER))}"


def test_no_folder_imports_upward_or_sideways():
    wrong = sorted(f"{unit} (tier {TIER[unit]}) imports {other} (tier {TIER[other]})"
                   for unit, others in _graph().items() for other in others if TIER[other] >= TIER[unit])
    assert not wrong, "\n".join(wrong)


def test_no_folder_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_checks_catch_a_cycle_and_an_upward_import():
    graph = {"train": {"runtime", "core"}, "runtime": {"train"}, "core": set()}
    assert _cycle(graph) == ["runtime", "train", "runtime"]
    assert _cycle({"train": {"core"}, "core": set()}) is None
    assert TIER["runtime"] > TIER["train"]  # so train -> runtime is reported as upward
