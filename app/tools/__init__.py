"""The tool commands (``python -m app analyze|bench|convert MODE``): which module runs each mode.

Each module has ``main(argv) -> int`` and its own ``--help``; it is imported only when its mode runs."""

from __future__ import annotations

import importlib

#: tool -> mode -> the module that runs it.
TOOLS: dict[str, dict[str, str]] = {
    "analyze": {"experts": "app.analyze.experts", "floor": "app.analyze.floor", "rank": "app.analyze.rank"},
    "bench": {
        "ds": "app.bench.ds",
        "hanzi": "app.bench.hanzi",
        "heads": "app.bench.heads",
        "infer": "app.bench.infer",
        "lightrnn": "app.bench.lightrnn",
        "mitosis": "app.bench.mitosis",
        "train": "app.bench.train",
        "translation": "app.bench.translation",
    },
    "convert": {"ds": "app.convert.ds", "export": "app.convert.export"},
}


def run_tool(tool: str, argv: list[str]) -> int:
    """Run ``python -m app TOOL MODE ...``: the mode's ``main`` with the remaining arguments."""
    modes = sorted(TOOLS[tool])
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m app {tool} {{{','.join(modes)}}} [options]  (each mode has --help)")
        return 0
    mode = argv[0]
    if mode not in modes:
        raise ValueError(f"unknown {tool} mode {mode!r}: valid modes are {', '.join(modes)}")
    return int(importlib.import_module(TOOLS[tool][mode]).main(argv[1:]) or 0)
