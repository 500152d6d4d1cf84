"""Pre-emption: SIGTERM and SIGINT stop a run with a resumable checkpoint and a non-zero exit.

Lightning stops training on SIGTERM by itself: its handler (``trainer/connectors/
signal_connector.py``) sets ``trainer.received_sigterm``, and the loops raise ``SIGTERMException``
at the next batch boundary (under DDP rank 0's flag is broadcast at every step, so all ranks stop
at the same batch). But ``SIGTERMException`` is a ``SystemExit`` with code 0, nothing is saved,
and ``fit && test`` goes on with a half-trained model. SIGINT (Ctrl-C) is a ``KeyboardInterrupt``
raised wherever the main thread is, possibly between two parameter updates of one optimizer step,
so no checkpoint written then could be trusted.

Here:

* SIGINT is turned into the same graceful stop as SIGTERM: the first one asks Lightning to stop
  at the next batch boundary (by calling Lightning's own SIGTERM handler, which also forwards the
  stop to the DDP ranks it launched); a second one interrupts at once, without a checkpoint;
* ``InterruptCheckpoint.on_exception`` writes the run's ``last`` checkpoint when training was
  stopped that way (every rank joins the dump, rank 0 writes it);
* ``app.cli.run_command`` turns the stop into ``Interrupted``: the resume command on stderr and exit
  code 128 + signal number (143 for SIGTERM, 130 for SIGINT), what a shell reports for a process
  the signal killed, so ``fit && test`` stops;
* a signal that arrives while Lightning is not running a loop (parsing, data preparation,
  after training) stops the command at once with the same exit code;
* under DDP, a signal the main thread cannot act on within :data:`ANSWER_WITHIN` seconds stops the
  command at once, without a checkpoint (:func:`_watch`): Python runs a signal's handler only
  between two bytecodes of the main thread, and a main thread waiting in a collective for a rank
  that does not answer runs none until the process-group timeout.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from app.runtime.directories import is_launching_process

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Interrupted(SystemExit):
    """The command was stopped by ``signum``; ``code`` is 128 + ``signum``, ``message`` says
    what was saved and how to resume (``checkpoint``: the file written, or ``None``)."""

    def __init__(self, signum: int, message: str, checkpoint: str | None = None) -> None:
        super().__init__(128 + signum)
        self.signum, self.message, self.checkpoint = signum, message, checkpoint


class _State:
    """What this process received and saved (one command at a time per process)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.signum: int | None = None
        self.checkpoint: str | None = None
        self.step: tuple[int, int] | None = None  # global step and epoch of the checkpoint
        self.previous: dict[int, Any] = {}
        self.handled_at = float("-inf")  # when the main thread last ran a handler (time.monotonic)
        self.command: list[str] = []
        self.wakeup: tuple[int, int] | None = None  # the watched pipe (read end, write end)
        self.previous_wakeup = -1


STATE = _State()


def _lightning_is_listening() -> bool:
    """True while a Trainer runs a loop: Lightning then wraps our SIGTERM handler in its own."""
    return signal.getsignal(signal.SIGTERM) not in (_on_signal, signal.SIG_DFL, signal.SIG_IGN, None)


#: Seconds the main thread has to run a SIGTERM/SIGINT handler under DDP before :func:`_watch`
#: stops the command at once (a healthy step returns to Python many times a second).
ANSWER_WITHIN = 10.0
#: A handler run this many seconds before :func:`_watch` read a signal still answers it (the main
#: thread may run it before the watch wakes up; two signals close together run it once).
_READ_DELAY = 1.0


def _on_signal(signum: int, frame: Any) -> None:
    STATE.handled_at = time.monotonic()
    first = STATE.signum is None
    if first:
        STATE.signum = signum
    if signum == signal.SIGTERM:
        if _lightning_is_listening():
            return  # Lightning's handler, which called us, has asked the loops to stop
        raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name}")
    # SIGINT
    if first and _lightning_is_listening():
        if is_launching_process():
            print("stopping at the end of this training step to save a checkpoint "
                  "(press Ctrl-C again to stop at once, without one)", file=sys.stderr, flush=True)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, frame)
        return
    raise KeyboardInterrupt


def install_handlers(command: list[str] | None = None) -> None:
    """Route SIGTERM and SIGINT through ``_on_signal`` and watch that the main thread runs it
    (main thread only; undone by ``restore_handlers``). ``command``: the arguments after
    ``python -m app``, for the resume command printed by a stop at once."""
    STATE.reset()
    STATE.command = list(command or [])
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in HANDLED:
        STATE.previous[signum] = signal.getsignal(signum)
        signal.signal(signum, _on_signal)
    # Python's C-level handler writes each signal's number to the wakeup file descriptor at once,
    # whatever the main thread is doing; the Python-level handler runs only when it returns to Python.
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    STATE.wakeup = (read_end, write_end)
    STATE.previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_end,), name="headbench-signal-watch", daemon=True).start()


def restore_handlers() -> None:
    for signum, handler in STATE.previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    STATE.previous.clear()
    if STATE.wakeup is not None:
        signal.set_wakeup_fd(STATE.previous_wakeup)
        os.close(STATE.wakeup[1])  # the watch reads the end of the pipe and closes its read end
        STATE.wakeup = None


def _watch(read_end: int) -> None:
    """For each SIGTERM/SIGINT the process receives: if the main thread has not run its handler
    :data:`ANSWER_WITHIN` seconds later while a DDP process group is up, it is waiting in a
    collective that will not return before the process-group timeout (a rank stopped answering);
    stop the command at once: one line (rank 0), the ranks this command launched killed, exit
    code 128 + the signal number. Ends when :func:`restore_handlers` closes the pipe."""
    try:
        while data := os.read(read_end, 64):
            received = [signum for signum in data if signum in HANDLED]
            if not received:
                continue
            read_at = time.monotonic()
            while not _answered(read_at) and time.monotonic() < read_at + ANSWER_WITHIN:
                time.sleep(0.1)
            if not _answered(read_at) and _in_process_group():
                _stop_at_once(received[0])
    except OSError:
        pass
    finally:
        os.close(read_end)


def _answered(read_at: float) -> bool:
    """Whether the main thread ran a signal handler since a signal the watch read at ``read_at``."""
    return STATE.handled_at >= read_at - _READ_DELAY


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _stop_at_once(signum: int) -> None:
    """End the process from the watch thread while the main thread waits in a collective."""
    from app.runtime import ranks

    name = signal.Signals(signum).name
    who = "; ".join(ranks.unresponsive_ranks())
    if is_launching_process():
        print(f"interrupted by {name} while waiting for another rank in a DDP collective{f' ({who})' if who else ''}: "
              f"stopped at once, without a checkpoint; resume with: {resume_command(STATE.command)}",
              file=sys.stderr, flush=True)
    ranks.kill_launched_ranks()
    sys.stdout.flush()
    os._exit(128 + signum)  # the main thread cannot unwind: it is blocked outside Python


class InterruptCheckpoint(pl.Callback):
    """Writes the run's ``last`` checkpoint when a signal stopped training (``SIGTERMException``).

    The loops raise it at a batch boundary, after the batch's optimizer step and callbacks (or
    between validation batches), the same places Lightning's own checkpoints are written, so the
    file resumes like any ``last.ckpt``: Lightning restores the loop counters, the stream position
    of the LM loaders and the task's carried state. The file is the one ``--ckpt_path last``
    picks: ``<checkpoint.dirpath>/last.ckpt`` (``last-vN.ckpt`` when another run's ``last.ckpt``
    is in the directory, as ``ModelCheckpoint`` numbers it)."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        if trainer.sanity_checking or trainer.global_step == 0:
            return  # nothing trained yet: the same command starts over
        path = last_checkpoint_path(trainer)
        if isinstance(trainer.checkpoint_callback, pl.callbacks.ModelCheckpoint):
            # Recorded in the checkpoint's callback state (in the callback's own spelling of the
            # path, which it compares as a string): the resumed run then rewrites this file as
            # its last checkpoint instead of numbering a new last-v1.ckpt beside it.
            trainer.checkpoint_callback.last_model_path = path
        trainer.save_checkpoint(path, weights_only=False)  # all ranks dump (collectives in on_save_checkpoint), rank 0 writes
        STATE.checkpoint = os.path.abspath(path)
        STATE.step = (trainer.global_step, trainer.current_epoch)


def last_checkpoint_path(trainer: pl.Trainer) -> str:
    """The path ``ModelCheckpoint`` gives this run's ``last`` checkpoint."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, pl.callbacks.ModelCheckpoint) or callback.dirpath is None:
        return os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
    if callback.last_model_path:
        return callback.last_model_path
    metrics = dict(trainer.callback_metrics)
    path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST)
    version = callback.STARTING_VERSION
    while callback.file_exists(path, trainer):  # another run's last.ckpt: take the next -vN
        path = callback.format_checkpoint_name(metrics, callback.CHECKPOINT_NAME_LAST, ver=version)
        version += 1
    return path


def interruption(command: list[str]) -> Interrupted | None:
    """The ``Interrupted`` to raise after a signal stopped ``python -m app COMMAND``, or ``None``
    when no signal was received."""
    signum = STATE.signum
    if signum is None:
        return None
    name = signal.Signals(signum).name
    if STATE.checkpoint is None:
        return Interrupted(signum, f"interrupted by {name} outside a training step, so no checkpoint was written on "
                                   f"the way out: add --ckpt_path last to resume from the run's newest checkpoint if "
                                   f"it has one, or run the same command again")
    step, epoch = STATE.step
    resume = shlex.join(["python", "-m", "app", *with_ckpt_path(command, STATE.checkpoint)])
    return Interrupted(
        signum,
        f"interrupted by {name} at global step {step} (epoch {epoch}); "
        f"checkpoint saved to {STATE.checkpoint}\nresume with: {resume}",
        STATE.checkpoint,
    )


def resume_command(command: list[str]) -> str:
    """``python -m app COMMAND`` resuming from the run's newest checkpoint (``--ckpt_path last``)."""
    return shlex.join(["python", "-m", "app", *with_ckpt_path(command, "last")])


def with_ckpt_path(command: list[str], path: str) -> list[str]:
    """``command`` with ``--ckpt_path path`` (replacing a ``--ckpt_path`` it already has)."""
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
            continue
        if arg == "--ckpt_path":
            skip = True
            continue
        if arg.startswith("--ckpt_path="):
            continue
        out.append(arg)
    return [*out, "--ckpt_path", path]
