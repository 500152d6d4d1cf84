"""app.runtime.signals: the watch that stops a DDP command whose main thread cannot run a signal's
handler (it waits in a collective for a rank that does not answer). The two-process runs are in
tests/test_runs.py (slow); here the watch reads a pipe the test writes, as Python's C-level
handler writes the wakeup file descriptor."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from app.runtime import signals


@pytest.fixture
def watch(monkeypatch):
    """Start the watch on a fresh pipe with a short answer time and a recorded stop; yields a
    function that writes signal numbers to the pipe and returns the stops recorded after
    ``wait`` seconds."""
    stops: list[int] = []
    monkeypatch.setattr(signals, "ANSWER_WITHIN", 0.5)
    monkeypatch.setattr(signals, "_in_process_group", lambda: True)
    monkeypatch.setattr(signals, "_stop_at_once", stops.append)
    monkeypatch.setattr(signals.STATE, "handled_at", float("-inf"))
    read_end, write_end = os.pipe()
    thread = threading.Thread(target=signals._watch, args=(read_end,), daemon=True)
    thread.start()

    def send(*signums: int, handler_runs: bool = False, wait: float = 1.2) -> list[int]:
        os.write(write_end, bytes(signums))
        if handler_runs:
            time.sleep(0.05)
            signals.STATE.handled_at = time.monotonic()
        time.sleep(wait)
        return list(stops)

    yield send
    os.close(write_end)
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_signal_the_main_thread_never_handles_stops_the_command(watch):
    assert watch(signal.SIGTERM) == [signal.SIGTERM]


def test_a_signal_the_main_thread_handles_is_left_to_it(watch):
    assert watch(signal.SIGTERM, handler_runs=True) == []


def test_two_signals_that_the_handler_answers_once_are_left_to_it(watch):
    """Two deliveries before the main thread returns to Python run the handler once."""
    assert watch(signal.SIGTERM, signal.SIGTERM, handler_runs=True) == []


def test_other_signals_are_not_watched(watch):
    assert watch(signal.SIGUSR1, signal.SIGCHLD) == []
