"""The modules of ``app/`` import each other in one direction: dispatch (``app.main``) on top, then
the commands (``app.cli``, ``app.demo``, the tools), then what they share. No circle, counting
imports inside functions (only ``app.cli.__getattr__``, which resolves ``app.cli.main`` for
scripts that import it from there, is left out)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = {id(node) for function in ast.walk(tree) if isinstance(function, ast.FunctionDef) and function.name == "__getattr__"
               for node in ast.walk(function)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "app":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "app")
    return {name for name in found if name in modules}


def test_app_modules_import_each_other_without_a_circle():
    paths = {module_name(p): p for p in (ROOT / "app").rglob("*.py")}
    graph = {name: imports_of(path, set(paths)) - {name} for name, path in paths.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import circle: " + " -> ".join(trail[trail.index(name):] + [name]))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
