"""The DDP ranks a command launched: rank 0 does not exit before them.

Lightning's subprocess launcher starts ranks 1..N-1 as child processes of the command (rank 0)
and keeps them in ``launcher.procs``; it never waits for them. When rank 0 finishes first (it
returned from ``fit`` while rank 1 is still leaving its process group, or it stopped on a signal
or an error), the command exited and left rank 1 running on its own, so a scheduler or a shell
saw the job end while one of its processes still held CPU, files and a port.

:func:`watch` records the launched processes when the Trainer is built; :func:`wait_for_launched_ranks`
(called by ``app.main.run`` as the command ends, whatever the outcome) waits for each of them and
kills one that is still running after a grace period, saying so on stderr.

A rank that stops responding (stopped, swapped out, hung in a driver) leaves the others waiting in
a collective (a gradient all-reduce, a barrier), and PyTorch's default process-group timeout is 30
minutes. :func:`limit_collective_wait` gives the run's DDP strategy :data:`DEFAULT_TIMEOUT`
instead; when a collective gives up, :func:`stalled_collective_line` is the one line the command
ends with, naming the rank when it is one this command launched (:func:`unresponsive_ranks`).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

#: Seconds to wait for a rank after rank 0 ended normally or on a signal (the other ranks then
#: finish the same step, join the same checkpoint dump and leave the process group).
GRACE_AFTER_STOP = 120.0
#: Seconds to wait after rank 0 failed (the other ranks may be blocked in a collective that will
#: never complete).
GRACE_AFTER_ERROR = 10.0

#: How long a DDP collective waits for every rank before it fails and the run ends with one line:
#: long enough for a rank to finish a slow step or for rank 0 to write a checkpoint while the others
#: wait at the barrier after it, short enough that a stalled job ends within minutes. (Lightning's
#: ``prepare_data`` barrier is not bound by it: it waits without a limit.)
DEFAULT_TIMEOUT = timedelta(minutes=5)

#: The launchers (not the trainers: those hold the model and data) of the trainers built here.
_LAUNCHERS: list[Any] = []
#: The process-group timeout of the DDP strategy of the last trainer built here.
_TIMEOUT: list[timedelta] = []


def watch(trainer: Any) -> None:
    """Remember ``trainer``'s launcher so that the ranks it starts can be waited for."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    if launcher is not None and hasattr(launcher, "procs"):
        _LAUNCHERS.append(launcher)


def limit_collective_wait(trainer: Any, written: Any) -> None:
    """Give ``trainer``'s DDP strategy :data:`DEFAULT_TIMEOUT` when the configuration chose it by
    name (``written``: ``--trainer.strategy ddp``, ``ddp_spawn``..., or ``auto`` on several
    devices): Lightning builds a named strategy with PyTorch's 30-minute default. A strategy given
    as a class keeps the ``timeout`` it was given (``--trainer.strategy.init_args.timeout``)."""
    from torch.distributed.constants import default_pg_timeout

    strategy = getattr(trainer, "strategy", None)
    timeout = getattr(strategy, "_timeout", None)
    if not isinstance(timeout, timedelta):
        _TIMEOUT.clear()  # not a strategy that starts a process group
        return
    if isinstance(written, str) and timeout == default_pg_timeout:
        # Lightning has no public setter: DDPStrategy keeps its timeout argument in ``_timeout``
        # and passes it to init_process_group when the run starts (setup_distributed), after the
        # Trainer is built. Pinned by tests/test_ranks.py::test_a_ddp_strategy_chosen_by_name_gets_the_project_timeout.
        strategy._timeout = timeout = DEFAULT_TIMEOUT
    _TIMEOUT[:] = [timeout]


_COLLECTIVE_TIMED_OUT = re.compile(r"time(d)?[ -]?out", re.IGNORECASE)


def stalled_collective_line(error: BaseException, resume: str) -> str | None:
    """The one line a command ends with when ``error`` is a DDP collective giving up after the
    process-group timeout (gloo: ``Application timeout caused pair closure``, ``Timed out waiting
    ...``): which rank did not answer (when this command launched it), the timeout and ``resume``,
    the command that resumes the run; ``None`` for any other error."""
    if not (_TIMEOUT and isinstance(error, RuntimeError) and _COLLECTIVE_TIMED_OUT.search(str(error))):
        return None
    who = "; ".join(unresponsive_ranks()) or "a rank did not answer"
    return (
        f"{who}: a DDP collective waited the process-group timeout ({_TIMEOUT[0]}) and gave up, so the run "
        f"ended; resume with: {resume} (a longer wait: --trainer.strategy.init_args.timeout, see docs/ddp.md)"
    )


def unresponsive_ranks() -> list[str]:
    """One phrase per rank this command launched that cannot be answering: stopped (``SIGSTOP``,
    a debugger: state ``T`` in ``/proc``) or ended."""
    found = []
    for launcher in _LAUNCHERS:
        for rank, proc in enumerate(launched(launcher), start=1):
            code = proc.poll()
            if code is not None:
                found.append(f"rank {rank} (pid {proc.pid}) ended with exit code {code}")
            elif process_state(proc.pid) in ("T", "t"):
                found.append(f"rank {rank} (pid {proc.pid}) is stopped (SIGSTOP or a debugger)")
    return found


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T``...), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def launched(launcher: Any) -> list[subprocess.Popen]:
    """The child processes (ranks 1..N-1) that ``launcher`` started in this process."""
    return [proc for proc in getattr(launcher, "procs", None) or [] if isinstance(proc, subprocess.Popen)]


def kill_launched_ranks() -> None:
    """Kill every rank a watched trainer launched that still runs (a stop at once: they wait in the
    same collective and would not see a signal either)."""
    for launcher in _LAUNCHERS:
        for proc in launched(launcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def stop_lightning_observer() -> None:
    """Retire Lightning's child-process observer before waiting: it SIGKILLs every rank *and rank 0*
    as soon as a child has a non-zero exit code, so a rank that ended on the same signal or error
    (143, 2) would turn rank 0's own exit code into -9. With nothing left to observe it ends."""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer" and hasattr(thread, "_child_processes"):
            thread._child_processes = []  # its next check finds no process and finishes


def wait_for_launched_ranks(failed: bool) -> list[int]:
    """Wait for every rank launched by a watched trainer; kill those still running when the grace
    period (:data:`GRACE_AFTER_ERROR` when ``failed``, else :data:`GRACE_AFTER_STOP`, one deadline
    for all ranks) is over, and a stopped one at once, with one line on stderr each. Returns the
    pids that had to be killed."""
    launchers, _LAUNCHERS[:] = list(_LAUNCHERS), []
    _TIMEOUT.clear()  # the command's process group is over
    ranks = [(rank, proc) for launcher in launchers for rank, proc in enumerate(launched(launcher), start=1)]
    if not ranks:
        return []
    stop_lightning_observer()
    grace = GRACE_AFTER_ERROR if failed else GRACE_AFTER_STOP
    deadline = time.monotonic() + grace
    killed: list[int] = []
    for rank, proc in ranks:
        if proc.poll() is None and process_state(proc.pid) in ("T", "t"):  # never ends by itself
            proc.kill()
            proc.wait()
            killed.append(proc.pid)
            print(f"rank {rank} (pid {proc.pid}) is stopped and would never end; killed it", file=sys.stderr)
            continue
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(proc.pid)
            print(f"rank {rank} (pid {proc.pid}) was still running {grace:g} s after rank 0 ended; killed it", file=sys.stderr)
    return killed
