"""The DDP ranks a command launched: rank 0 does not exit before them.

Lightning's subprocess launcher starts ranks 1..N-1 as child processes of the command (rank 0)
and keeps them in ``launcher.procs``; it never waits for them. When rank 0 finishes first (it
returned from ``fit`` while rank 1 is still leaving its process group, or it stopped on a signal
or an error), the command exited and left rank 1 running on its own, so a scheduler or a shell
saw the job end while one of its processes still held CPU, files and a port.

:func:`watch` records the launched processes when the Trainer is built; :func:`wait_for_launched_ranks`
(called by ``app.main.run`` as the command ends, whatever the outcome) waits for each of them and
kills one that is still running after a grace period, saying so on stderr.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

#: Seconds to wait for a rank after rank 0 ended normally or on a signal (the other ranks then
#: finish the same step, join the same checkpoint dump and leave the process group).
GRACE_AFTER_STOP = 120.0
#: Seconds to wait after rank 0 failed (the other ranks may be blocked in a collective that will
#: never complete).
GRACE_AFTER_ERROR = 10.0

#: The launchers (not the trainers: those hold the model and data) of the trainers built here.
_LAUNCHERS: list[Any] = []


def watch(trainer: Any) -> None:
    """Remember ``trainer``'s launcher so that the ranks it starts can be waited for."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    if launcher is not None and hasattr(launcher, "procs"):
        _LAUNCHERS.append(launcher)


def launched(launcher: Any) -> list[subprocess.Popen]:
    """The child processes (ranks 1..N-1) that ``launcher`` started in this process."""
    return [proc for proc in getattr(launcher, "procs", None) or [] if isinstance(proc, subprocess.Popen)]


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
    for all ranks) is over, with one line on stderr each. Returns the pids that had to be killed."""
    launchers, _LAUNCHERS[:] = list(_LAUNCHERS), []
    ranks = [(rank, proc) for launcher in launchers for rank, proc in enumerate(launched(launcher), start=1)]
    if not ranks:
        return []
    stop_lightning_observer()
    grace = GRACE_AFTER_ERROR if failed else GRACE_AFTER_STOP
    deadline = time.monotonic() + grace
    killed: list[int] = []
    for rank, proc in ranks:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(proc.pid)
            print(f"rank {rank} (pid {proc.pid}) was still running {grace:g} s after rank 0 ended; killed it", file=sys.stderr)
    return killed
