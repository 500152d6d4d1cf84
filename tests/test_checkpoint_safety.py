"""Checkpoints are data: nothing in a checkpoint file runs, a damaged or foreign checkpoint is one
line naming the file and what differs, a full disk or a NaN state never replaces the previous
checkpoint (docs/checkpoints.md).

Every user-facing check runs the real CLI in a subprocess (``python -m app ...``); two tiny trained
checkpoints (a softmax language model and a DS-Softmax hierarchy classifier) are shared by the whole module."""

from __future__ import annotations

import hashlib
import os
import resource
import signal
from pathlib import Path

import pytest
import torch

from app.checkpoint_io import AtomicCheckpointIO, read_checkpoint
from datamodules.fingerprint import data_fingerprint
from tests.conftest import TinyConfig
from tests.shell import one_error_line, run_app, run_cli

ROOT = Path(__file__).resolve().parent.parent

# the shared tiny configuration (tests/conftest.py) of these two configs, for every command
TINY = TinyConfig()


def lm(directory: Path) -> list[str]:
    return TINY.args("configs/lm/synthetic.yaml", directory=directory)



def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """One tiny language-model checkpoint and one tiny hierarchy-classifier checkpoint, built
    through the Python API (``app.main.main``, the code the shell runs)."""
    from app.main import main

    directory = tmp_path_factory.mktemp("trained")
    lm = main(["fit", *TINY.args("configs/lm/synthetic.yaml", directory=directory / "lm")])
    hierarchy = main(["fit", *TINY.args("configs/hierarchy/ds10x10.yaml", directory=directory / "hierarchy")])
    return {
        "lm": Path(lm.trainer.checkpoint_callback.last_model_path),
        "hierarchy": Path(hierarchy.trainer.checkpoint_callback.last_model_path),
    }


class Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile checkpoint does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------- nothing executes from a file
TOOL_COMMANDS = {
    "analyze experts": lambda ckpt, tmp: ["analyze", "experts", "--ckpt_path", ckpt, "--output_dir", str(tmp / "out")],
    "analyze rank": lambda ckpt, tmp: ["analyze", "rank", "--ckpt_path", ckpt, "--output_dir", str(tmp / "out")],
    "convert ds": lambda ckpt, tmp: ["convert", "ds", "--ckpt_path", ckpt, "--output", str(tmp / "out" / "ds.ckpt")],
    "bench ds": lambda ckpt, tmp: ["bench", "ds", "--tiny", "--ckpt_path", ckpt],
    "test": lambda ckpt, tmp: ["test", *lm(tmp), "--ckpt_path", ckpt],
}


@pytest.mark.parametrize("command", [
    name if name in ("test", "analyze experts") else pytest.param(name, marks=pytest.mark.slow) for name in TOOL_COMMANDS
])
def test_a_pickle_payload_in_a_checkpoint_never_runs(tmp_path, command):
    path = tmp_path / "payload.ckpt"
    payload(path, None)
    marker = tmp_path / "payload.ckpt.ran"
    result = run_cli(TOOL_COMMANDS[command](str(path), tmp_path), tmp_path)
    assert not marker.exists(), f"{command} ran the checkpoint's payload"
    one_error_line(result, f"checkpoint {path} was refused: it asks to import posix.system")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where, command", [
    ("datamodule_class_path", "analyze experts"),
    ("datamodule_class_path", "convert ds"),
    ("model _class_path", "test"),
    ("head class_path", "analyze rank"),
    ("head name", "analyze experts"),
    ("head name", "test"),
])
def test_a_class_path_outside_the_project_is_refused_before_it_is_imported(tmp_path, trained, where, command):
    """A checkpoint that weights_only accepts (strings only) but names ``subprocess.run`` /
    ``os.system`` as a class to build: refused, nothing run."""
    marker = tmp_path / "marker"
    checkpoint = torch.load(trained["lm"], map_location="cpu", weights_only=True)
    if where == "datamodule_class_path":
        checkpoint["datamodule_class_path"] = "subprocess.run"
        checkpoint["datamodule_hyper_parameters"] = {"args": f"touch {marker}", "shell": True}
        named = "the datamodule class 'subprocess.run'"
    elif where == "model _class_path":
        checkpoint["hyper_parameters"]["_class_path"] = "os.system"
        named = "the model class 'os.system'"
    elif where == "head name":
        # a module beside the checkpoint (the run starts in tmp_path, which Python puts on sys.path)
        # whose import would run code; the head named as a string, as heads.registry accepts it
        (tmp_path / "plantedhead.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Head: pass\n")
        checkpoint["hyper_parameters"]["head"] = "plantedhead.Head"
        named = "model.init_args.head 'plantedhead.Head'"
    else:
        checkpoint["hyper_parameters"]["head"] = {"class_path": "subprocess.run", "init_args": {"args": f"touch {marker}", "shell": True}}
        named = "model.init_args.head 'subprocess.run'"
    path = tmp_path / "named.ckpt"
    torch.save(checkpoint, path)
    result = run_cli(TOOL_COMMANDS[command](str(path), tmp_path), tmp_path)
    assert not marker.exists()
    one_error_line(result, f"checkpoint {path} names {named}", "refused, nothing was imported")


# ---------------------------------------------------------------------- damaged or foreign checkpoints
def record_offset(path: Path, name: str) -> int:
    """Byte offset of the data of zip record ``name`` in ``path``."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(name)
    header = path.read_bytes()[info.header_offset : info.header_offset + 30]
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def truncated(target: Path, good: Path) -> None:
    target.write_bytes(good.read_bytes()[:4096])


def random_bytes(target: Path, good: Path) -> None:
    target.write_bytes(bytes(range(7, 256)) * 40)


def empty(target: Path, good: Path) -> None:
    target.write_bytes(b"")


def bytes_changed(target: Path, good: Path) -> None:
    """The first 64 bytes of the first tensor record inverted: the archive is intact, one weight is not."""
    data, start = bytearray(good.read_bytes()), record_offset(good, "archive/data/0")
    data[start : start + 64] = bytes(b ^ 0xFF for b in data[start : start + 64])
    target.write_bytes(bytes(data))


def payload(target: Path, good: Path) -> None:
    """A checkpoint that runs ``touch <target>.ran`` when unpickled without weights_only."""
    torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": "tasks.LanguageModel"},
                "payload": Payload(target.with_name(target.name + ".ran"))}, target)


def foreign_class(target: Path, good: Path) -> None:
    """Weights-only-valid, but naming ``subprocess.run`` (with a command) as its datamodule."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    checkpoint["datamodule_class_path"] = "subprocess.run"
    checkpoint["datamodule_hyper_parameters"] = {"args": f"touch {target}.ran", "shell": True}
    torch.save(checkpoint, target)


def extra_hyper_parameter(target: Path, good: Path) -> None:
    """An edited checkpoint: a model hyper-parameter its task does not take."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["foo"] = 1
    torch.save(checkpoint, target)


def nested_hyper_parameter(target: Path, good: Path) -> None:
    """An edited checkpoint: an encoder hyper-parameter its encoder class does not take."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["encoder"]["init_args"]["dropout_hiddn"] = 0.1
    torch.save(checkpoint, target)


def non_finite(target: Path, good: Path) -> None:
    """Two NaN weights in class 3's row of a softmax language model's output layer."""
    checkpoint = torch.load(good, map_location="cpu", weights_only=True)
    checkpoint["state_dict"]["head.decoder.weight"][3, :2] = float("nan")
    torch.save(checkpoint, target)


def edited(edit):
    """A builder of ``good`` with ``edit(checkpoint)`` applied: a weights-only file whose data was
    changed, as an editor or a careless conversion script would."""
    def build(target: Path, good: Path) -> None:
        checkpoint = torch.load(good, map_location="cpu", weights_only=True)
        edit(checkpoint)
        torch.save(checkpoint, target)
    return build


def adam_moment_of_another_shape(checkpoint) -> None:
    """The first moment of the output layer's weight (parameter 5) one row short."""
    state = checkpoint["optimizer_states"][0]["state"][5]
    state["exp_avg"] = state["exp_avg"][:-1]


def big_endian(target: Path, good: Path) -> None:
    """The archive's byteorder record edited (every checksum valid): torch.load would byte-swap every weight."""
    import zipfile

    with zipfile.ZipFile(good) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, b"big" if name.endswith("/byteorder") else data)


#: Damaged and foreign checkpoints built from a good one (``builder(target, good)``), shared with
#: tests/test_bad_inputs_doc.py for the rows of docs/bad_inputs.md.
CHECKPOINT_FIXTURES = {
    "truncated.ckpt": truncated, "random.ckpt": random_bytes, "empty.ckpt": empty, "changed.ckpt": bytes_changed,
    "payload.ckpt": payload, "foreign_class.ckpt": foreign_class, "nan.ckpt": non_finite,
    "extra_hparam.ckpt": extra_hyper_parameter, "nested_hparam.ckpt": nested_hyper_parameter,
    "retyped.ckpt": edited(lambda c: c.update(callbacks="garbage")),
    "bfloat16.ckpt": edited(lambda c: c["state_dict"].update({"head.decoder.weight": c["state_dict"]["head.decoder.weight"].bfloat16()})),
    "adam_moment.ckpt": edited(adam_moment_of_another_shape),
    "old_version.ckpt": edited(lambda c: c.update({"pytorch-lightning_version": "0.9.0"})),
    "bad_hparam.ckpt": edited(lambda c: c["hyper_parameters"]["encoder"]["init_args"].update(dropout_output=7.0)),
    "big_endian.ckpt": big_endian,
    "weights_only.ckpt": edited(lambda c: [c.pop("optimizer_states"), c.pop("lr_schedulers")]),
}
EXPECTED = {
    "truncated.ckpt": "is cut short (4096 bytes, its zip archive has no end record)",
    "random.ckpt": "is not a PyTorch checkpoint (it starts with bytes 07 08 09 0a",
    "empty.ckpt": "is empty (0 bytes)",
    "changed.ckpt": "is damaged: the checksum of its record archive/data/0 does not match",
}


# Default suite: one command per reader path (the Trainer's restore, a tool); the other commands
# read through the same function and run with -m slow (docs/bad_inputs.md's rows add more).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind, command", [
    ("truncated.ckpt", "test"), pytest.param("random.ckpt", "validate", marks=SLOW),
    pytest.param("empty.ckpt", "predict", marks=SLOW), pytest.param("truncated.ckpt", "fit", marks=SLOW),
    ("changed.ckpt", "test"), ("truncated.ckpt", "analyze experts"), pytest.param("random.ckpt", "analyze rank", marks=SLOW),
    pytest.param("empty.ckpt", "convert ds", marks=SLOW), pytest.param("changed.ckpt", "bench ds", marks=SLOW),
])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, trained, kind, command):
    path = tmp_path / kind
    CHECKPOINT_FIXTURES[kind](path, trained["hierarchy" if command == "bench ds" else "lm"])
    if command in ("test", "validate", "predict", "fit"):
        args = [command, *lm(tmp_path), "--ckpt_path", str(path)]
    else:
        args = TOOL_COMMANDS[command](str(path), tmp_path)
    result = run_cli(args, tmp_path)
    one_error_line(result, f"checkpoint {path} {EXPECTED[kind]}")


#: One edited checkpoint per refusal of the structural checks (app/checkpoint_io/structure.py),
#: the command that reads it and what its one line says (after ``checkpoint <file>``).
EDITED = {
    "retyped.ckpt": ("test", ": callbacks must be a dictionary, got str 'garbage'; it is damaged or was edited"),
    "nan.ckpt": ("validate", ": state_dict.head.decoder.weight holds 2 non-finite value(s) (NaN or Inf)"),
    "bfloat16.ckpt": ("test", ": state_dict.head.decoder.weight is a bfloat16 tensor but the model's is float32"),
    "adam_moment.ckpt": ("fit", ": optimizer_states[0].state[5].exp_avg must be a floating-point tensor of its parameter's shape (40, 8), got a float32 tensor of shape (39, 8)"),
    "old_version.ckpt": ("predict", ": pytorch-lightning_version must be 2.0.0 or newer"),
    "bad_hparam.ckpt": ("analyze rank", ": its hyper_parameters do not build LanguageModel (AWDLSTMEncoder needs dropout_output in [0, 1)"),
    "big_endian.ckpt": ("convert export", " says its tensors are stored 'big'-endian"),
    "weights_only.ckpt": ("fit", " has no optimizer_states and no lr_schedulers (it holds the model only"),
}


@pytest.mark.parametrize("kind", sorted(EDITED))
def test_an_edited_checkpoint_is_one_line_naming_the_file_and_the_entry(tmp_path, trained, kind):
    """Loadable but edited: each used to be a traceback (inside Lightning's restore, or once
    training had started) or a silently different model (NaN, a cast dtype, byte-swapped weights)."""
    command, expected = EDITED[kind]
    path = tmp_path / kind
    CHECKPOINT_FIXTURES[kind](path, trained["lm"])
    if command in ("test", "validate", "predict", "fit"):
        args = [command, *lm(tmp_path), "--ckpt_path", str(path)] + (["--trainer.max_epochs", "2"] if command == "fit" else [])
    elif command == "convert export":
        args = ["convert", "export", "--ckpt_path", str(path), "--output", str(tmp_path / "out" / "head.pt2")]
    else:
        args = TOOL_COMMANDS[command](str(path), tmp_path)
    one_error_line(run_cli(args, tmp_path), f"checkpoint {path}{expected}")
    assert not (tmp_path / "out").exists()


#: A DS-Softmax checkpoint's index buffers edited (``state_dict`` edit), the command reading it and
#: what its one line says after ``checkpoint <file>: DSSoftmax buffer head.``.
DS_INDEX_EDITS = {
    "test": (lambda s: s["head.class_index"].__setitem__(0, -3),
             "class_index holds -3 at row 0, but every entry must be a class id in 0..99"),
    "analyze experts": (lambda s: s["head.expert_offsets"].__setitem__(1, 10**6),
                        "expert_offsets goes from 1000000 to "),
    "bench ds": (lambda s: s["head.class_index"].__setitem__(0, 10**6),
                 "class_index holds 1000000 at row 0, but every entry must be a class id in 0..99"),
}


@pytest.mark.parametrize("command", sorted(DS_INDEX_EDITS))
def test_an_edited_ds_softmax_index_buffer_is_one_line_naming_the_file_and_the_buffer(tmp_path, trained, command):
    """A class id out of range or an expert offset out of order used to be an IndexError or a
    RuntimeError traceback (exit 1); a negative class id wrapped to another class and the run
    scored a silently different model (exit 0). The head refuses them as its state dict loads."""
    edit, expected = DS_INDEX_EDITS[command]
    path = tmp_path / "ds_index.ckpt"
    edited(lambda c: edit(c["state_dict"]))(path, trained["hierarchy"])
    if command == "test":
        args = ["test", *TINY.args("configs/hierarchy/ds10x10.yaml", directory=tmp_path), "--ckpt_path", str(path)]
    else:
        args = TOOL_COMMANDS[command](str(path), tmp_path)
    one_error_line(run_cli(args, tmp_path), f"checkpoint {path}: DSSoftmax buffer head.{expected}",
                   "the checkpoint is damaged or was edited")
    assert not (tmp_path / "out").exists()


def test_a_device_given_as_a_checkpoint_is_named_as_such(tmp_path):
    result = run_cli(["test", *lm(tmp_path), "--ckpt_path", "/dev/zero"], tmp_path)
    one_error_line(result, "checkpoint /dev/zero is not a regular file (a device, pipe or socket)")


def test_another_tasks_checkpoint_names_both_tasks(tmp_path, trained):
    result = run_cli(["test", *lm(tmp_path), "--ckpt_path", str(trained["hierarchy"])], tmp_path)
    one_error_line(result, f"checkpoint {trained['hierarchy']} was written by task tasks.classification.ClassificationTask "
                                  f"but the model is tasks.language_model.LanguageModel")


def test_another_heads_checkpoint_names_both_heads(tmp_path, trained):
    # a head config given after --ckpt_path asks for that head explicitly (one given before it gives way)
    result = run_cli(["test", *lm(tmp_path), "--ckpt_path", str(trained["lm"]),
                      "--config", str(ROOT / "configs/heads/mos.yaml")], tmp_path)
    one_error_line(result, f"checkpoint {trained['lm']} holds a heads.softmax.Softmax head but the model builds "
                                  f"heads.mos.MixtureOfSoftmaxes")
    # refused before the run starts: no version directory is left
    assert not list((tmp_path / "runs").glob("*/version_*")), list((tmp_path / "runs").rglob("*"))


@pytest.mark.parametrize("where", ["model", "datamodule"])
def test_a_hyper_parameter_the_class_does_not_take_is_one_line(tmp_path, trained, where):
    """An edited checkpoint: an extra key would be a constructor traceback or a parser dump."""
    checkpoint = torch.load(trained["lm"], map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters" if where == "model" else "datamodule_hyper_parameters"]["foo"] = 1
    path = tmp_path / "extra.ckpt"
    torch.save(checkpoint, path)
    cls = "LanguageModel" if where == "model" else "SyntheticLM"
    for args in (["analyze", "rank", "--ckpt_path", str(path), "--output_dir", str(tmp_path / "out")],
                 ["test", *lm(tmp_path), "--ckpt_path", str(path)]):
        one_error_line(run_cli(args, tmp_path), f"checkpoint {path} has the {where} hyper-parameter 'foo', which {cls} "
                                                 f"does not take")


@pytest.mark.parametrize("command", ["analyze rank", "convert export", "convert ds"])
def test_a_nested_hyper_parameter_the_encoder_does_not_take_is_one_line_in_the_rebuilding_tools(tmp_path, trained, command):
    """Before: jsonargparse's ArgumentError traceback (``test --ckpt_path`` already gave one line).
    After: one line naming the checkpoint, the key and the class; nothing is written."""
    path = tmp_path / "nested_hparam.ckpt"
    nested_hyper_parameter(path, trained["lm"])
    args = {**TOOL_COMMANDS, "convert export": lambda ckpt, tmp: [
        "convert", "export", "--ckpt_path", ckpt, "--output", str(tmp / "out" / "head.pt2")]}[command](str(path), tmp_path)
    assert one_error_line(run_cli(args, tmp_path)) == (
        f"error: checkpoint {path} has the hyper-parameter 'dropout_hiddn' under model.init_args.encoder, which "
        f"tasks.encoders.AWDLSTMEncoder does not take: it was edited or written by another version of the project "
        f"(use a checkpoint written by python -m app fit)")
    assert not (tmp_path / "out").exists()


def test_a_dotted_name_for_a_callable_hyper_parameter_is_refused_before_it_is_imported(tmp_path, trained):
    """``optimizer: module.name`` would make the parser import the module."""
    marker = tmp_path / "marker"
    (tmp_path / "plantedopt.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Adam: pass\n")
    checkpoint = torch.load(trained["lm"], map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["optimizer"] = "plantedopt.Adam"
    path = tmp_path / "optimizer.ckpt"
    torch.save(checkpoint, path)
    result = run_cli(["test", *lm(tmp_path), "--ckpt_path", str(path)], tmp_path)
    assert not marker.exists()
    one_error_line(result, f"checkpoint {path} names model.init_args.optimizer 'plantedopt.Adam', which is not a class")


@pytest.mark.parametrize("command", ["test", pytest.param("fit", marks=pytest.mark.slow), "analyze rank"])
def test_a_permuted_vocabulary_of_the_same_size_is_refused(tmp_path, trained, command):
    """Another seed of the synthetic language: the same 40 words in another frequency order. Before
    fingerprints this loaded silently and scored nonsense. The tools rebuild the data from the
    checkpoint's own settings: there the data it names must have changed since (here its seed)."""
    saved = read_checkpoint(trained["lm"])["headbench"]["data_fingerprint"]
    path = trained["lm"]
    if command == "analyze rank":
        checkpoint = torch.load(trained["lm"], map_location="cpu", weights_only=True)
        checkpoint["datamodule_hyper_parameters"]["seed"] = 1
        path = tmp_path / "regenerated.ckpt"
        torch.save(checkpoint, path)
        args = TOOL_COMMANDS[command](str(path), tmp_path)
    else:
        args = [command, *lm(tmp_path), "--data.init_args.seed", "1", "--ckpt_path", str(path)]
    if command == "fit":
        args += ["--trainer.max_epochs", "2"]
    result = run_cli(args, tmp_path)
    line = one_error_line(result, f"checkpoint {path} was trained on a vocabulary / label set with "
                                         f"fingerprint {saved[:12]} but the data gives ", "(same size, other labels or order)")
    assert saved[:12] not in line.split("but the data gives")[1]


def test_the_fingerprint_is_stored_and_a_checkpoint_without_it_is_refused(tmp_path, trained):
    """Every run's checkpoint carries its task, head and data fingerprint; a file without that
    record comes from another version (or was edited) and is refused in one line."""
    from app.checkpoint_io import restore

    checkpoint = read_checkpoint(trained["lm"])
    assert checkpoint["headbench"]["task"] == "tasks.language_model.LanguageModel"
    assert checkpoint["headbench"]["head"] == "heads.softmax.Softmax"
    assert len(checkpoint["headbench"]["data_fingerprint"]) == 64
    del checkpoint["headbench"]
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    with pytest.raises(ValueError, match="stores no headbench record .* written by another version of the project") as error:
        restore(str(old))
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------- disk full, NaN state
def file_size_limit(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    return apply


@pytest.mark.slow  # a file-size limit on a process of its own
def test_a_full_disk_keeps_the_previous_checkpoint_and_leaves_no_temporary(tmp_path, trained):
    """The process may write at most half a checkpoint (RLIMIT_FSIZE; logs and configs are
    smaller), as on a disk that fills up during the write."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    previous = directory / "last.ckpt"
    previous.write_bytes(trained["lm"].read_bytes())
    before = digest(previous)
    result = run_app(["fit", *lm(tmp_path), "--checkpoint.dirpath", str(directory),
                      "--checkpoint.enable_version_counter", "false", "--checkpoint.save_top_k", "0"],
                     tmp_path, preexec_fn=file_size_limit(previous.stat().st_size // 2))
    one_error_line(result, f"cannot write checkpoint {previous}: File too large",
                          f"the previous {previous} is kept; free space or set --checkpoint.dirpath")
    assert digest(previous) == before
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt"], "no .tmp-* file left"


def test_nan_weights_are_refused_when_read_and_nothing_is_written(tmp_path, trained):
    """convert ds of a checkpoint whose head weights hold NaN: the reader refuses the input, naming
    the first non-finite tensor, before anything runs; the previous output is kept. (The writer
    refuses a non-finite state too: test_the_writer_refuses_nan_and_maps_disk_errors_to_one_line.)"""
    poisoned = tmp_path / "nan.ckpt"
    non_finite(poisoned, trained["lm"])
    output = tmp_path / "out" / "ds.ckpt"
    output.parent.mkdir()
    output.write_bytes(b"previous")
    result = run_cli(["convert", "ds", "--ckpt_path", str(poisoned), "--num_experts", "2", "--min_count", "1",
                      "--output", str(output)], tmp_path)
    one_error_line(result, f"checkpoint {poisoned}: state_dict.head.decoder.weight holds 2 non-finite value(s)")
    assert output.read_bytes() == b"previous" and sorted(p.name for p in output.parent.iterdir()) == ["ds.ckpt"]


def raise_disk_full(directory: Path) -> None:
    """Write ``last.ckpt`` with :class:`AtomicCheckpointIO`, then write it again while this process
    may write at most 2 KiB per file (Python ignores SIGXFSZ, so the write fails with EFBIG): the
    one-line error of a full disk. The limit is lifted again before returning."""
    io = AtomicCheckpointIO()
    path = directory / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    try:
        io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_the_writer_refuses_nan_and_maps_disk_errors_to_one_line(tmp_path):
    """The plugin itself, as Lightning calls it."""
    from app.checkpoint_io import CheckpointWriteError

    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    with pytest.raises(CheckpointWriteError, match=rf"^cannot write checkpoint {path}: File too large \(about 3.9 KiB to write\); "
                                                   rf"the previous {path} is kept; free space or set --checkpoint.dirpath$") as raised:
        raise_disk_full(tmp_path)
    assert isinstance(raised.value, OSError) and isinstance(raised.value, ValueError) and raised.value.errno == 27
    assert read_checkpoint(path)["state_dict"]["w"].sum() == 0, "the previous checkpoint is intact"
    before = digest(path)
    with pytest.raises(FloatingPointError, match=r"holds 1 non-finite value\(s\), first in b; the previous checkpoint is kept"):
        io.save_checkpoint({"state_dict": {"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])}}, path)
    assert digest(path) == before and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_disk_error_the_writing_library_hides_behind_its_own_error_is_the_disk_line(tmp_path):
    """torch's zip writer, refused by a full disk, raises a RuntimeError ("unexpected pos") while
    closing, with the ENOSPC as its context: the writer still gives the disk's one line and
    leaves no temporary."""
    import errno

    from datamodules.files import FileWriteError, write_atomically

    def write_like_torch_on_a_full_disk(handle) -> None:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 19200 vs 19152")

    path = tmp_path / "best.ckpt"
    with pytest.raises(FileWriteError, match=rf"^cannot write checkpoint {path}: No space left on device; nothing was "
                                             rf"written; free space or set --checkpoint.dirpath$"):
        write_atomically(path, write_like_torch_on_a_full_disk, "checkpoint", "free space or set --checkpoint.dirpath")
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_analysis_directory_is_refused_before_the_analysis_runs(tmp_path, trained):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory")
    result = run_cli(["analyze", "experts", "--ckpt_path", str(trained["hierarchy"]), "--output_dir", str(blocker / "out")], tmp_path)
    one_error_line(result, f"output_dir {blocker}/out cannot be created: {blocker} is a file, not a directory")


# ---------------------------------------------------------------------- the reader and the fingerprint
def test_fingerprints_tell_a_permuted_vocabulary_of_the_same_words_apart():
    from datamodules import SyntheticLM

    sizes = dict(vocab_size=40, train_tokens=2000, valid_tokens=400, test_tokens=400)
    first, again, other = SyntheticLM(**sizes), SyntheticLM(**sizes), SyntheticLM(**sizes, seed=1)
    assert sorted(first.vocabulary.itos) == sorted(other.vocabulary.itos) and first.vocabulary.itos != other.vocabulary.itos
    assert data_fingerprint(first) == data_fingerprint(again) != data_fingerprint(other)


def test_numeric_numpy_arrays_load_but_object_arrays_are_refused(tmp_path):
    """The allow-list beyond PyTorch's: numeric numpy arrays and scalars (random states), no objects."""
    import numpy as np

    state = {"state_dict": {"w": torch.ones(2)}, "rng": np.random.get_state(), "score": np.float64(0.5)}
    torch.save(state, tmp_path / "numbers.ckpt")
    loaded = read_checkpoint(tmp_path / "numbers.ckpt")
    assert loaded["rng"][0] == "MT19937" and loaded["rng"][1].dtype == np.uint32 and loaded["score"] == 0.5
    marker = tmp_path / "marker"
    torch.save({"state_dict": {}, "rng": np.array([Payload(marker)], dtype=object)}, tmp_path / "objects.ckpt")
    with pytest.raises(ValueError, match=r"objects.ckpt was refused: it asks to import numpy.dtypes.ObjectDType"):
        read_checkpoint(tmp_path / "objects.ckpt")
    assert not marker.exists()


@pytest.mark.slow  # a file-size limit on a process of its own
def test_a_full_disk_during_an_analysis_keeps_the_previous_report(tmp_path, trained):
    """analyze experts writes its figure and report through the same temporary-file-and-rename
    path: on a full disk (RLIMIT_FSIZE below the figure's size) one line, the previous report and
    figure untouched, no temporary file."""
    out = tmp_path / "analysis"
    out.mkdir()
    (out / "experts.json").write_text("previous report\n")
    (out / "heatmap.png").write_bytes(b"previous figure")
    result = run_app(["analyze", "experts", "--ckpt_path", str(trained["hierarchy"]), "--output_dir", str(out)],
                     tmp_path, preexec_fn=file_size_limit(1000))
    one_error_line(result, f"cannot write output {out}/heatmap.png: File too large",
                          f"the previous {out}/heatmap.png is kept; free space or pass another --output_dir")
    assert (out / "experts.json").read_text() == "previous report\n" and (out / "heatmap.png").read_bytes() == b"previous figure"
    assert sorted(p.name for p in out.iterdir()) == ["experts.json", "heatmap.png"]
