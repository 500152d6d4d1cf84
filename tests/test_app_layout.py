"""The package layout stays one a newcomer can read: layers that import only downwards
(heads < datamodules < tasks < app; ``heads`` pure PyTorch), a thin app/ top level, no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.shell import ROOT

PACKAGES = ("app", "datamodules", "heads", "tasks")
#: The layers, lowest first: a module may import its own layer and those below it.
LAYERS = ("heads", "datamodules", "tasks", "app")
#: Upward imports that the checkpoint-path restructuring (issue 53, item 4) removes; each one
#: listed must still exist, so the entry goes with the import.
PENDING_UPWARD = {"tasks.base imports app.checkpoint_io.reading"}
MAX_APP_MODULES = 6


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_app_top_level_holds_at_most_six_modules():
    modules = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert len(modules) <= MAX_APP_MODULES, modules


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports, at module level or inside functions (a lazy import that
    closes a circle is still a circle); ``if TYPE_CHECKING:`` blocks are not imports."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_import_circle():
    paths = {module_name(p): p for p in sources()}
    known = set(paths)
    graph = {name: imported_modules(path, known) - {name} for name, path in paths.items()}
    # A package importing its own submodules (re-exports in __init__) is not a circle: a submodule
    # importing its parent package only means "import the package first".
    for name in graph:
        graph[name] = {target for target in graph[name] if not name.startswith(target + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_module_imports_from_a_higher_layer():
    paths = {module_name(p): p for p in sources()}
    known = set(paths)
    upward = []
    for name, path in sorted(paths.items()):
        level = LAYERS.index(name.split(".")[0])
        for target in sorted(imported_modules(path, known)):
            if LAYERS.index(target.split(".")[0]) > level:
                upward.append(f"{name} imports {target}")
    assert PENDING_UPWARD <= set(upward), f"no longer imported, remove from PENDING_UPWARD: {PENDING_UPWARD - set(upward)}"
    upward = [line for line in upward if line not in PENDING_UPWARD]
    assert not upward, "imports that run up a layer (" + " < ".join(LAYERS) + "):\n" + "\n".join(upward)


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_heads_never_import_lightning():
    """Not even inside a function: the heads are a PyTorch library (tests/test_heads_pure.py runs them)."""
    offenders = {str(p.relative_to(ROOT)): sorted(names) for p in sorted((ROOT / "heads").rglob("*.py"))
                 if (names := third_party_imports(p) & {"lightning", "pytorch_lightning"})}
    assert not offenders, f"heads/ files importing Lightning: {offenders}"
