"""A checkpoint fuzz campaign: a damaged or edited checkpoint is one line, never a traceback or a
silently different model (docs/checkpoints.md, "The one reader").

From two real checkpoints, a tiny language model trained with the shared tiny configuration
(tests/conftest.py) and the DS-Softmax checkpoint ``convert ds`` makes of it, seeded mutants are
written: structural ones (every entry and nested entry deleted and retyped, every tensor reshaped,
NaN/Inf-filled and given other dtypes, version strings, optimizer states: :func:`structural_mutants`)
and byte-level ones (truncations, flipped bytes, zip members edited with valid checksums, removed,
renamed or added, another byte order: :func:`byte_mutants`), about 2,000 in all (1,400 of the
language model). Every mutant goes through the shared reader as the tools use it (``read_checkpoint``
and ``restore``; the model compared with the original's, bit for bit and dtype for dtype). A
seeded sample (:data:`SAMPLE` language-model mutants, half of them ones the shared reader accepted,
and :data:`DS_SAMPLE` DS-Softmax ones) goes through every command that reads a checkpoint, in-process
(:func:`tests.shell.run_cli`): ``test``, ``validate``, ``predict``, ``fit --ckpt_path`` (one more
step), ``analyze rank``, ``convert export`` and ``convert ds`` for the language model; ``analyze
experts``, ``bench ds``, ``test`` and ``convert export`` for DS-Softmax.

Each case either succeeds (exit 0; the shared reader's model has the original's weights; ``test``
and ``validate`` print the original's loss) or is refused (exit 2, exactly one ``error:`` line
naming the file, no traceback, nothing in the command's output directory), within
:data:`CASE_SECONDS`. A broken case is printed as it happens; the summary (mutants, readers,
cases, accepted, refused, time) is printed with ``-s``. About four minutes on one core (about
2,300 cases: every mutant through the shared reader, 36 x 7 + 12 x 4 command runs):

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -n 0 -m slow -s tests/test_checkpoint_fuzz.py
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from tests.conftest import TinyConfig
from tests.shell import run_cli

pytestmark = pytest.mark.slow

SEED = 0
#: Seconds a case may take (a tiny run takes about one).
CASE_SECONDS = 60
#: Mutants of the language-model checkpoint run through every command, and of the DS-Softmax one
#: (HEADBENCH_CKPT_FUZZ_SAMPLE=N runs N and N / 3: a longer campaign).
SAMPLE = int(os.environ.get("HEADBENCH_CKPT_FUZZ_SAMPLE", "36"))
DS_SAMPLE = SAMPLE // 3

TINY = TinyConfig()
#: Deleting an entry, or the values an entry is replaced with (each entry gets two of them).
DELETE = object()
RETYPES = {"text": "garbage", "none": None, "int": 7, "float": 0.5, "list": [], "dict": {}, "tensor": torch.tensor([1.5])}
#: Tensor dtypes a state-dict entry is converted to.
DTYPES = (torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.float16, torch.float64)
VERSIONS = ("0.9.0", "garbage", "", "99.0.0", "2.6.0.dev0+local", "1.0", 3)


Mutant = tuple[str, Callable[[Path, Path], None]]  # (name, write(target, original))


def entries(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, value)`` of every entry nested in ``value`` (the first three items of a list)."""
    items = value.items() if isinstance(value, dict) else enumerate(value[:3]) if isinstance(value, (list, tuple)) else ()
    for key, inner in items:
        yield (*path, key), inner
        yield from entries(inner, (*path, key))


def edited(value: Any, path: tuple, change: Callable[[Any], Any]) -> Any:
    """``value`` with the entry at ``path`` replaced by ``change(entry)`` (removed for :data:`DELETE`)."""
    if not path:
        return change(value)
    key, rest = path[0], path[1:]
    container = dict(value) if isinstance(value, dict) else list(value)
    inner = edited(container[key], rest, change)
    if inner is DELETE:
        del container[key]
    else:
        container[key] = inner
    return container if isinstance(value, (dict, list)) else type(value)(container)


def structure_edit(path: tuple, change: Callable[[Any], Any]) -> Callable[[Path, Path], None]:
    def write(target: Path, original: Path) -> None:
        checkpoint = torch.load(original, map_location="cpu", weights_only=True)
        torch.save(edited(checkpoint, path, change), target)
    return write


def tensor_changes(tensor: torch.Tensor) -> dict[str, Callable[[Any], Any]]:
    """Reshapes, non-finite values and dtype changes of one tensor entry."""
    changes: dict[str, Callable[[Any], Any]] = {
        "flattened": lambda t: t.reshape(-1) if t.dim() != 1 else t.reshape(1, -1),
        "one-more-row": lambda t: torch.cat([t, t[:1]]) if t.dim() else t.reshape(1),
        "scalar": lambda t: t.reshape(-1)[:1].reshape(()),
    }
    for dtype in DTYPES:
        if dtype != tensor.dtype:
            changes[f"as-{str(dtype).removeprefix('torch.')}"] = lambda t, d=dtype: t.to(d)
    if tensor.is_floating_point() and tensor.numel():
        for name, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))):
            changes[name] = lambda t, v=value: t.clone().reshape(-1).index_fill(0, torch.tensor([t.numel() // 2]), v).reshape(t.shape)
    else:
        changes["as-float32"] = lambda t: t.float()
    return changes


def structural_mutants(original: Path, rng: random.Random) -> list[Mutant]:
    """Every entry and nested entry deleted and retyped (two seeded types each), every tensor
    reshaped, made non-finite and given other dtypes; version strings; optimizer-state edits."""
    checkpoint = torch.load(original, map_location="cpu", weights_only=True)
    found: list[Mutant] = []
    for path, value in entries(checkpoint):
        name = ".".join(map(str, path))
        found.append((f"delete {name}", structure_edit(path, lambda v: DELETE)))
        for kind in rng.sample(sorted(RETYPES), 2):
            if type(RETYPES[kind]) is not type(value):
                found.append((f"{name} as {kind}", structure_edit(path, lambda v, k=kind: RETYPES[k])))
        if isinstance(value, torch.Tensor):
            for kind, change in tensor_changes(value).items():
                found.append((f"{name} {kind}", structure_edit(path, change)))
    for version in VERSIONS:
        found.append((f"pytorch-lightning_version {version!r}", structure_edit(("pytorch-lightning_version",), lambda v, s=version: s)))
    if not checkpoint.get("optimizer_states"):
        return found  # a converted checkpoint carries no optimizer
    group = ("optimizer_states", 0, "param_groups", 0, "params")
    state = ("optimizer_states", 0, "state")
    count = len(checkpoint["state_dict"])
    for label, change in (
        ("params one short", lambda v: v[:-1]), ("params one more", lambda v: [*v, len(v)]),
        ("params reversed", lambda v: v[::-1]), ("params as text", lambda v: [str(i) for i in v]),
        ("params negative", lambda v: [-1 - i for i in v]),
    ):
        found.append((f"optimizer {label}", structure_edit(group, change)))
    for label, change in (
        ("state keys as text", lambda v: {str(k): s for k, s in v.items()}),
        ("state of an unknown parameter", lambda v: {**v, count + 5: v[0]}),
        ("state emptied", lambda v: {}),
        ("moments swapped between parameters", lambda v: {**v, 0: v[count - 1], count - 1: v[0]}),
    ):
        found.append((f"optimizer {label}", structure_edit(state, change)))
    found.append(("optimizer two groups", structure_edit(("optimizer_states", 0, "param_groups"), lambda v: [v[0], v[0]])))
    found.append(("two optimizers", structure_edit(("optimizer_states",), lambda v: [v[0], v[0]])))
    return found


# ---------------------------------------------------------------------- byte-level mutants
def byte_edit(change: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def write(target: Path, original: Path) -> None:
        target.write_bytes(change(original.read_bytes()))
    return write


def flipped(data: bytes, offset: int, mask: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ mask]) + data[offset + 1:]


def member_edit(change: Callable[[dict[str, bytes]], dict[str, bytes]]) -> Callable[[Path, Path], None]:
    """The archive rewritten with its members changed by ``change`` (names -> bytes), every
    checksum valid: an edit the zip checks cannot see."""
    def write(target: Path, original: Path) -> None:
        with zipfile.ZipFile(original) as archive:
            members = {info.filename: archive.read(info) for info in archive.infolist()}
        with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
            for name, data in change(members).items():
                archive.writestr(name, data)
    return write


def byte_mutants(original: Path, rng: random.Random) -> list[Mutant]:
    """Truncations, flipped bytes, and zip members edited, removed, renamed or added."""
    data = original.read_bytes()
    with zipfile.ZipFile(original) as archive:
        names = archive.namelist()
    found: list[Mutant] = []
    for end in sorted(rng.sample(range(1, len(data)), 24)) + [len(data) - 22, len(data) - 1]:
        found.append((f"cut at byte {end}", byte_edit(lambda b, e=end: b[:e])))
    for offset in sorted(rng.sample(range(len(data)), 40)):
        mask = rng.randrange(1, 256)
        found.append((f"byte {offset} ^ {mask:#04x}", byte_edit(lambda b, o=offset, m=mask: flipped(b, o, m))))
    pickle_name = next(n for n in names if n.endswith("/data.pkl"))
    for _ in range(40):
        at, mask = rng.randrange(2000), rng.randrange(1, 256)
        found.append((f"data.pkl byte {at} ^ {mask:#04x} (valid checksums)",
                      member_edit(lambda m, a=at, k=mask: {**m, pickle_name: flipped(m[pickle_name], a % len(m[pickle_name]), k)})))
    for name in names:
        short = name.split("/", 1)[1]
        found.append((f"member {short} removed", member_edit(lambda m, n=name: {k: v for k, v in m.items() if k != n})))
        found.append((f"member {short} cut in half", member_edit(lambda m, n=name: {**m, n: m[n][: len(m[n]) // 2]})))
        found.append((f"member {short} renamed", member_edit(lambda m, n=name: {(k + "x" if k == n else k): v for k, v in m.items()})))
    found.append(("member added", member_edit(lambda m: {**m, names[0].split("/")[0] + "/extra": b"hello"})))
    found.append(("byteorder big", member_edit(lambda m: {k: (b"big" if k.endswith("/byteorder") else v) for k, v in m.items()})))
    found.append(("version 99", member_edit(lambda m: {k: (b"99\n" if k.endswith("/version") else v) for k, v in m.items()})))
    found.append(("stored as legacy pickle", lambda target, original: torch.save(
        torch.load(original, weights_only=True), target, _use_new_zipfile_serialization=False)))
    return found


# ---------------------------------------------------------------------- the readers
def lm_args(directory: Path) -> list[str]:
    """The shared tiny configuration; the model's sizes are the checkpoint's."""
    return TINY.args("configs/lm/synthetic.yaml", directory=directory, model=False)


#: Every command that reads a checkpoint: ``args(checkpoint, case directory)``; its outputs go to
#: ``<case directory>/out``, which a refused command leaves absent.
COMMANDS: dict[str, Callable[[str, Path], list[str]]] = {
    "test": lambda ckpt, d: ["test", *lm_args(d), "--ckpt_path", ckpt],
    "validate": lambda ckpt, d: ["validate", *lm_args(d), "--ckpt_path", ckpt],
    "predict": lambda ckpt, d: ["predict", *lm_args(d), "--ckpt_path", ckpt, "--model.init_args.predict_output",
                                str(d / "out" / "predictions.txt")],
    "fit --ckpt_path": lambda ckpt, d: ["fit", *lm_args(d), "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "1",
                                        "--trainer.limit_val_batches", "1", "--ckpt_path", ckpt],
    "analyze rank": lambda ckpt, d: ["analyze", "rank", "--ckpt_path", ckpt, "--max_contexts", "40", "--output_dir", str(d / "out")],
    "convert export": lambda ckpt, d: ["convert", "export", "--ckpt_path", ckpt, "--output", str(d / "out" / "head.pt2")],
    "convert ds": lambda ckpt, d: ["convert", "ds", "--ckpt_path", ckpt, "--num_experts", "2", "--min_count", "1",
                                   "--output", str(d / "out" / "ds.ckpt")],
    "analyze experts": lambda ckpt, d: ["analyze", "experts", "--ckpt_path", ckpt, "--latency_samples", "8",
                                        "--latency_repeats", "1", "--output_dir", str(d / "out")],
    "bench ds": lambda ckpt, d: ["bench", "ds", "--tiny", "--ckpt_path", ckpt, "--samples", "4", "--batches", "1",
                                 "--batch_size", "4", "--repeats", "1"],
}
#: The commands each checkpoint applies to (the DS-Softmax tools need a DS-Softmax head; convert
#: ds needs a full softmax).
LM_COMMANDS = ("test", "validate", "predict", "fit --ckpt_path", "analyze rank", "convert export", "convert ds")
DS_COMMANDS = ("analyze experts", "bench ds", "test", "convert export")
#: The lines of ``test`` / ``validate`` output that depend only on the weights (and the data).
SCORES = ("test/loss", "val/loss")


class Campaign:
    """Counts of a campaign, and the cases that broke the contract."""

    def __init__(self) -> None:
        self.cases = self.accepted = self.refused = 0
        self.per_reader: dict[str, list[int]] = {}
        self.failures: list[str] = []

    def record(self, reader: str, accepted: bool, failure: str | None) -> None:
        self.cases += 1
        counts = self.per_reader.setdefault(reader, [0, 0])
        counts[0 if accepted else 1] += 1
        if accepted:
            self.accepted += 1
        else:
            self.refused += 1
        if failure:
            self.failures.append(f"{reader}: {failure}")
            print(f"BROKEN {reader}: {failure}", flush=True)  # as it happens: a campaign takes minutes


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def differs(mine: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> str | None:
    """What differs between two state dicts, bit for bit and dtype for dtype; ``None`` if nothing."""
    if mine.keys() != original.keys():
        return f"keys {sorted(set(mine) ^ set(original))}"
    for name, value in original.items():
        if mine[name].dtype != value.dtype or mine[name].shape != value.shape or not torch.equal(mine[name], value):
            return f"{name} ({mine[name].dtype} {tuple(mine[name].shape)}, NaN: {bool(mine[name].isnan().any())})"
    return None


def through_reader(path: Path, original: dict[str, torch.Tensor]) -> tuple[bool, str | None]:
    """The shared reader as the tools use it: ``read_checkpoint``, then ``restore`` (the model,
    without data). Returns (accepted, failure)."""
    from app.checkpoint_io import read_checkpoint, restore

    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the runtime-option warning of an edited file
            model, _ = restore(str(path), read_checkpoint(str(path)), data=False)
    except ValueError as error:
        line = str(error)
        if "\n" in line or str(path) not in line:
            return False, f"refusal not one line naming the file: {line[:300]!r}"
        return False, slow(start)
    except Exception as error:  # noqa: BLE001 - what the campaign looks for
        return False, f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    problem = differs(weights(model), original)
    return True, (f"accepted with other weights: {problem}" if problem else slow(start))


def slow(start: float) -> str | None:
    elapsed = time.perf_counter() - start
    return f"took {elapsed:.0f} s (bound {CASE_SECONDS} s)" if elapsed > CASE_SECONDS else None


def scores(stdout: str) -> list[str]:
    return [" ".join(line.split()) for line in stdout.splitlines() if any(score in line for score in SCORES)]


def through_command(command: str, path: Path, directory: Path, baseline: list[str] | None) -> tuple[bool, str | None]:
    """One command on one mutant, in-process. Returns (accepted, failure)."""
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run_cli(COMMANDS[command](str(path), directory), directory)
    failure = slow(start)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    if "Traceback" in result.stderr or result.returncode not in (0, 2):
        tail = " | ".join(result.stderr.strip().splitlines()[-2:])[:400]
        failure = f"exit {result.returncode}: {tail}"
    elif result.returncode == 2:
        if len(errors) != 1 or str(path) not in errors[0]:
            failure = f"refusal not one error line naming the file: {errors[:3]}"
        elif (directory / "out").exists() and any((directory / "out").iterdir()):
            failure = f"refused but wrote {sorted(p.name for p in (directory / 'out').iterdir())}"
    elif baseline is not None and scores(result.stdout) != baseline:
        failure = f"accepted with other scores: {scores(result.stdout)} instead of {baseline}"
    shutil.rmtree(directory, ignore_errors=True)
    return result.returncode == 0, failure


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """The tiny language-model checkpoint (one epoch of the shared tiny configuration) and the
    DS-Softmax checkpoint ``convert ds`` makes of it."""
    directory = tmp_path_factory.mktemp("originals")
    fitted = run_cli(["fit", *TINY.args("configs/lm/synthetic.yaml", directory=directory)], directory)
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    lm = next(directory.rglob("last.ckpt"))
    ds = directory / "ds.ckpt"
    converted = run_cli(COMMANDS["convert ds"](str(lm), directory)[:-1] + [str(ds)], directory)
    assert converted.returncode == 0, converted.stderr[-3000:]
    return {"lm": lm, "ds": ds}


def test_every_reader_survives_every_mutant(originals, tmp_path):
    """The campaign (see the module docstring); fails listing every case that broke the contract."""
    from app.checkpoint_io import restore

    rng = random.Random(SEED)
    campaign, began = Campaign(), time.perf_counter()
    mutant_count = 0
    for base, commands, sample in (("lm", LM_COMMANDS, SAMPLE), ("ds", DS_COMMANDS, DS_SAMPLE)):
        original = originals[base]
        model, _ = restore(str(original), data=False)
        original_weights = weights(model)
        baselines = {}
        for command in ("test", "validate"):
            if command in commands:
                result = run_cli(COMMANDS[command](str(original), tmp_path / "baseline"), tmp_path)
                assert result.returncode == 0, result.stderr[-3000:]
                baselines[command] = scores(result.stdout)
                assert baselines[command], result.stdout
        mutants = structural_mutants(original, rng) + byte_mutants(original, rng)
        mutant_count += len(mutants)
        accepted_by_reader, refused_by_reader = [], []
        for index, (name, write) in enumerate(mutants):
            path = tmp_path / base / f"{index}.ckpt"
            path.parent.mkdir(exist_ok=True)
            write(path, original)
            accepted, failure = through_reader(path, original_weights)
            campaign.record("shared reader", accepted, failure and f"{base} {name}: {failure}")
            (accepted_by_reader if accepted else refused_by_reader).append(index)
        # The commands on a sample: half of it mutants the shared reader accepted (Lightning's own
        # restore reads more of the file than the tools do), half ones it refused.
        half = sample // 2
        chosen = rng.sample(accepted_by_reader, min(half, len(accepted_by_reader)))
        chosen += rng.sample(refused_by_reader, min(sample - len(chosen), len(refused_by_reader)))
        for index in sorted(chosen):
            name = mutants[index][0]
            for command in commands:
                accepted, failure = through_command(command, tmp_path / base / f"{index}.ckpt", tmp_path / "case",
                                                    baselines.get(command))
                campaign.record(command, accepted, failure and f"{base} {name}: {failure}")
    elapsed = time.perf_counter() - began
    readers = ", ".join(f"{reader} {a}/{r}" for reader, (a, r) in campaign.per_reader.items())
    print(f"\ncheckpoint fuzz: {mutant_count} mutants, {len(campaign.per_reader)} readers, {campaign.cases} cases, "
          f"{campaign.accepted} accepted, {campaign.refused} refused, {len(campaign.failures)} broken (of which "
          f"{sum('accepted with other' in f for f in campaign.failures)} silently different, "
          f"{sum('bound' in f for f in campaign.failures)} over the time bound), {elapsed:.0f} s "
          f"(accepted/refused per reader: {readers})")
    assert mutant_count >= 300
    assert not campaign.failures, "\n".join(campaign.failures[:60])
