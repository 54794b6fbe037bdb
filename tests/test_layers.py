"""The package's layers: every import of rlvr (module level, inside functions, under TYPE_CHECKING) goes down the
declared order, so no two folders import each other, and no two modules import each other either.
docs/reference/layout.md states the same order."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlvr"

# Bottom up: the package's folders (and the entry points at its root). A unit imports only units of lower tiers.
TIERS = (
    ("core", "platform", "verifiers"),
    ("store", "models", "envs"),
    ("rollout",),
    ("rewards",),  # judges and served reward models use the rollout's HTTP client
    ("config",),
    ("tasks",),
    ("learn",),
    ("run", "serve"),
    ("runtime",),
    ("trl_api", "launch"),
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


def _module_name(path: Path) -> str:
    """``rlvr.x.y`` for rlvr/x/y.py; a package's ``__init__.py`` is the package itself: ``rlvr.x``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(source: str, modules: set[str]) -> set[str]:
    """The rlvr modules a module's ``source`` imports: ``import rlvr.x.y`` imports ``rlvr.x.y``; ``from rlvr.x import
    z`` imports ``rlvr.x.z`` when z is one of ``modules``, else ``rlvr.x`` (z is a name it defines). Importing a
    package imports its ``__init__.py``. The parents of a named module are not counted: their ``__init__.py`` runs
    first, but it imports the module back only if it names it, which is an edge of its own."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rlvr":
            named = {f"{node.module}.{a.name}" for a in node.names}
            found |= named & modules
            found |= {node.module} if named - modules else set()
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "rlvr"}
    return found


def _module_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _imported_modules(path.read_text(), set(paths)) - {name} for name, path in paths.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """``start`` and the modules it imports, directly or through others."""
    found, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in found:
                found.add(nxt)
                todo.append(nxt)
    return found


def _module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle in each group of two or more modules that import each other (a strongly connected component)."""
    reach = {name: _reachable(graph, name) for name in graph}
    cycles, seen = [], set()
    for name in sorted(graph):
        if name in seen:
            continue
        component = {m for m in reach[name] if name in reach.get(m, ())}
        seen |= component
        if len(component) > 1:
            cycles.append(_cycle({m: graph[m] & component for m in component}))
    return cycles


def test_every_unit_has_a_tier():
    assert set(_graph()) <= set(TIER), f"add to TIERS: {sorted(set(_graph()) - set(TIER))}"


def test_no_folder_imports_upward_or_sideways():
    wrong = sorted(f"{unit} (tier {TIER[unit]}) imports {other} (tier {TIER[other]})"
                   for unit, others in _graph().items() for other in others if TIER[other] >= TIER[unit])
    assert not wrong, "\n".join(wrong)


def test_no_folder_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_no_module_cycle():
    """A package's ``__init__.py`` that re-exports from its submodules is imported by none of them: a submodule
    imports its sibling modules directly (``from rlvr.rollout.engine import SamplingParams``, not ``from
    rlvr.rollout import SamplingParams``)."""
    cycles = _module_cycles(_module_graph())
    assert not cycles, "modules that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_catch_a_cycle_and_an_upward_import():
    graph = {"run": {"runtime", "core"}, "runtime": {"run"}, "core": set()}
    assert _cycle(graph) == ["run", "runtime", "run"]
    assert _cycle({"run": {"core"}, "core": set()}) is None
    assert TIER["runtime"] > TIER["run"] > TIER["learn"]  # so run -> runtime and learn -> run are reported as upward


def test_the_module_graph_counts_every_form_of_import():
    modules = {"rlvr", "rlvr.rollout", "rlvr.rollout.engine", "rlvr.rollout.groups", "rlvr.run.loop"}
    source = ("from typing import TYPE_CHECKING\n"
              "import rlvr.rollout.engine\n"
              "from rlvr.rollout import Groups, groups\n"
              "def f():\n    from rlvr.run.loop import run_loop\n"
              "if TYPE_CHECKING:\n    import rlvr\n")
    assert _imported_modules(source, modules) == {"rlvr.rollout.engine", "rlvr.rollout", "rlvr.rollout.groups",
                                                  "rlvr.run.loop", "rlvr"}
    assert _imported_modules("from rlvr.rollout.engine import SamplingParams\n", modules) == {"rlvr.rollout.engine"}
    assert _imported_modules("from rlvr.rollout import groups\n", modules) == {"rlvr.rollout.groups"}


def test_the_module_check_reports_each_cycle_once():
    graph = {
        "rlvr.rollout": {"rlvr.rollout.engine"},  # an __init__ re-exporting from its submodule ...
        "rlvr.rollout.engine": {"rlvr.rollout"},  # ... which imports the __init__: a cycle
        "rlvr.a": {"rlvr.b"},
        "rlvr.b": {"rlvr.a", "rlvr.c"},
        "rlvr.c": set(),
    }
    assert _module_cycles(graph) == [["rlvr.a", "rlvr.b", "rlvr.a"],
                                     ["rlvr.rollout", "rlvr.rollout.engine", "rlvr.rollout"]]
    assert _module_cycles({"rlvr.rollout": {"rlvr.rollout.engine"}, "rlvr.rollout.engine": set()}) == []
