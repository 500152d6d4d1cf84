"""A checkpoint decides the architecture, never what runs or where (app/checkpoint_io/policy.py).

A checkpoint edited to carry runtime options — a ``torch.compile`` backend whose options name a
compiler command, a download switch with a URL and a directory, a Hugging Face hub name, a
ResNet's pretrained-weights download — is read by every command without any of them taking
effect: a marker file the payload would create never appears, the loopback server the
checkpoint names receives no request, nothing is written where the checkpoint points, and one
warning line names what was ignored. Runs in-process through the app's entry point."""

from __future__ import annotations

import http.server
import io
import re
import threading
from pathlib import Path

import pytest
import torch
import yaml

from app.checkpoint_io import read_checkpoint
from app.main import main
from tests.conftest import ROOT
from tests.test_disk import TINY

LM = [*TINY, "--trainer.limit_test_batches", "2", "--trainer.limit_predict_batches", "2", "--trainer.max_epochs", "1"]


def run_dirs(directory: Path) -> list[str]:
    return ["--trainer.default_root_dir", str(directory), "--trainer.logger.init_args.save_dir", str(directory / "runs")]


@pytest.fixture(scope="module")
def lm_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("policy")
    cli = main(["fit", *LM, *run_dirs(directory)])
    return Path(cli.trainer.checkpoint_callback.last_model_path)


def forged(source: Path, target: Path, edit) -> Path:
    """``source`` with ``edit(checkpoint)`` applied, written with ``torch.save`` (a plain
    weights-only file: the edit is data, as an attacker's would be)."""
    checkpoint = torch.load(source, weights_only=True)
    edit(checkpoint)
    torch.save(checkpoint, target)
    return target


class Recorder(http.server.BaseHTTPRequestHandler):
    """Serves a ``.pth`` payload and records every request it receives."""

    requests: list[str] = []

    def do_GET(self):  # noqa: N802 - the http.server hook name
        Recorder.requests.append(self.path)
        body = b"import os; os.system('touch /tmp/never')\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002
        pass


@pytest.fixture()
def server():
    Recorder.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def run(argv: list[str]) -> str | None:
    """``main(argv)``; the one-line error a user would see, or ``None`` when it succeeded."""
    try:
        main(argv)
    except ValueError as error:
        assert "\n" not in str(error), str(error)
        return str(error)
    return None


COMPILE_COMMANDS = {
    "test": lambda ckpt, tmp: ["test", *LM, *run_dirs(tmp), "--ckpt_path", str(ckpt)],
    "validate": lambda ckpt, tmp: ["validate", *LM, *run_dirs(tmp), "--ckpt_path", str(ckpt)],
    "predict": lambda ckpt, tmp: ["predict", *LM, *run_dirs(tmp), "--ckpt_path", str(ckpt),
                                  "--model.init_args.predict_output", str(tmp / "predictions.pt")],
    "fit --ckpt_path": lambda ckpt, tmp: ["fit", *LM, *run_dirs(tmp), "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt)],
}


#: The tools that rebuild a checkpoint alone, with what each prints or refuses on the tiny LM
#: checkpoint (a softmax head: ``bench ds`` and ``analyze experts`` want a DS-Softmax head and
#: refuse it in one line after reading the file; the others run to the end).
TOOLS = {
    "analyze rank": (lambda ckpt, tmp: ["analyze", "rank", "--ckpt_path", str(ckpt), "--output_dir", str(tmp / "out"),
                                        "--max_contexts", "20"], None),
    "analyze experts": (lambda ckpt, tmp: ["analyze", "experts", "--ckpt_path", str(ckpt), "--output_dir", str(tmp / "out")],
                        "sparse-experts interface"),
    "convert ds": (lambda ckpt, tmp: ["convert", "ds", "--ckpt_path", str(ckpt), "--output", str(tmp / "out" / "ds.ckpt")], None),
    "convert export": (lambda ckpt, tmp: ["convert", "export", "--ckpt_path", str(ckpt), "--output",
                                          str(tmp / "out" / "head.pt2")], None),
    "bench ds": (lambda ckpt, tmp: ["bench", "ds", "--ckpt_path", str(ckpt), "--tiny"], "DS-Softmax"),
}


@pytest.mark.parametrize("command", sorted(COMPILE_COMMANDS) + sorted(TOOLS))
def test_compile_options_in_a_checkpoint_never_run(command, lm_checkpoint, tmp_path, capfd, monkeypatch):
    """The compile payload of a weights-only checkpoint (inductor with a C++ compiler that is a
    shell command) is dropped by every command that reads a checkpoint: the command runs
    uncompiled (the DS tools refuse the softmax head in one line), the marker never appears, and
    a saved ``config.yaml`` holds no compile option to run later."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    marker = tmp_path / "MARKER"
    payload = {"backend": "inductor", "options": {"cpp.cxx": [f"sh -c 'touch {marker}; exec g++ \"$@\"' sh"]}}
    ckpt = forged(lm_checkpoint, tmp_path / "forged.ckpt", lambda c: c["hyper_parameters"].update(compile=payload))
    if command in COMPILE_COMMANDS:
        assert run(COMPILE_COMMANDS[command](ckpt, tmp_path)) is None
    else:
        argv, refusal = TOOLS[command]
        error = run(argv(ckpt, tmp_path))
        assert (error is None) if refusal is None else (refusal in (error or "")), error
    assert not marker.exists()
    err = capfd.readouterr().err
    assert "warning: checkpoint" in err and "model.init_args.compile" in err and "ignored" in err
    for config in tmp_path.rglob("config.yaml"):
        saved = yaml.safe_load(config.read_text())
        assert saved["model"]["init_args"].get("compile") in (False, None), config


def test_the_reader_drops_runtime_options_of_nested_classes(lm_checkpoint, tmp_path, capfd):
    """An encoder's runtime options (a ResNet's weights download, a hub name) are dropped like a
    task's own: every reader gets the checkpoint without them."""
    def edit(checkpoint):
        checkpoint["hyper_parameters"]["predict_output"] = "/etc/evil"
    ckpt = forged(lm_checkpoint, tmp_path / "forged.ckpt", edit)
    checkpoint = read_checkpoint(ckpt)
    assert "predict_output" not in checkpoint["hyper_parameters"]
    assert "model.init_args.predict_output" in capfd.readouterr().err


def test_a_hugging_face_encoder_named_by_a_checkpoint_does_not_choose_the_hub(tmp_path):
    from app.checkpoint_io.policy import drop_runtime_options

    checkpoint = {
        "state_dict": {},
        "hyper_parameters": {
            "_class_path": "tasks.LanguageModel",
            "encoder": {"class_path": "tasks.encoders.HuggingFaceEncoder",
                        "init_args": {"model": "org/name", "revision": "main", "pretrained": True, "config_overrides": None}},
        },
    }
    cleaned = drop_runtime_options(checkpoint, "forged.ckpt")
    assert cleaned["hyper_parameters"]["encoder"]["init_args"] == {"config_overrides": None}
    from tasks.encoders import HuggingFaceEncoder

    with pytest.raises(ValueError, match="HuggingFaceEncoder needs model: .*set model.init_args.encoder.init_args.model"):
        HuggingFaceEncoder(10)


def text_corpus_checkpoint(source: Path, target: Path, base_url: str, evil_dir: Path) -> Path:
    """A language-model checkpoint whose datamodule is a TextCorpus that asks to download a
    ``.pth`` file from ``base_url`` into ``evil_dir``."""
    def edit(checkpoint):
        checkpoint["datamodule_class_path"] = "datamodules.TextCorpus"
        checkpoint["datamodule_hyper_parameters"] = {
            "name": "ptb", "download": True, "base_url": base_url, "data_dir": str(evil_dir),
            "train_file": "evil.pth", "batch_size": 2, "eval_batch_size": 2, "bptt": 5,
        }
    return forged(source, target, edit)


DATA_TOOLS = {
    "analyze rank": lambda ckpt, tmp: ["analyze", "rank", "--ckpt_path", str(ckpt), "--output_dir", str(tmp / "out")],
    "analyze experts": lambda ckpt, tmp: ["analyze", "experts", "--ckpt_path", str(ckpt), "--output_dir", str(tmp / "out")],
    "convert ds": lambda ckpt, tmp: ["convert", "ds", "--ckpt_path", str(ckpt), "--output", str(tmp / "out" / "ds.ckpt")],
}


@pytest.mark.parametrize("tool", sorted(DATA_TOOLS))
def test_download_settings_in_a_checkpoint_fetch_nothing(tool, lm_checkpoint, tmp_path, server, monkeypatch, capfd):
    """The tools that rebuild a checkpoint's datamodule take no location from it: the server the
    checkpoint names is never asked, nothing is written into the directory it names; the data
    location is the user's (``--config``), here absent, so the tool stops at the missing files."""
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "site-packages"
    ckpt = text_corpus_checkpoint(lm_checkpoint, tmp_path / "forged.ckpt", server, evil)
    (tmp_path / "out").mkdir()
    error = run(DATA_TOOLS[tool](ckpt, tmp_path))
    assert Recorder.requests == []
    assert not evil.exists()
    assert error is not None and "data/ptb" in error  # the class default, not the checkpoint's directory
    assert "warning: checkpoint" not in capfd.readouterr().err  # a datamodule's settings are saved by design: no alarm


@pytest.mark.parametrize("command", sorted(COMPILE_COMMANDS) + ["bench ds", "convert export"])
def test_download_settings_in_a_checkpoint_fetch_nothing_in_other_readers(command, lm_checkpoint, tmp_path, server, monkeypatch):
    """The commands that take their data from the command line (``fit|validate|test|predict
    --ckpt_path``) or need none (``convert export``, ``bench ds``) read the same forged file
    without asking the server it names or writing where it points."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    evil = tmp_path / "site-packages"
    ckpt = text_corpus_checkpoint(lm_checkpoint, tmp_path / "forged.ckpt", server, evil)
    argv = COMPILE_COMMANDS[command] if command in COMPILE_COMMANDS else TOOLS[command][0]
    run(argv(ckpt, tmp_path))  # finishes, or refuses in one line (bench ds: not a DS head)
    assert Recorder.requests == []
    assert not evil.exists()


def test_a_tool_takes_the_data_location_from_the_users_config(lm_checkpoint, tmp_path, server):
    """``--config`` supplies the runtime data options for the checkpoint's data class; a config of
    another data class is one line naming both."""
    from app.checkpoint_io import restore

    ckpt = text_corpus_checkpoint(lm_checkpoint, tmp_path / "forged.ckpt", server, tmp_path / "evil")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
        (corpus / name).write_text("a b c\nb c a\n")
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump({"data": {"class_path": "datamodules.TextCorpus", "init_args": {"data_dir": str(corpus)}}}))
    from app.checkpoint_io.policy import runtime_data_options
    from datamodules import TextCorpus

    assert runtime_data_options([str(config)], TextCorpus, str(ckpt)) == {"data_dir": str(corpus)}
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"data": {"class_path": "datamodules.SyntheticLM"}}))
    with pytest.raises(ValueError, match="configures data datamodules.SyntheticLM, but checkpoint .* was trained on TextCorpus"):
        restore(str(ckpt), config=[str(other)])
    assert Recorder.requests == []


def test_download_refuses_renamed_canonical_files():
    """A download fetches only files whose checksums are pinned: a renamed canonical file is
    refused at construction instead of fetched unverified."""
    from datamodules import TextCorpus

    with pytest.raises(ValueError, match="download fetches only the canonical ptb files.*data.init_args.train_file"):
        TextCorpus(name="ptb", download=True, train_file="evil.pth")


def test_a_checkpoint_nested_exponentially_is_refused_at_once(lm_checkpoint, tmp_path):
    """A 40-level list of one reused object (``L = [L, L]``) is walked once per object and
    refused for its depth, instead of hanging every reader."""
    nested: list = []
    for _ in range(40):
        nested = [nested, nested]
    ckpt = forged(lm_checkpoint, tmp_path / "deep.ckpt", lambda c: c["hyper_parameters"].update(encoder={"init_args": {"x": nested}}))
    with pytest.raises(ValueError, match="nested deeper than 32 levels"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["hyper_parameters"].update(hidden_size=16), "hyper-parameter 'hidden_size', which LanguageModel does not take: "
                                                             "it was edited or written by another version of the project"),
    (lambda c: c["hyper_parameters"]["encoder"].update(class_path="tasks.lm_encoders.AWDLSTMEncoder"),
     "names model.init_args.encoder 'tasks.lm_encoders.AWDLSTMEncoder', which does not exist in this version of the project"),
])
def test_a_checkpoint_of_an_older_layout_is_refused_in_one_line(edit, message, lm_checkpoint, tmp_path):
    """No upgrade code: a flat hyper-parameter or a class path of a former module layout is one
    line saying the file comes from another version."""
    ckpt = forged(lm_checkpoint, tmp_path / "old.ckpt", edit)
    with pytest.raises(ValueError, match=message) as error:
        read_checkpoint(ckpt)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("command", ["test", "fit --ckpt_path"])
def test_ckpt_path_is_read_once_per_command(command, lm_checkpoint, tmp_path, monkeypatch):
    """The CLI reads ``--ckpt_path`` for the model it builds and hands the dictionary to the
    Trainer's restore: one ``torch.load`` of the file per command."""
    import app.checkpoint_io.reading as reading

    loads = []
    real_load = torch.load

    def counting_load(*args, **kwargs):
        loads.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(reading.torch, "load", counting_load)
    ckpt = tmp_path / "copy.ckpt"
    ckpt.write_bytes(lm_checkpoint.read_bytes())
    assert run(COMPILE_COMMANDS[command](ckpt, tmp_path)) is None
    assert len(loads) == 1, loads
    assert reading.HANDED_OVER == {}


def test_a_checkpoints_callback_state_deletes_nothing_outside_its_directory(lm_checkpoint, tmp_path):
    """The top-k bookkeeping a checkpoint carries names paths that Lightning deletes once they
    fall out of the top k: a path out of the checkpoint directory (``<dir>/../victim``) and a
    user's own ``.ckpt`` file in it that torch.save did not write are dropped at restore, so
    resuming such a file deletes none of the user's files."""
    directory = tmp_path / "ckpts"
    directory.mkdir()
    victims = [tmp_path / "victim1.txt", tmp_path / "victim2.txt", directory / "notes.ckpt"]
    for victim in victims:
        victim.write_text("precious")

    def edit(checkpoint):
        key = next(k for k in checkpoint["callbacks"] if k.startswith("TopKAndLastCheckpoint"))
        escape = [f"{directory}/../{victim.name}" for victim in victims[:2]]
        checkpoint["callbacks"][key].update(
            dirpath=str(directory), best_k_models={escape[0]: torch.tensor(1e9), str(victims[2]): torch.tensor(1e8)},
            kth_best_model_path=escape[0], kth_value=torch.tensor(1e9), best_model_score=torch.tensor(1e8),
            best_model_path=str(victims[2]), last_model_path=escape[1])

    ckpt = forged(lm_checkpoint, directory / "last.ckpt", edit)
    assert run(["fit", *LM, *run_dirs(tmp_path), "--trainer.max_epochs", "2", "--checkpoint.dirpath", str(directory),
                "--ckpt_path", str(ckpt)]) is None
    assert all(victim.read_text() == "precious" for victim in victims)


def test_a_checkpoint_written_by_fit_reads_without_a_warning(lm_checkpoint, capfd):
    """The warning is an alarm for an edited file: a run's own checkpoint (whose datamodule
    settings record where its data was) reads silently, its locations dropped all the same."""
    checkpoint = read_checkpoint(lm_checkpoint)
    assert "num_workers" not in checkpoint["datamodule_hyper_parameters"]
    assert "warning" not in capfd.readouterr().err


def test_hugging_face_config_overrides_may_not_set_private_fields():
    """``_attn_implementation`` can name hub code to load: config_overrides takes public fields only."""
    pytest.importorskip("transformers")
    from tasks.encoders import HuggingFaceEncoder

    with pytest.raises(ValueError, match="config_overrides may set the model's public config fields only, got '_attn_implementation'"):
        HuggingFaceEncoder(10, model="/nonexistent-but-local/", config_overrides={"_attn_implementation": "org/kernel"})


def test_a_model_part_missing_a_saved_argument_is_refused_naming_it(lm_checkpoint, tmp_path):
    """fit saves every argument of the head and the encoder; one deleted would silently be built
    with its default (another model than the trained one), so the reader refuses it."""
    ckpt = forged(lm_checkpoint, tmp_path / "edited.ckpt",
                  lambda c: c["hyper_parameters"]["encoder"]["init_args"].pop("dropout_hidden"))
    with pytest.raises(ValueError, match=r"hyper_parameters\.encoder\.init_args has no 'dropout_hidden', which python -m app fit "
                                         r"saves with every argument of tasks\.encoders\.awd_lstm\.AWDLSTMEncoder"):
        read_checkpoint(ckpt)


def test_a_saved_optimizer_setting_out_of_its_range_is_refused_before_training(lm_checkpoint, tmp_path):
    """A beta of 7 is a number, so the kind check passes, but Adam's own constructor refuses it: the
    resume is one line naming the group and Adam's rule, not a traceback or a diverging run."""
    def edit(checkpoint):
        group = checkpoint["optimizer_states"][0]["param_groups"][0]
        group["betas"] = (group["betas"][0], 7)

    ckpt = forged(lm_checkpoint, tmp_path / "edited.ckpt", edit)
    with pytest.raises(ValueError, match=r"optimizer_states\[0\]\.param_groups\[0\] is refused by Adam: Invalid beta parameter at index 1"):
        main(["fit", *LM, *run_dirs(tmp_path / "run"), "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt)])


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
                                       torch.optim.Adagrad, torch.optim.NAdam, torch.optim.RAdam])
def test_an_untouched_optimizer_group_passes_the_resume_check(optimizer):
    """The resume check rebuilds each group with the optimizer's constructor: a group as torch's own
    optimizers keep it passes (AdamW keeps a default its constructor does not take as an argument)."""
    from types import SimpleNamespace

    from tasks.checkpoint_fit import check_param_groups

    check_param_groups(SimpleNamespace(optimizers=[optimizer([torch.nn.Parameter(torch.zeros(2))], lr=0.01)]), "run.ckpt")


def test_a_saved_optimizer_group_missing_a_setting_is_refused_before_training(lm_checkpoint, tmp_path):
    """Adam reads its betas at every step: a resume from a group without them is one line at the
    restore (not a KeyError at the first step), and the run's checkpoints are untouched."""
    ckpt = forged(lm_checkpoint, tmp_path / "edited.ckpt", lambda c: c["optimizer_states"][0]["param_groups"][0].pop("betas"))
    with pytest.raises(ValueError, match=r"optimizer_states\[0\]\.param_groups\[0\]\.betas is missing \(Adam reads it at every step"):
        main(["fit", *LM, *run_dirs(tmp_path / "run"), "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt)])


@pytest.mark.parametrize("text", ["{class_path: antigravity.geohash, init_args: {}}", "- antigravity", "CONFIG_FILE"])
def test_text_where_a_class_is_expected_is_refused_before_the_parser_reads_it(text, lm_checkpoint, tmp_path, monkeypatch):
    """The CLI's parser reads a string given for a class-typed argument as YAML or as the path of
    a config file, and imports the class it then names: a checkpoint's ``encoder`` (or optimizer,
    scheduler) given as such text is one line, and the module it names is never imported."""
    import sys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "CONFIG_FILE").write_text("class_path: antigravity.geohash\n")
    ckpt = forged(lm_checkpoint, tmp_path / "text.ckpt", lambda c: c["hyper_parameters"].update(encoder=text))
    line = run(["test", *LM, *run_dirs(tmp_path), "--ckpt_path", str(ckpt)])
    assert line is not None and "where a class is expected" in line and "model.init_args.encoder" in line, line
    assert "antigravity" not in sys.modules


def test_a_compressed_record_is_refused_without_inflating_it(lm_checkpoint, tmp_path):
    """torch.save stores every record as it is; a deflated record added to a checkpoint (a zip
    bomb: gigabytes of zeros in a few megabytes) is refused from the archive's directory, before
    the checksum scan would inflate it."""
    import zipfile

    ckpt = tmp_path / "bomb.ckpt"
    ckpt.write_bytes(lm_checkpoint.read_bytes())
    with zipfile.ZipFile(ckpt, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("last/extra", b"\0" * 10_000_000)
    with pytest.raises(ValueError, match="has a record 'last/extra' that is compressed or larger than the file") as error:
        read_checkpoint(ckpt)
    assert "\n" not in str(error.value)


def test_an_entry_nested_thousands_of_levels_deep_is_one_line(lm_checkpoint, tmp_path):
    """Nesting outside the hyper-parameters (here Lightning's ``loops``) is bounded too: one line
    naming the entry, not a ``RecursionError`` in a later reader."""
    import sys

    nested: list = [0]
    for _ in range(5000):
        nested = [nested]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        ckpt = forged(lm_checkpoint, tmp_path / "deep.ckpt", lambda c: c["loops"].update(extra=nested))
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ValueError, match=r"loops\.extra\.0\.0.* is nested deeper than 32 levels"):
        read_checkpoint(ckpt)


def test_sizes_that_do_not_fit_in_memory_are_one_line(lm_checkpoint, tmp_path, capsys, monkeypatch):
    """A checkpoint claiming an embedding a billion wide makes the model's allocation fail: the
    console entry prints one ``error:`` line saying so and exits 2, not the allocator's traceback."""
    import sys

    from app.main import run as console
    from tests.conftest import TinyConfig

    def edit(checkpoint):
        checkpoint["hyper_parameters"]["encoder"]["init_args"]["embedding_dim"] = 10**9

    ckpt = forged(lm_checkpoint, tmp_path / "big.ckpt", edit)
    argv = ["python -m app", "test", *TinyConfig().args("configs/lm/synthetic.yaml", model=False), *run_dirs(tmp_path),
            "--ckpt_path", str(ckpt)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        console()
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1 and err[0].startswith("error: out of memory: an array of"), err


# ------------------------------------------------------------------ LR scheduler states
#: The LM run with Lightning's ReduceLROnPlateau on val/loss (as the security review's run had it).
PLATEAU = ["--model.init_args.lr_scheduler", '{"class_path": "lightning.pytorch.cli.ReduceLROnPlateau", '
           '"init_args": {"monitor": "val/loss", "factor": 0.5, "patience": 1}}']


@pytest.fixture(scope="module")
def plateau_checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("plateau")
    cli = main(["fit", *LM, *PLATEAU, *run_dirs(directory)])
    return Path(cli.trainer.checkpoint_callback.last_model_path)


def resume(ckpt: Path, directory: Path, *extra: str) -> list[str]:
    return ["fit", *LM, *extra, *run_dirs(directory), "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt)]


def plateau_scheduler(**settings):
    """A ReduceLROnPlateau as the PLATEAU run builds it (one Adam group)."""
    from lightning.pytorch.cli import ReduceLROnPlateau

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    return ReduceLROnPlateau(optimizer, **{"monitor": "val/loss", "factor": 0.5, "patience": 1, **settings})


def scheduler_refusal(scheduler, state: dict) -> str | None:
    """The one line :func:`tasks.checkpoint_fit.check_scheduler_states` refuses ``state`` with, or ``None``."""
    from types import SimpleNamespace

    from tasks.checkpoint_fit import check_scheduler_states

    try:
        check_scheduler_states(SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)]), [state], "run.ckpt")
    except ValueError as error:
        assert "\n" not in str(error), str(error)
        return str(error)
    return None


@pytest.mark.parametrize("entry", ["step", "optimizer"])
def test_a_saved_scheduler_entry_that_is_not_in_its_state_is_refused_before_training(entry, plateau_checkpoint, tmp_path):
    """torch restores a scheduler with ``__dict__.update``: an entry ``step`` or ``optimizer`` would
    replace the scheduler's method or its optimizer (a traceback at the first epoch's end, or at
    the start). The resume is one line naming the file and the entry, and no checkpoint is written."""
    ckpt = forged(plateau_checkpoint, tmp_path / "edited.ckpt", lambda c: c["lr_schedulers"][0].__setitem__(entry, "x"))
    error = run(resume(ckpt, tmp_path / "run", *PLATEAU))
    assert error is not None and error.startswith(f"checkpoint {ckpt}: lr_schedulers[0].{entry} is not an entry of the run's "
                                                  f"ReduceLROnPlateau state"), error
    assert "start a new fit without --ckpt_path" in error
    assert not list((tmp_path / "run").rglob("*.ckpt"))


def test_a_saved_scheduler_setting_its_constructor_refuses_is_refused_naming_it(plateau_checkpoint, tmp_path):
    """A factor of 5 is a number, so the kind check passes, but ReduceLROnPlateau's constructor
    refuses it (the learning rate would grow at every plateau): one line naming the entry, the
    value and torch's rule, before training."""
    ckpt = forged(plateau_checkpoint, tmp_path / "edited.ckpt", lambda c: c["lr_schedulers"][0].__setitem__("factor", 5.0))
    error = run(resume(ckpt, tmp_path / "run", *PLATEAU))
    assert error is not None and (f"checkpoint {ckpt}: lr_schedulers[0].factor must be a value ReduceLROnPlateau accepts "
                                  f"(Factor should be < 1.0.), got float 5.0; ") in error, error


def test_a_nan_scheduler_value_is_refused_and_never_reaches_a_new_checkpoint(plateau_checkpoint, tmp_path):
    """A NaN ``best`` was accepted and copied into the resumed run's last.ckpt; now the resume stops
    in one line before anything is written."""
    ckpt = forged(plateau_checkpoint, tmp_path / "edited.ckpt", lambda c: c["lr_schedulers"][0].__setitem__("best", float("nan")))
    error = run(resume(ckpt, tmp_path / "run", *PLATEAU))
    assert error is not None and f"checkpoint {ckpt}: lr_schedulers[0].best must be a number, not NaN, got float nan" in error
    assert not list((tmp_path / "run").rglob("*.ckpt"))


def test_an_unedited_scheduler_state_resumes(plateau_checkpoint, tmp_path):
    """The check does not stand in the way of a real resume: the run's own checkpoint trains on."""
    assert run(resume(plateau_checkpoint, tmp_path / "run", *PLATEAU)) is None
    assert list((tmp_path / "run").rglob("last.ckpt"))


def test_a_saved_scheduler_value_in_range_is_what_the_resumed_scheduler_has(plateau_checkpoint, tmp_path):
    """The check refuses; it never rewrites: a saved value in range (a cooldown of 2 epochs, where the
    run's config has none) is what the resumed scheduler has, as Lightning restores it."""
    ckpt = forged(plateau_checkpoint, tmp_path / "resumed.ckpt", lambda c: c["lr_schedulers"][0].__setitem__("cooldown", 2))
    cli = main(resume(ckpt, tmp_path / "run", *PLATEAU))
    assert cli.trainer.lr_scheduler_configs[0].scheduler.cooldown == 2


def test_a_checkpoint_without_the_runs_scheduler_is_refused(lm_checkpoint, tmp_path):
    """Lightning pairs the saved states with the run's schedulers by ``zip``: a checkpoint with no
    scheduler state resumed by a run that builds one would silently restart its schedule."""
    error = run(resume(lm_checkpoint, tmp_path / "run", *PLATEAU))
    assert error is not None and (f"checkpoint {lm_checkpoint}: lr_schedulers holds 0 scheduler state(s) but the run builds 1 "
                                  f"(ReduceLROnPlateau)") in error, error


#: (entry, edited value, the refusal's rule) of a saved ReduceLROnPlateau state.
PLATEAU_EDITS = [
    ("factor", float("nan"), r"lr_schedulers\[0\]\.factor must be a number, not NaN, got float nan"),
    ("min_lrs", [float("nan")], r"lr_schedulers\[0\]\.min_lrs\[0\] must be a number, not NaN"),
    ("min_lrs", [], r"lr_schedulers\[0\]\.min_lrs must be a list of 1 entries .*, got list \[\]"),
    ("min_lrs", [-0.1], r"lr_schedulers\[0\]\.min_lrs\[0\] must be a number >= 0"),
    ("patience", -5, r"lr_schedulers\[0\]\.patience must be an integer >= 0 \(a count\), got int -5"),
    ("cooldown", 1.5, r"lr_schedulers\[0\]\.cooldown must be an integer >= 0"),
    ("num_bad_epochs", -1, r"lr_schedulers\[0\]\.num_bad_epochs must be an integer >= 0"),
    ("last_epoch", -3, r"lr_schedulers\[0\]\.last_epoch must be an integer >= 0"),
    ("eps", float("inf"), r"lr_schedulers\[0\]\.eps must be finite, got float inf"),
    ("best", float("nan"), r"lr_schedulers\[0\]\.best must be a number, not NaN"),
    ("best", float("-inf"), r"lr_schedulers\[0\]\.best must be finite or inf, got float -inf"),
    ("threshold", -1.0, r"lr_schedulers\[0\]\.threshold must be a number >= 0"),
    ("mode", "sideways", r"lr_schedulers\[0\]\.mode must be a value ReduceLROnPlateau accepts \(mode sideways is unknown!\)"),
    ("threshold_mode", 3, r"lr_schedulers\[0\]\.threshold_mode must be a string, got int 3"),
    ("monitor", None, r"lr_schedulers\[0\]\.monitor must be a string, got NoneType None"),
]


@pytest.mark.parametrize("key, value, message", PLATEAU_EDITS, ids=[f"{k}={v!r}" for k, v, _ in PLATEAU_EDITS])
def test_a_plateau_value_of_another_kind_or_out_of_range_is_refused(key, value, message, plateau_checkpoint):
    """Each saved value has the kind the run's scheduler keeps (a number, not NaN; infinite only
    where the fresh value is that infinity; a list of one value per group) and its range (counters
    integers >= 0, rates >= 0; the rest by ReduceLROnPlateau's constructor)."""
    state = torch.load(plateau_checkpoint, weights_only=True)["lr_schedulers"][0]
    state[key] = value
    error = scheduler_refusal(plateau_scheduler(), state)
    assert error is not None and error.startswith("checkpoint run.ckpt: ") and re.search(message, error), error


def test_a_saved_plateau_state_missing_an_entry_is_refused(plateau_checkpoint):
    """A deleted entry (the best loss so far) would silently restart from the fresh value."""
    state = torch.load(plateau_checkpoint, weights_only=True)["lr_schedulers"][0]
    del state["best"]
    error = scheduler_refusal(plateau_scheduler(), state)
    assert error is not None and "lr_schedulers[0].best is missing (ReduceLROnPlateau keeps it in its state" in error, error


def other_scheduler(name: str):
    from tasks.translation import InverseSquareRootLR

    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    return {"StepLR": lambda: torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8),
            "MultiStepLR": lambda: torch.optim.lr_scheduler.MultiStepLR(optimizer, [6, 7], gamma=0.3),
            "CosineAnnealingLR": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10),
            "InverseSquareRootLR": lambda: InverseSquareRootLR(optimizer, warmup_steps=200)}[name]()


#: (scheduler class, entry, edited value, the refusal's rule) for the classes configs/ ship.
SHIPPED_EDITS = [
    ("StepLR", "step_size", 0, r"\.step_size must be an integer >= 1 \(a period\), got int 0"),
    ("StepLR", "gamma", float("nan"), r"\.gamma must be a number, not NaN"),
    ("MultiStepLR", "milestones", {6: 1}, r"\.milestones must be a Counter of epochs"),
    ("MultiStepLR", "_step_count", 2.5, r"\._step_count must be an integer >= 0"),
    ("CosineAnnealingLR", "T_max", -10, r"\.T_max must be an integer >= 1"),
    ("CosineAnnealingLR", "base_lrs", [0.01, 0.01], r"\.base_lrs must be a list of 1 entries"),
    ("InverseSquareRootLR", "warmup_steps", 0, r"\.warmup_steps must be an integer >= 1"),
    ("InverseSquareRootLR", "lr_lambdas", [{"__call__": "x"}], r"\.lr_lambdas\[0\] must be a dictionary with the keys \(none\)"),
    ("InverseSquareRootLR", "_get_lr_called_within_step", "yes", r"\._get_lr_called_within_step must be true or false"),
]


@pytest.mark.parametrize("name, key, value, message", SHIPPED_EDITS, ids=[f"{n}.{k}={v!r}" for n, k, v, _ in SHIPPED_EDITS])
def test_an_edited_value_of_the_shipped_scheduler_classes_is_refused(name, key, value, message):
    """The same comparison holds for every class the configs ship (configs/): periods are integers
    >= 1 (StepLR and CosineAnnealingLR divide by them), MultiStepLR's milestones stay a Counter, and
    the state of InverseSquareRootLR's schedule function cannot gain attributes."""
    state = other_scheduler(name).state_dict()
    state[key] = value
    error = scheduler_refusal(other_scheduler(name), state)
    assert error is not None and re.search(r"^checkpoint run\.ckpt: lr_schedulers\[0\]" + message, error), error


def shipped_schedulers() -> list[tuple[str, str, dict]]:
    """(config, class_path, init_args) of every lr_scheduler a config in configs/ sets."""
    found = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        scheduler = (model.get("init_args") or {}).get("lr_scheduler") if isinstance(model, dict) else None
        if isinstance(scheduler, dict):
            found.append((str(path.relative_to(ROOT)), scheduler["class_path"], scheduler.get("init_args") or {}))
    return found


SHIPPED_SCHEDULERS = shipped_schedulers()


@pytest.mark.parametrize("config, class_path, init_args", SHIPPED_SCHEDULERS, ids=[c for c, _, _ in SHIPPED_SCHEDULERS])
def test_a_shipped_schedulers_own_state_passes_the_check_after_steps(config, class_path, init_args):
    """A scheduler a config in configs/ sets, stepped as a run steps it (past a plateau or a
    milestone) and saved and loaded as a checkpoint holds it, passes the check against a fresh
    one of the same settings: the resume of every shipped run is untouched."""
    import importlib

    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)

    def build():
        return cls(torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.01), **init_args)

    scheduler = build()
    for step in range(12):
        scheduler.optimizer.step()
        scheduler.step(1.0 + step) if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else scheduler.step()
    buffer = io.BytesIO()
    torch.save([scheduler.state_dict()], buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)[0]
    assert scheduler_refusal(build(), state) is None, config
