"""What ``python -m app COMMAND ...`` runs: the dispatch of every command and the console entry.

``fit|validate|test|predict`` (and options only) are the LightningCLI (:mod:`app.cli`);
``analyze|bench|convert MODE`` the tools registered in :data:`app.tools.TOOLS`; ``demo`` the
README's comparison (:mod:`app.demo`). :func:`run` turns a user error into one ``error: ...``
line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys

from app import demo
from app.cli import WorkbenchCLI, run_command
from app.runtime import signals
from app.runtime.directories import is_launching_process
from app.tools import TOOLS, run_tool

SUBCOMMANDS = ("fit", "validate", "test", "predict")


def main(args: list[str] | None = None, run: bool = True) -> WorkbenchCLI | int:
    """Run the CLI (``args`` as on the command line; ``None`` reads ``sys.argv``)."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in TOOLS:
        return run_tool(argv[0], argv[1:])
    if argv and argv[0] == "demo":
        return demo.main(argv[1:])
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        valid = ", ".join((*SUBCOMMANDS, *TOOLS, "demo"))
        raise ValueError(f"unknown command {argv[0]!r}: valid commands are {valid} (python -m app COMMAND --help)")
    return run_command(argv, from_shell=args is None, run=run)


def run() -> None:
    """Console entry: user errors (``ValueError``) become one line on stderr and exit code 2;
    set ``HEADBENCH_DEBUG=1`` for the traceback."""
    try:
        result = main()
    except signals.Interrupted as stopped:
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
    close_process_group(wait=True)
    if isinstance(result, int):
        sys.exit(result)


def close_process_group(wait: bool) -> None:
    """Leave a DDP run's process group cleanly: after a successful command wait for every rank,
    then destroy the group (after an error only destroy it: the other ranks may be gone).

    Without it a rank can exit while another still holds gloo threads, and the interpreter's
    shutdown then aborts ("terminate called without an active exception", exit -6), e.g. in a
    two-process ``predict`` after its output is written.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if wait:
            dist.barrier()
    finally:
        dist.destroy_process_group()
