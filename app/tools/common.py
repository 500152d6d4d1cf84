"""What the tool commands (``python -m app analyze|bench|convert``) share.

Measurement:

* :func:`matmul_peak`: the machine's measured fp32 matmul throughput, the physical-limit
  column every FLOP/s figure is compared with.
* :func:`count_flops`: matmul FLOPs actually executed by a callable, counted by
  :class:`torch.utils.flop_counter.FlopCounterMode` (a custom backward's recomputation included).
  Fused RNN kernels are invisible to that counter, so :func:`lstm_flops` gives their count.
* :func:`interleaved_times`: repeat-by-repeat interleaved timing of several callables in one
  process, so every variant sees the same machine load; warm-up repeats are dropped.
* :func:`summarize`: median with its spread (min, max, interquartile range) of a list of times.
* :func:`limit_mmap_threshold`, :func:`reset_peak_rss`, :func:`rss_bytes`, :func:`peak_rss_bytes`:
  CPU peak-memory probing through the kernel's resident-set high-water mark;
  :func:`probe_in_subprocess` runs a probe in a fresh interpreter.

Options: :func:`apply_tiny` (``--tiny`` sizes that explicit options override).

Reports: :func:`ratio` (a table cell), :func:`check_report_files` (``--json`` / ``--csv`` checked
before the run), :func:`write_reports` (JSON / CSV results),
:func:`write_output` (an analysis report or figure). Checkpoints: :data:`DEFAULT_TASK` and
:func:`batch_hidden` (the hidden states a restored model's head sees).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from torch import Tensor

from datamodules.files import check_output_file, write_atomically


def matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """Measured fp32 matmul throughput (FLOP/s) of a square ``torch.mm`` (median of repeats)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def _inplace_addmm_flop(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n


def count_flops(fn: Callable[[], object]) -> int:
    """Matmul FLOPs executed by one call of ``fn`` (forward and backward if ``fn`` runs both)."""
    from torch.utils.flop_counter import FlopCounterMode

    # The counter has no formula for the in-place addmm_ that accumulates MoS's weight gradient.
    mapping = {torch.ops.aten.addmm_: _inplace_addmm_flop}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return int(counter.get_total_flops())


def lstm_flops(lstm: torch.nn.LSTM, tokens: int, backward: bool = True) -> int:
    """Matmul FLOPs of a (single-direction) ``nn.LSTM`` over ``tokens`` time-steps x sequences.

    Each step multiplies ``[x_t; h_(t-1)]`` by the four gates' ``(4H, I + H)`` matrix:
    ``2 * 4H * (I + H)`` per token forward; the backward does two such products (input and
    weight gradients), so forward+backward is three times the forward.
    """
    H, I = lstm.hidden_size, lstm.input_size
    forward = 2 * 4 * H * (I + H) * tokens
    return 3 * forward if backward else forward


def interleaved_times(steps: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each step, ``repeats`` each, interleaved repeat by repeat.

    The first ``warmup`` rounds are run but not recorded (allocator, thread pools, lazy state
    such as optimizer moments are created there).
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    for repeat in range(warmup + repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if repeat >= warmup:
                times[name].append(elapsed)
    return times


def summarize(times: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of measured times."""
    if not times:
        raise ValueError("summarize needs at least one measured time (set --repeats >= 1)")
    ordered = sorted(times)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "iqr": q3 - q1}


# ---------------------------------------------------------------------------- memory (CPU)
def _proc_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+)", f.read()).group(1))


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _proc_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Resident-set high-water mark since the last :func:`reset_peak_rss`."""
    return _proc_kib("VmHWM") * 1024


def peak_growth_bytes(before: int) -> int:
    """Peak RSS above ``before`` (bytes). The kernel syncs its per-thread RSS counters in
    batches of pages, so a tiny step can read a few pages *below* its baseline: clamp at 0."""
    return max(0, peak_rss_bytes() - before)


def reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def limit_mmap_threshold(threshold: int = 65536, trim: int = 0) -> bool:
    """Make glibc serve every allocation above ``threshold`` bytes by its own mapping.

    Freed tensors then return to the OS at once, so the RSS high-water mark of a step is the
    memory the step really held at its peak (not heap pages kept from earlier steps). Free heap
    pages left by earlier work are released first (``malloc_trim``). Returns False where glibc's
    ``mallopt`` is unavailable (the probe is then approximate).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.malloc_trim(0)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, trim))


def mallopt_available() -> bool:
    """Whether glibc's ``mallopt`` is there, i.e. whether :func:`limit_mmap_threshold` can pin anything."""
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


def restore_mmap_threshold() -> bool:
    """Undo :func:`limit_mmap_threshold` for timing: glibc's own ceilings (32 MiB mapping threshold, heap kept)."""
    return limit_mmap_threshold(32 * 2**20, 64 * 2**20)


def check_report_files(args: Any) -> None:
    """Refuse, in one line before anything is measured, a ``--json`` / ``--csv`` report file that
    cannot be written (a directory, or a path whose directory cannot be created or takes no file):
    the results would be lost after the run (:func:`datamodules.files.check_output_file`)."""
    for option in ("json", "csv"):
        check_output_file(getattr(args, option, None), option)


def write_reports(result: object, json_path: str | None = None, csv_path: str | None = None, csv_text: str = "") -> None:
    """Write a bench's optional JSON/CSV outputs atomically (no truncated file on a crash)."""
    if csv_path:
        write_atomically(csv_path, csv_text)
    if json_path:
        write_atomically(json_path, json.dumps(result, indent=2))


#: The task of checkpoints that name none (classification checkpoints written before tasks were
#: named), for the tools that restore checkpoints (analyze experts, convert ds).
DEFAULT_TASK = "tasks.classification.ClassificationTask"


def batch_hidden(model: torch.nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Hidden states the head sees for one batch: the task's ``hidden_states(batch)`` where it has
    one (the language model: each batch from a fresh recurrent state), else ``model(input)``."""
    if hasattr(model, "hidden_states"):
        return model.hidden_states(batch)
    return model(batch["input"].to(model.device))


def ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as a table cell (``1.23x``); ``-`` when either is missing."""
    return "-" if value is None or not base else f"{value / base:.2f}x"


def probe_in_subprocess(module: str, args: list[str], threads: int) -> dict[str, Any]:
    """What ``python -m <module> <args> --threads <threads>`` prints as JSON on its last line, run
    in a fresh interpreter whose allocator returns freed buffers at once (a memory probe: nothing
    an earlier measurement left in this process's heap is counted). Raises ``RuntimeError`` with
    the probe's last error line when it fails."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-m", module, *args, "--threads", str(threads)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(str(done.stderr.strip().splitlines()[-1:]))
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_output(path: str, data: bytes | str, option: str) -> None:
    """Write an analysis output (a report, a figure) atomically; ``option`` is the flag that
    chooses its directory, named in the error line."""
    write_atomically(path, data, "output", f"free space or pass another {option}")


def given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The ``dest`` names of the options ``argv`` sets explicitly (a default is not set): argparse
    fills in a default only where the namespace it parses into has no value yet, so every dest is
    pre-filled with a marker and the ones the command line replaced are the given ones."""
    marker = object()
    namespace = argparse.Namespace(**{a.dest: marker for a in parser._actions if a.dest != argparse.SUPPRESS})
    parsed = parser.parse_args(argv, namespace)
    return {dest for dest, value in vars(parsed).items() if value is not marker}


def apply_tiny(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace, sizes: dict[str, Any]) -> None:
    """``--tiny``: put the tiny ``sizes`` (dest -> value) into ``args`` for the options the command
    line does not set; an explicit option wins (``bench infer --tiny --num-classes 500`` times
    500 classes, not the tiny 300)."""
    given = given_options(parser, argv)
    for dest, value in sizes.items():
        if dest not in given:
            setattr(args, dest, value)


def add_config_argument(parser: Any) -> None:
    """``--config FILE`` (repeatable) of a tool that rebuilds a checkpoint's model and datamodule:
    the configs that say where the data is (``data_dir``, ``download``, ...) and what an encoder
    loads (a Hugging Face ``model``). A checkpoint names classes and sizes but never a location
    (:mod:`app.checkpoint_io.policy`)."""
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE",
        help="task/data YAML (as given to fit) giving data locations (data_dir, download, ...) and an encoder's model "
             "directory or hub name, which a checkpoint never sets; default: the classes' defaults",
    )
