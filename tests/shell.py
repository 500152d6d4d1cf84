"""Running the real CLI from tests: ``python -m app ...`` in a subprocess, as a user's shell does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent

#: One thread per process (the machine has two cores and tests may run two processes at once);
#: the project importable from any working directory; no traceback mode left over from the caller.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENV.pop("HEADBENCH_DEBUG", None)


def run_app(
    args: list[str], cwd: Path | str = ROOT, timeout: float = 300, preexec_fn: Callable[[], None] | None = None
) -> subprocess.CompletedProcess:
    """``python -m app *args`` in ``cwd``; its exit code, stdout and stderr as text."""
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The single ``error: ...`` line of a refused run: exit code 2, no traceback, and the line
    holds every fragment. Returns the line."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
