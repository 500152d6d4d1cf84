"""A checkpoint decides the architecture, never what runs or where (app/checkpoint_io/policy.py).

A checkpoint edited to carry runtime options — a ``torch.compile`` backend whose options name a
compiler command, a download switch with a URL and a directory, a Hugging Face hub name, a
ResNet's pretrained-weights download — is read by every command without any of them taking
effect: a marker file the payload would create never appears, the loopback server the
checkpoint names receives no request, nothing is written where the checkpoint points, and one
warning line names what was ignored. Runs in-process through the app's entry point."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
import torch
import yaml

from app.checkpoint_io import read_checkpoint
from app.main import main
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
    "analyze rank": (lambda ckpt, tmp: ["analyze", "rank", "--ckpt", str(ckpt), "--output-dir", str(tmp / "out"),
                                        "--max-contexts", "20"], None),
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
    "analyze rank": lambda ckpt, tmp: ["analyze", "rank", "--ckpt", str(ckpt), "--output-dir", str(tmp / "out")],
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
