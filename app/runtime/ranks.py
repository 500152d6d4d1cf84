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
from typing import Any

#: Seconds to wait for a rank after rank 0 ended normally or on a signal (the other ranks then
#: finish the same step, join the same checkpoint dump and leave the process group).
GRACE_AFTER_STOP = 120.0
#: Seconds to wait after rank 0 failed (the other ranks may be blocked in a collective that will
#: never complete).
GRACE_AFTER_ERROR = 10.0

_TRAINERS: list[Any] = []


def watch(trainer: Any) -> None:
    """Remember ``trainer`` so that the ranks its strategy launches can be waited for."""
    _TRAINERS.append(trainer)


def launched(trainer: Any) -> list[subprocess.Popen]:
    """The child processes (ranks 1..N-1) that ``trainer``'s launcher started in this process."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    procs = getattr(launcher, "procs", None)
    return [proc for proc in procs or [] if isinstance(proc, subprocess.Popen)]


def wait_for_launched_ranks(failed: bool) -> list[int]:
    """Wait for every rank launched by a watched trainer; kill any still running after the grace
    period (:data:`GRACE_AFTER_ERROR` when ``failed``, else :data:`GRACE_AFTER_STOP`) with one
    line on stderr. Returns the pids that had to be killed."""
    grace = GRACE_AFTER_ERROR if failed else GRACE_AFTER_STOP
    killed: list[int] = []
    trainers, _TRAINERS[:] = list(_TRAINERS), []
    for trainer in trainers:
        for rank, proc in enumerate(launched(trainer), start=1):
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed.append(proc.pid)
                print(
                    f"rank {rank} (pid {proc.pid}) was still running {grace:g} s after rank 0 ended; killed it",
                    file=sys.stderr,
                )
    return killed
