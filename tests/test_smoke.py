"""One real ``python -m app`` process per command, and the in-process runner against the shell.

The default suite runs the CLI in-process (:func:`tests.shell.run_cli`); these slow checks start a
fresh interpreter per command as a user's shell does (imports, ``__main__``, exit codes), and show
that :func:`~tests.shell.run_cli` reports what that process reports: exit code, stdout, error line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TinyConfig
from tests.shell import ROOT, run_app, run_cli

pytestmark = pytest.mark.slow

LM = "configs/lm/synthetic.yaml"


def succeeded(result) -> None:
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> tuple[Path, Path]:
    """``fit`` in a process of its own: the run directory and its last checkpoint."""
    directory = tmp_path_factory.mktemp("smoke")
    succeeded(run_app(["fit", *TinyConfig().args(LM, directory=directory)], directory))
    return directory, next((directory / "runs").rglob("last.ckpt"))


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_each_evaluation_command_runs_in_a_process_of_its_own(fitted, command):
    directory, checkpoint = fitted
    result = run_app([command, *TinyConfig().args(LM, directory=directory, model=False), "--ckpt_path", str(checkpoint)],
                     directory)
    succeeded(result)
    if command != "predict":
        assert ("val/loss" if command == "validate" else "test/loss") in result.stdout, result.stdout[-2000:]


def test_each_tool_runs_in_a_process_of_its_own(fitted, tmp_path):
    _, checkpoint = fitted
    tools = {
        "analyze rank": ["analyze", "rank", "--ckpt_path", str(checkpoint), "--output_dir", str(tmp_path / "rank")],
        "convert ds": ["convert", "ds", "--ckpt_path", str(checkpoint), "--num_experts", "2", "--min_count", "1",
                       "--output", str(tmp_path / "ds.ckpt")],
        "bench heads": ["bench", "heads", "--tiny", "--threads", "1", "--no-memory", "--repeats", "1", "--heads", "softmax"],
        "demo": ["demo", "--heads", "softmax", "--max-epochs", "1", "--no-floor", "--save-dir", str(tmp_path / "demo"),
                 "--extra", *TinyConfig().shrink(LM)],
    }
    for name, args in tools.items():
        result = run_app(args, tmp_path)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (name, result.stderr[-3000:])
    assert (tmp_path / "ds.ckpt").is_file() and any((tmp_path / "rank").iterdir())


@pytest.mark.parametrize("args", [
    ["--help"], ["analyze", "nosuchmode"], ["fit", "--config", "missing.yaml"], ["test", "--trainer.max_epochs", "x"],
    ["fit", "--config", LM, "--model.init_args.encoder.init_args.dropout_hidden", "1.5", "--trainer.logger", "false"],
])
def test_the_in_process_runner_reports_what_the_process_reports(args):
    """Exit code, stdout and the ``error: ...`` lines of :func:`run_cli` equal a real process's
    (each refused before it writes anything, so both run in the project directory)."""
    shell, inside = run_app(args, ROOT), run_cli(args, ROOT)
    errors = lambda result: [line for line in result.stderr.splitlines() if line.startswith("error: ")]  # noqa: E731
    assert (inside.returncode, inside.stdout, errors(inside)) == (shell.returncode, shell.stdout, errors(shell)), (
        inside.stderr[-2000:], shell.stderr[-2000:])
