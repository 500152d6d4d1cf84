"""The installed ``headbench`` console script is ``python -m app``: same commands, output, exit codes
and one-line errors; ``--help`` lists every command, ``fit --help`` every task class; a wheel built
from the tree holds every subpackage. All through the installed script / real CLI in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.shell import ENV, ROOT, one_error_line, run_app
from tests.test_saved_config import TINY

HEADBENCH = Path(sys.executable).parent / "headbench"
#: The installed script and the wheel run in processes of their own: all slow.
pytestmark = pytest.mark.slow

COMMANDS = ("fit", "validate", "test", "predict", "analyze", "bench", "convert", "demo")
TASKS = ("tasks.LanguageModel", "tasks.TranslationTask", "tasks.CaptioningTask", "tasks.ClassificationTask")


def run_script(args: list[str], cwd: Path | str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    assert HEADBENCH.is_file(), f"{HEADBENCH} is not installed: run .venv/bin/pip install -e '.[dev]'"
    return subprocess.run([str(HEADBENCH), *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def same_behaviour(args: list[str], cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """Run ``args`` both ways; exit codes, stdout and the error lines must agree (the program name
    in usage lines aside). Returns the console script's result."""
    script, module = run_script(args, cwd), run_app(args, cwd)
    normalise = lambda text: text.replace("headbench", "PROG").replace("python -m app", "PROG")  # noqa: E731
    errors = lambda result: [normalise(line) for line in result.stderr.splitlines() if line.startswith("error: ")]  # noqa: E731
    assert script.returncode == module.returncode, (args, script.stderr[-2000:], module.stderr[-2000:])
    assert normalise(script.stdout) == normalise(module.stdout), args
    assert errors(script) == errors(module), args
    assert "Traceback" not in script.stderr, script.stderr[-3000:]
    return script


def test_help_lists_every_command_with_a_line_each_in_both_forms():
    result = same_behaviour(["--help"])
    assert result.returncode == 0
    assert result.stdout.startswith("usage: headbench COMMAND")
    lines = result.stdout.splitlines()
    for command in COMMANDS:
        (line,) = [line for line in lines if line.startswith(f"  {command} ")]
        assert len(line.split()) > 3, line  # a description follows the name


def test_fit_help_of_the_console_script_lists_every_task_class():
    result = run_script(["fit", "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: headbench [options] fit"), result.stdout[:200]
    listed = " ".join(result.stdout.split())  # the help wraps long lines
    for task in TASKS:
        assert task in listed, task


def test_a_successful_fit_through_the_console_script_exits_0(tmp_path):
    """It used to print ``<app.cli.WorkbenchCLI object at 0x...>`` and exit 1."""
    result = run_script(["fit", *TINY, "--trainer.default_root_dir", str(tmp_path),
                         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WorkbenchCLI object" not in result.stdout + result.stderr
    assert (tmp_path / "runs/SyntheticLM-softmax/version_0/checkpoints/last.ckpt").is_file()


def test_a_user_error_is_one_line_and_exit_code_2_in_both_forms(tmp_path):
    one_error_line(same_behaviour(["analyze", "nosuchmode"], tmp_path), "unknown analyze mode 'nosuchmode'")


@pytest.mark.parametrize("args", [
    [], ["bogus"], ["analyze", "--help"], ["bench", "--help"], ["convert", "--help"], ["demo", "--help"],
    ["bench", "nosuchmode"], ["convert", "ds", "--help"], ["demo", "--heads", "nosuchhead"],
    ["fit", "--config", "missing.yaml"], ["test", "--trainer.max_epochs", "x"],
])
def test_every_command_behaves_the_same_in_both_forms(args, tmp_path):
    same_behaviour(args, tmp_path)


def test_a_wheel_built_from_the_tree_holds_every_subpackage_and_the_configs(tmp_path):
    """``[tool.setuptools.packages.find]``: a non-editable install gets app.bench, heads.ds,
    tasks.encoders, ... (a plain package list installs only the top-level packages) and every
    config under configs/, so the installed demo runs its default config from any directory. Built
    from a copy of the sources, so the tree gets no build/ directory."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    packages = ("app", "datamodules", "heads", "tasks", "configs")
    for package in packages:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(source)], env=ENV, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("headbench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(ROOT)) for package in packages for p in (ROOT / package).rglob("*.py")}
    expected |= {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")}
    assert expected <= names, sorted(expected - names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "headbench = app.main:run" in entry_points

    # the installed files alone (not this checkout) run the demo's default config from an empty directory
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                               env=ENV, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tiny = ["--data.init_args.train_tokens", "1500", "--data.init_args.valid_tokens", "400", "--data.init_args.test_tokens", "600",
            "--data.init_args.vocab_size", "40", "--model.init_args.encoder.init_args.hidden_size", "16",
            "--model.init_args.encoder.init_args.last_hidden_size", "16", "--model.init_args.encoder.init_args.embedding_dim", "8",
            "--trainer.enable_progress_bar", "false"]
    demo = subprocess.run([sys.executable, "-c", "import sys, app; assert app.__file__.startswith(sys.argv[1]), app.__file__; "
                           "from app.main import run; sys.argv = ['headbench', *sys.argv[2:]]; run()", str(site),
                           "demo", "--heads", "softmax", "--max-epochs", "1", "--save-dir", "demo", "--extra", *tiny],
                          cwd=elsewhere, env={**ENV, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "| softmax" in demo.stdout and (elsewhere / "demo" / "SyntheticLM-softmax").is_dir()
