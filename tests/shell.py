"""Running the real CLI from tests.

:func:`run_cli` runs ``python -m app ...`` inside the test process through the console entry
(:func:`app.main.run`, with ``sys.argv`` set as the shell sets it), so a test sees the exit code,
stdout and stderr a user's shell sees (``error: ...`` and exit code 2 for a user error) without a
cold start of torch and Lightning. :func:`run_app` starts a real ``python -m app`` process, for
what needs one (signals, kill -9, resource limits, DDP ranks, a fresh interpreter); those tests are
marked ``slow``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent

#: One thread per process (the machine has two cores and tests may run two processes at once);
#: the project importable from any working directory; no traceback mode left over from the caller.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENV.pop("HEADBENCH_DEBUG", None)

#: What ``sys.argv[0]`` is in ``python -m app``: the path of the package's ``__main__``.
ARGV0 = str(ROOT / "app" / "__main__.py")


def run_app(
    args: list[str], cwd: Path | str = ROOT, timeout: float = 300, preexec_fn: Callable[[], None] | None = None
) -> subprocess.CompletedProcess:
    """``python -m app *args`` in a new process in ``cwd``; its exit code, stdout and stderr as text."""
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn)


def run_cli(args: list[str], cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """``python -m app *args`` in ``cwd``, run in this process by the console entry
    :func:`app.main.run`: the exit code (0, 2 with one ``error: ...`` line for a user error, 1 and
    the traceback for a crash), stdout and stderr as text, as :func:`run_app` returns them.

    Output is what the process would print: ``print``, Lightning's log lines and warnings (with
    Python's default filters, not pytest's) go to the captured streams. The working directory
    (first on ``sys.path``, as ``python -m`` puts it), the environment, torch's thread count and
    deterministic mode are put back afterwards.
    """
    from app.main import run

    out, err = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    with _process_state(cwd, args), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            _log_to(err), _shell_warnings(err):
        try:
            run()
        except SystemExit as stopped:
            code = stopped.code
        except Exception:  # an uncaught crash: the interpreter prints the traceback and exits 1
            traceback.print_exc(file=err)
            code = 1
    if isinstance(code, str):  # sys.exit("message"): printed to stderr, exit code 1
        err.write(code + "\n")
        code = 1
    return subprocess.CompletedProcess(["python", "-m", "app", *args], code or 0, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def _process_state(cwd: Path | str, args: list[str]) -> Iterator[None]:
    import torch

    saved_argv, saved_path, saved_cwd, saved_env = sys.argv, sys.path[:], os.getcwd(), dict(os.environ)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    sys.argv = [ARGV0, *args]
    sys.path.insert(0, str(Path(cwd).resolve()))  # as ``python -m`` puts the working directory first
    os.environ.pop("HEADBENCH_DEBUG", None)
    os.chdir(cwd)
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


@contextlib.contextmanager
def _log_to(stream: io.StringIO) -> Iterator[None]:
    """Lightning's loggers write to ``stream`` as they write to stderr in a process of their own
    (under pytest they would propagate to pytest's log capture instead)."""
    handler = logging.StreamHandler(stream)
    saved = []
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate))
        logger.handlers = [h for h in logger.handlers if type(h) is not logging.StreamHandler] + [handler]
        logger.propagate = False
    try:
        yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate


@contextlib.contextmanager
def _shell_warnings(stream: io.StringIO) -> Iterator[None]:
    """Warnings shown once per place with Python's default filters, printed to ``stream`` as the
    interpreter prints them to stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        try:
            yield
        finally:
            for message in caught:
                stream.write(warnings.formatwarning(message.message, message.category, message.filename, message.lineno,
                                                    message.line))


class TookTooLong(BaseException):
    """Raised by :func:`time_limit` in the code it bounds (a ``BaseException``: what the CLI
    catches as a user error or a crash lets it through, so the test fails with it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Stop the code inside after ``seconds`` with :class:`TookTooLong` (a ``SIGALRM``: it
    interrupts a Python loop and a blocking system call such as opening a FIFO), so a regression
    that hangs shows as a failing test instead of a stuck suite. Main thread only."""
    def expire(signum: int, frame: object) -> None:
        raise TookTooLong(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
