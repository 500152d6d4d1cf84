"""What ``python -m app COMMAND ...`` runs: the dispatch of every command and the console entry.

``fit|validate|test|predict`` (and options only) are the LightningCLI (:mod:`app.cli`);
``analyze|bench|convert MODE`` the tools registered in :data:`app.tools.TOOLS`; ``demo`` the
README's comparison (:mod:`app.demo`). :func:`run` turns a user error into one ``error: ...``
line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.tools import TOOLS, run_tool

if TYPE_CHECKING:
    from app.cli import WorkbenchCLI

# The LightningCLI (app.cli), the demo and what they import (torch, Lightning) are imported when a
# command needs them, so --help and a mistyped command answer at once.

SUBCOMMANDS = ("fit", "validate", "test", "predict")

#: What each command does, one line each, for ``--help`` (a tool's line ends with its modes).
DESCRIPTIONS = {
    "fit": "train a model: --config FILE (task + data), more --config FILE / --key value; --ckpt_path last resumes",
    "validate": "evaluate a model (--ckpt_path FILE) on the validation split",
    "test": "evaluate a model (--ckpt_path FILE) on the test split",
    "predict": "write a model's (--ckpt_path FILE) predictions for the predict split",
    "analyze": "analyse trained heads and the synthetic language",
    "bench": "measure heads' speed, memory and accuracy",
    "convert": "turn a checkpoint into another (a softmax run into DS-Softmax, an ONNX or torch.export file to serve)",
    "demo": "train softmax, adaptive softmax and every bottleneck head on the synthetic language and compare their perplexities",
}


def program() -> str:
    """How the user started the CLI, for usage lines: ``headbench`` (the console script) or
    ``python -m app``."""
    return "headbench" if Path(sys.argv[0]).name == "headbench" else "python -m app"


def usage() -> str:
    """The ``--help`` text: every command with one line, and where each one's options are listed."""
    prog = program()
    lines = [
        f"usage: {prog} COMMAND [options]",
        "",
        "Train and compare output layers (heads) on language modeling, translation, captioning and classification.",
        "",
        "commands:",
    ]
    for command, description in DESCRIPTIONS.items():
        modes = f" (MODE: {', '.join(sorted(TOOLS[command]))})" if command in TOOLS else ""
        shown = f"{command} MODE" if command in TOOLS else command
        lines.append(f"  {shown:<14}{description}{modes}")
    lines += [
        "",
        f"{prog} COMMAND --help lists a command's options (fit --help: the trainer's options, the task and data",
        f"classes and the heads; fit --model.help CLASS and --data.help CLASS a class's options); {prog} TOOL MODE --help",
        "a tool mode's.",
    ]
    return "\n".join(lines)


def main(args: list[str] | None = None, run: bool = True) -> WorkbenchCLI | int:
    """Run the CLI (``args`` as on the command line; ``None`` reads ``sys.argv``)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if argv and argv[0] in TOOLS:
        return run_tool(argv[0], argv[1:])
    if argv and argv[0] == "demo":
        from app import demo

        return demo.main(argv[1:])
    valid = ", ".join(DESCRIPTIONS)
    if not argv:
        raise ValueError(f"no command given: valid commands are {valid} ({program()} --help)")
    if not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        raise ValueError(f"unknown command {argv[0]!r}: valid commands are {valid} ({program()} COMMAND --help)")
    from app.cli import run_command

    return run_command(argv, from_shell=args is None, run=run, prog=program())


#: The project's packages: a warning raised in their code is printed as one line.
PROJECT_PACKAGES = ("app", "datamodules", "heads", "tasks")

_ONE_LINE_INSTALLED = False


def one_line_project_warnings() -> None:
    """Print the project's own warnings as one line, ``path:line: Category: message``: Python's
    default format adds the line of source that raised it, which for the project's warnings is
    only the call that raised it (``rank_zero_warn(f"{message}; ...``) and says nothing the
    message does not. Warnings from any other code (Lightning, torch, the user's) print as before:
    the installed ``warnings.formatwarning`` hands them to the one it replaces. Once per process."""
    global _ONE_LINE_INSTALLED
    if _ONE_LINE_INSTALLED:
        return
    root = Path(__file__).resolve().parent.parent
    places = tuple(f"{root / name}{os.sep}" for name in PROJECT_PACKAGES)
    previous = warnings.formatwarning

    def formatwarning(message: Any, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
        if os.path.realpath(filename).startswith(places):
            return f"{filename}:{lineno}: {category.__name__}: {message}\n"
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    _ONE_LINE_INSTALLED = True


def run() -> None:
    """Console entry: user errors (``ValueError``) become one line on stderr and exit code 2;
    set ``HEADBENCH_DEBUG=1`` for the traceback. As the command ends, whatever the outcome, the
    DDP ranks it launched are waited for (:mod:`app.runtime.ranks`). The project's own warnings
    print as one line (:func:`one_line_project_warnings`)."""
    one_line_project_warnings()
    failed = True
    try:
        result = main()
        close_process_group(wait=True)  # inside the try: a rank that waits here needs rank 0 too
        failed = False
    except SystemExit as stopped:  # a signal's stop (signals.Interrupted) or an --help's exit
        from app.runtime import signals
        from app.runtime.directories import is_launching_process

        if not isinstance(stopped, signals.Interrupted):
            raise
        failed = False  # the ranks stop at the same step and join the checkpoint dump
        close_process_group(wait=False)
        if is_launching_process():
            print(stopped.message, file=sys.stderr)
        sys.exit(stopped.code)
    except (ValueError, FloatingPointError) as error:
        close_process_group(wait=False)
        if os.environ.get("HEADBENCH_DEBUG"):
            raise
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except (RuntimeError, MemoryError) as error:
        from app.runtime import ranks, signals
        from app.runtime.settings import allocation_failed_line

        line = allocation_failed_line(error)  # sizes that do not fit in memory: one line, exit 2
        if line is not None and not os.environ.get("HEADBENCH_DEBUG"):
            close_process_group(wait=False)
            print(f"error: {line}", file=sys.stderr)
            sys.exit(2)
        # a DDP collective that gave up waiting for a rank: one line, exit 1
        line = ranks.stalled_collective_line(error, signals.resume_command(sys.argv[1:]))
        if line is None or os.environ.get("HEADBENCH_DEBUG"):
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(1)
    finally:
        from app.runtime import ranks

        ranks.wait_for_launched_ranks(failed)
    if isinstance(result, int):
        sys.exit(result)


def close_process_group(wait: bool) -> None:
    """Leave a DDP run's process group cleanly: after a successful command wait for every rank,
    then destroy the group (after an error only destroy it: the other ranks may be gone).

    Without it a rank can exit while another still holds gloo threads, and the interpreter's
    shutdown then aborts ("terminate called without an active exception", exit -6), e.g. in a
    two-process ``predict`` after its output is written.
    """
    dist = sys.modules.get("torch.distributed")  # not imported: no process group to leave
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if wait:
            dist.barrier()
    finally:
        dist.destroy_process_group()
