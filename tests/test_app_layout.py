"""The package layout stays one a newcomer can read: small files, a thin app/ top level, no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.shell import ROOT

PACKAGES = ("app", "datamodules", "heads", "tasks")
MAX_LINES = 400
MAX_APP_MODULES = 6


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_source_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


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
