"""End-to-end through the real LightningCLI: every LM config runs fit then test on tiny
generated corpora; TensorBoard event files are read back; predict writes its output;
user errors are one line."""

from __future__ import annotations

import glob
import os
import random
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.main import main
from app.tools import TOOLS
from tests.conftest import SHRINK, TRAINER, TinyConfig
from tests.events import check_hparams, read_events, read_hparams
from tests.shell import run_cli

ROOT = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(40)]

# Shrinks any LM config to a seconds-long run without changing what it exercises: the shared tiny
# config's network, batch and trainer options (tests/conftest.py), with three training batches (a DS
# head cloned at every step reaches three stages: tests/test_ds_callbacks.py).
TINY_LM = [*SHRINK["tasks.encoders.AWDLSTMEncoder"], *SHRINK["datamodules.TextCorpus"], *TRAINER, "--trainer.limit_train_batches", "3"]


def write_corpus(directory: Path, names: dict[str, str], lines: int = 120, seed: int = 0) -> Path:
    """PTB-layout text: whitespace tokens, some <unk>, one sentence per line."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for split, name in names.items():
        text = "\n".join(
            " ".join(rng.choice(WORDS + ["<unk>"]) for _ in range(rng.randint(3, 12))) for _ in range(lines)
        )
        (directory / name).write_text(text + "\n", encoding="utf-8")
    return directory


PTB = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}
WT2 = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}


run_dirs = TinyConfig.dirs


def fit_then_test(config: str, tmp_path: Path, extra: list[str]) -> dict[str, float]:
    args = ["--config", str(ROOT / config), *TINY_LM, *run_dirs(tmp_path), *extra]
    cli = main(["fit", *args])
    best = cli.trainer.checkpoint_callback.best_model_path
    assert best and os.path.exists(best), "fit must write a checkpoint chosen on val/loss"
    tested = main(["test", *args, "--ckpt_path", best])
    # The test run's HPARAMS row shows the test metrics, under the same columns as the fit's.
    fitted, test_run = (read_hparams(read_events(run.trainer.logger.log_dir)) for run in (cli, tested))
    assert {"test/ppl", "test/acc@1"} <= set(test_run.shown) and all(name.startswith("test/") for name in test_run.shown)
    assert test_run.columns == fitted.columns
    return {k: float(v) for k, v in tested.trainer.callback_metrics.items()}


#: The MoS presets' head projects to class embeddings tied to the input embedding: shrunk with it.
TINY_TIED_HEAD = ["--model.init_args.head.init_args.embedding_dim", "8"]


@pytest.mark.parametrize(
    "config, layout, extra",
    [("configs/lm/ptb.yaml", PTB, []), ("configs/lm/ptb_awd_lstm.yaml", PTB, []),
     ("configs/lm/ptb_mos.yaml", PTB, TINY_TIED_HEAD),
     ("configs/lm/wikitext2.yaml", WT2, []), ("configs/lm/wikitext2_awd_lstm.yaml", WT2, []),
     ("configs/lm/wikitext2_mos.yaml", WT2, TINY_TIED_HEAD)],
)
def test_text_corpus_configs_fit_then_test(config, layout, extra, tmp_path):
    data = write_corpus(tmp_path / "corpus", layout)
    metrics = fit_then_test(config, tmp_path, ["--data.init_args.data_dir", str(data), *extra])
    assert metrics["test/ppl"] > 1 and metrics["test/tokens"] > 0


def test_mos_preset_builds_the_papers_network_and_mixtape_lm_keeps_it(tmp_path):
    """configs/lm/ptb_mos.yaml at full size: three LSTMs 280 -> 960 -> 960 -> 620, MoS-15 projecting
    620 -> 15 x 280 and tied to the input embedding (MoS Table 8). configs/heads/mixtape_lm.yaml on
    top swaps the head for Mixtape with §3.4's regularisers and keeps the tied 280-wide embeddings."""
    data = ["--data.init_args.data_dir", str(write_corpus(tmp_path / "corpus", PTB)), *run_dirs(tmp_path)]
    mos = main(["--config", str(ROOT / "configs/lm/ptb_mos.yaml"), *data], run=False).model
    assert [(lstm.input_size, lstm.hidden_size) for lstm in mos.encoder.layers] == [(280, 960), (960, 960), (960, 620)]
    assert (mos.head.short_name, mos.head.num_components, mos.head.embedding_dim) == ("mos", 15, 280)
    assert mos.head.decoder.weight is mos.encoder.embedding.weight
    cli = main(["--config", str(ROOT / "configs/lm/ptb_mos.yaml"), "--config", str(ROOT / "configs/heads/mixtape_lm.yaml"), *data], run=False)
    head = cli.model.head
    assert (head.short_name, head.num_gates, head.embedding_dim, head.in_features) == ("mixtape", 4, 280, 620)
    assert (head.dropout, head.gate_dropout, head.gate_noise, head.weight_norm_scale) == (0.30, 0.2, 0.1, 1.0)
    assert head.decoder.weight is cli.model.encoder.embedding.weight
    metrics = fit_then_test("configs/lm/ptb_mos.yaml", tmp_path, [
        "--data.init_args.data_dir", str(tmp_path / "corpus"), "--config", str(ROOT / "configs/heads/mixtape_lm.yaml"),
        *TINY_TIED_HEAD,
    ])
    assert metrics["test/ppl"] > 1


def test_multi30k_captions_config_on_a_generated_layout(tmp_path):
    import gzip

    rng = random.Random(0)
    for task, files in {"task2": [f"{s}.{i}.en.gz" for s in ("train", "val") for i in range(1, 6)],
                        "task1": ["test_2016_flickr.en.gz"]}.items():
        (tmp_path / "m30k" / task).mkdir(parents=True)
        for name in files:
            lines = [" ".join(rng.choice(WORDS) for _ in range(6)).capitalize() + "." for _ in range(20)]
            with gzip.open(tmp_path / "m30k" / task / name, "wt", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
    metrics = fit_then_test(
        "configs/lm/multi30k_captions.yaml", tmp_path,
        ["--data.init_args.data_dir", str(tmp_path / "m30k"), "--data.init_args.cache", "false"],
    )
    assert metrics["test/ppl"] > 1


def test_tensorboard_events_have_the_expected_tags_and_reruns_do_not_clobber(tmp_path):
    data = write_corpus(tmp_path / "corpus", PTB)
    args = ["fit", "--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM, *run_dirs(tmp_path),
            "--data.init_args.data_dir", str(data), "--trainer.log_every_n_steps", "1"]
    main(args)
    main(args)  # the same directory again: must neither fail nor overwrite the first run
    versions = sorted(glob.glob(str(tmp_path / "runs" / "TextCorpus-softmax" / "version_*")))
    assert [os.path.basename(v) for v in versions] == ["version_0", "version_1"]
    events = EventAccumulator(versions[0])
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in ("train/loss", "val/loss", "val/ppl", "val/acc@1", "val/acc@10", "lr-Adam"):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
    # TensorBoard's HPARAMS tab: the language model's named metrics, not one ambiguous hp_metric.
    hparams = check_hparams(versions[0], head="softmax", data="TextCorpus",
                            metrics=["val/ppl", "val/acc@1", "val/acc@5", "val/acc@10"])
    assert hparams.columns["encoder"] == "AWDLSTMEncoder" and hparams.columns["data/num_classes"] > 0
    assert hparams.columns["head/num_components"] == hparams.columns["head/num_experts"] == 0, "softmax takes neither"


def test_predict_scores_and_samples_to_files(tmp_path):
    data = write_corpus(tmp_path / "corpus", PTB)
    base = ["--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM, *run_dirs(tmp_path),
            "--data.init_args.data_dir", str(data)]
    cli = main(["fit", *base])
    ckpt = cli.trainer.checkpoint_callback.last_model_path
    score_file, sample_file = tmp_path / "score.tsv", tmp_path / "samples.txt"
    main(["predict", *base, "--ckpt_path", ckpt, "--model.init_args.predict_output", str(score_file)])
    fields = dict(line.split("\t") for line in score_file.read_text().splitlines())
    assert int(fields["tokens"]) > 0 and float(fields["ppl"]) > 1
    main(["predict", *base, "--ckpt_path", ckpt, "--model.init_args.predict_mode", "sample",
          "--model.init_args.num_samples", "3", "--model.init_args.sample_length", "7",
          "--model.init_args.predict_output", str(sample_file), "--trainer.limit_predict_batches", "1"])
    samples = sample_file.read_text().splitlines()
    assert len(samples) == 3 and all(len(s.split()) == 7 for s in samples)
    vocabulary = set(WORDS) | {"<unk>", "<eos>"}
    assert all(set(s.split()) <= vocabulary for s in samples)


def test_unknown_head_on_the_command_line_is_one_line(tmp_path):
    data = write_corpus(tmp_path / "corpus", PTB)
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM, *run_dirs(tmp_path),
              "--data.init_args.data_dir", str(data), "--model.init_args.head", "mixture_of_nothing"])
    assert "unknown head 'mixture_of_nothing'" in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_from_another_vocabulary_is_refused(tmp_path):
    small = write_corpus(tmp_path / "small", PTB)
    base = ["--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM, *run_dirs(tmp_path)]
    cli = main(["fit", *base, "--data.init_args.data_dir", str(small)])
    ckpt = cli.trainer.checkpoint_callback.last_model_path
    WORDS.extend(f"extra{i}" for i in range(10))
    try:
        bigger = write_corpus(tmp_path / "bigger", PTB, seed=1)
    finally:
        del WORDS[-10:]
    with pytest.raises(ValueError, match=r"vocabulary of \d+ classes but the data gives \d+"):
        main(["test", *base, "--data.init_args.data_dir", str(bigger), "--ckpt_path", ckpt])


def test_print_config_shows_the_linked_model_and_head(capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs/lm/ptb.yaml"), "--print_config"])
    out = capsys.readouterr().out
    assert "tasks.LanguageModel" in out and "datamodules.TextCorpus" in out and "head:" in out


@pytest.mark.parametrize("words", [["--print_config", "-c", "CONFIG"], ["-c", "CONFIG", "--print_config=skip_null"],
                                   ["-c", "CONFIG", "--ckpt_path", "best", "--print_config"]])
def test_print_config_anywhere_and_with_a_checkpoint_the_cli_cannot_read_prints_and_runs_nothing(words, capsys):
    """``-c`` after ``--print_config`` is the config option, not the flag's value; ``--ckpt_path best``
    (resolved by the Trainer, not readable while parsing) still prints instead of running."""
    args = [str(ROOT / "configs/lm/ptb.yaml") if word == "CONFIG" else word for word in words]
    with pytest.raises(SystemExit) as stop:
        main(["test" if "best" in words else "fit", *args])
    assert stop.value.code in (0, None)
    out = capsys.readouterr().out
    assert "tasks.LanguageModel" in out and "datamodules.TextCorpus" in out


def test_tools_list_their_modes_and_reject_unknown_ones(capsys):
    assert main(["analyze", "--help"]) == 0
    with pytest.raises(ValueError, match="unknown bench mode 'nope': valid modes are"):
        main(["bench", "nope"])


@pytest.mark.parametrize("tool, mode", [(tool, mode) for tool, modes in TOOLS.items() for mode in sorted(modes)])
def test_every_registered_mode_imports_and_answers_help_under_its_name(tool, mode, capsys):
    """... and every project file or module its --help names exists (``convert ds --help`` cited
    heads/ds_screening.py, moved to heads/ds/screening.py)."""
    from tests.test_doc_commands import DOTTED_NAME, PROJECT_PATH, resolves

    with pytest.raises(SystemExit) as stop:
        main([tool, mode, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m app {tool} {mode} ")
    text = " ".join(out.split())  # argparse wraps lines anywhere
    paths = [path for path in PROJECT_PATH.findall(text) if not glob.glob(str(ROOT / path))]
    names = [name for name in DOTTED_NAME.findall(text) if not name.endswith((".py", ".yaml", ".md")) and not resolves(name)]
    assert not paths and not names, f"{tool} {mode} --help names what is not in the tree: {paths + names}"


def test_fit_help_lists_every_registered_head_with_a_line(capsys):
    from heads import available_heads

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--help"])
    assert stop.value.code == 0
    listing = capsys.readouterr().out.partition("\nheads (--model.init_args.head NAME")[2].splitlines()[1:]
    assert [line.split()[0] for line in listing] == available_heads(), listing
    assert all(len(line.split()) > 2 for line in listing), listing  # a name and its description


TINY_SYNTHETIC = SHRINK["datamodules.SyntheticLM"]


@pytest.mark.parametrize("head_config", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs/heads").glob("*.yaml")))
def test_every_head_config_composes_with_the_synthetic_lm(head_config, tmp_path):
    """configs/heads/*.yaml on configs/lm/synthetic.yaml: the composed run fits and tests."""
    args = ["--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(ROOT / head_config),
            *TINY_LM, *TINY_SYNTHETIC, *run_dirs(tmp_path), "--model.init_args.tie_weights", "false"]
    cli = main(["fit", *args])
    import yaml

    wanted = yaml.safe_load((ROOT / head_config).read_text())["model"]["init_args"]["head"]["class_path"]
    assert type(cli.model.head).__name__ == wanted.rpartition(".")[2]
    tested = main(["test", *args, "--ckpt_path", cli.trainer.checkpoint_callback.last_model_path])
    metrics = tested.trainer.callback_metrics
    assert float(metrics["test/ppl_over_true"]) > 0.5 and float(metrics["test/true_ppl"]) > 1


def test_resume_takes_what_the_user_wrote_and_the_rest_from_the_checkpoint(tmp_path):
    """``fit --ckpt_path`` with a changed argument trains with the new value (Lightning alone
    lets the checkpoint's hyper-parameters win); arguments left out come from the checkpoint."""
    data = write_corpus(tmp_path / "ptb", PTB)
    args = ["--config", str(ROOT / "configs/lm/ptb.yaml"), *TINY_LM, *run_dirs(tmp_path),
            "--data.init_args.data_dir", str(data)]
    first = main(["fit", *args, "--model.init_args.activation_regularization", "0.5"])
    assert first.model.hparams.encoder["init_args"]["dropout_output"] == 0.4
    last = first.trainer.checkpoint_callback.last_model_path
    resumed = main(["fit", *args, "--trainer.max_epochs", "2", "--ckpt_path", last,
                    "--model.init_args.encoder.init_args.dropout_output", "0.1"])
    assert resumed.trainer.current_epoch == 2
    assert resumed.model.hparams.encoder["init_args"]["dropout_output"] == 0.1  # written on the command line: wins
    assert resumed.model.hparams.activation_regularization == 0.5  # not written: from the checkpoint


def test_progress_output_is_the_text_bar_and_summary_unless_the_user_configures_rich():
    """rich arrives with other packages (transformers); the terminal output must not change with it."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar

    from app.cli import plain_progress_output

    pytest.importorskip("rich")
    trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    assert any(type(c) is RichProgressBar for c in trainer.callbacks)  # Lightning's default with rich installed
    plain_progress_output(trainer, None, terminal=True)
    assert [type(c) for c in trainer.callbacks if isinstance(c, (TQDMProgressBar, RichProgressBar))] == [TQDMProgressBar]
    assert [type(c) for c in trainer.callbacks if isinstance(c, ModelSummary)] == [ModelSummary]
    chosen = [RichProgressBar(), RichModelSummary()]
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, callbacks=chosen)
    plain_progress_output(trainer, chosen)
    assert chosen[0] in trainer.callbacks and chosen[1] in trainer.callbacks


def test_progress_without_a_terminal_is_whole_lines_and_a_fit_ends_with_its_summary(tmp_path):
    """stdout not a terminal (a log file, a job scheduler): progress comes as complete lines, no
    carriage-return frames; the fit ends with its best and last checkpoint and its log directory."""
    run = run_cli(["fit", *TinyConfig().args("configs/lm/synthetic.yaml"), "--trainer.enable_progress_bar", "true",
                   "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2", *run_dirs(tmp_path)], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "\r" not in run.stdout
    lines = run.stdout.splitlines()
    assert re.fullmatch(r"Epoch 0: 1/3 \(33%\) [\d.]+ it/s train/loss=[\d.]+", lines[0]), lines
    assert re.fullmatch(r"Validation \(epoch 0, step 3\): val/loss=[\d.]+ val/ppl=[\d.]+",
                        next(l for l in lines if l.startswith("Validation"))), lines
    version = tmp_path / "runs" / "SyntheticLM-softmax" / "version_0"
    assert lines[-3:] == [
        f"best checkpoint: {version}/checkpoints/best-epoch=0-step=3.ckpt (val/loss {float(lines[-3].rpartition(' ')[2][:-1]):.4g})",
        f"last checkpoint: {version}/checkpoints/last.ckpt",
        f"logs: {version} (tensorboard --logdir {version.parent.parent})",
    ], lines


def test_a_tiny_fit_test_and_predict_print_no_warning(tmp_path):
    """The notices the project makes moot (Lightning's logging-service tip, its own deprecated
    ``LeafSpec`` call, the ``IterableDataset`` length notice for the project's streams, a
    checkpoint directory that "changed" in an evaluation, ``predict returned None``) are not
    printed: a tiny synthetic fit, test and predict write no warning line."""
    args = [*TinyConfig().args("configs/lm/synthetic.yaml"), "--trainer.log_every_n_steps", "1", *run_dirs(tmp_path)]
    fit = run_cli(["fit", *args], tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    last = tmp_path / "runs" / "SyntheticLM-softmax" / "version_0" / "checkpoints" / "last.ckpt"
    outputs = [fit.stderr]
    for command in ("test", "predict"):
        done = run_cli([command, *args, "--ckpt_path", str(last)], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(done.stderr)
    warned = [line for text in outputs for line in text.splitlines()
              if re.search(r"\.py:\d+: |Warning|Tip:|deprecated|recommended", line)]
    assert warned == [], warned


#: A line of stderr that is a warning (Python's ``file.py:N:`` prefix, a category) or a notice.
WARNED = r"\.py:\d+: |Warning|Tip:|deprecated|recommended|Be aware|will override"


def test_evaluating_a_ds_run_without_its_training_callbacks_prints_no_warning(tmp_path):
    """``test``/``predict --ckpt_path`` of a DS-Softmax run with the task config alone (no
    ``Mitosis``, ``GroupLassoPruning``, ``LoadBalancing``, ``SparsityTracker``): an evaluation
    restores none of the run's training state, so Lightning's "Be aware that when using
    `ckpt_path`, callbacks used to create the checkpoint need to be provided" is not printed."""
    ds = [*TinyConfig().args("configs/lm/synthetic.yaml", "configs/heads/ds16.yaml"), "--trainer.log_every_n_steps", "1",
          *run_dirs(tmp_path)]
    fit = run_cli(["fit", *ds], tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    last = next(tmp_path.glob("runs/*/version_0/checkpoints/last.ckpt"))
    plain = [*TinyConfig().args("configs/lm/synthetic.yaml", model=False), "--trainer.log_every_n_steps", "1", *run_dirs(tmp_path)]
    for command in ("test", "predict"):
        done = run_cli([command, *plain, "--ckpt_path", str(last)], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        warned = [line for line in done.stderr.splitlines() if re.search(WARNED, line)]
        assert warned == [], (command, warned)


def test_the_unrestored_callbacks_notice_is_quiet_in_evaluations_only():
    """``fit --ckpt_path`` resumes the callbacks' states: there Lightning's notice stands."""
    import warnings

    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from app.runtime.notices import quiet_unrestored_callbacks_notice

    notice = ("Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to be provided during "
              "`Trainer` instantiation. Please add the following callbacks: ['Mitosis'].")
    shown = {}
    for command in ("fit", "validate", "test", "predict"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_unrestored_callbacks_notice(command):
                # as lightning/pytorch/trainer/call.py raises it
                exec(compile("rank_zero_warn(notice)", "call.py", "exec"),
                     {"__name__": "lightning.pytorch.trainer.call", "rank_zero_warn": rank_zero_warn, "notice": notice})
        shown[command] = [str(w.message) for w in caught]
    assert shown == {"fit": [notice], "validate": [], "test": [], "predict": []}


def test_the_projects_own_warnings_print_as_one_line_and_others_as_python_prints_them():
    """The console entry (``app.main.run``) prints a warning raised in the project's packages as
    ``path:line: Category: message``, without the source line Python adds; any other warning as before."""
    import warnings

    from app.main import one_line_project_warnings

    one_line_project_warnings()
    own = str(ROOT / "tasks" / "callbacks" / "mitosis.py")
    assert warnings.formatwarning("too short", UserWarning, own, 204, '    rank_zero_warn(f"{message}")') == \
        f"{own}:204: UserWarning: too short\n"
    assert warnings.formatwarning("too short", UserWarning, "/elsewhere/library.py", 3, "    warn(x)") == \
        "/elsewhere/library.py:3: UserWarning: too short\n  warn(x)\n"


def test_progress_output_stays_text_when_a_config_lists_callbacks(tmp_path):
    """A config with its own callbacks (not a progress bar): the terminal shows the text bar. The
    Trainer extends the callback list it is given, so the check must look at the list as written."""
    pytest.importorskip("rich")
    run = run_cli(
        ["fit", "--config", str(ROOT / "configs/lm/synthetic.yaml"), "--config", str(ROOT / "configs/heads/hybrid_lightrnn_codes.yaml"),
         "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
         "--data.init_args.train_tokens", "20000", "--data.init_args.valid_tokens", "2000", "--data.init_args.test_tokens", "2000"],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    output = run.stdout + run.stderr
    assert "it/s" in output and "Epoch 0: 2/2 (100%)" in output, output[-1500:]  # not a terminal: whole lines
    assert "━" not in output, "the rich progress bar was used"


def test_fit_without_a_logger_trains_and_a_listed_lr_monitor_is_one_line_that_writes_nothing(tmp_path):
    """``--trainer.logger false``: the learning-rate monitor the CLI adds is left out (it would stop
    the run at its first step, after config.yaml was written); one the user lists is refused in one
    line before the run writes anything, and so is a config.yaml of the user's where the run would
    save its own."""
    base = ["fit", "--config", str(ROOT / "configs/lm/synthetic.yaml"), "--trainer.logger", "false", *TINY_LM, *TINY_SYNTHETIC]
    plain = tmp_path / "plain"
    plain.mkdir()
    run = run_cli(base, plain)
    assert run.returncode == 0, run.stderr[-2000:]
    # the run's directory is default_root_dir (here the working directory): its config beside its checkpoints
    assert (plain / "checkpoints" / "last.ckpt").is_file() and (plain / "config.yaml").is_file()

    users = tmp_path / "users"
    users.mkdir()
    (users / "config.yaml").write_text("# the user's own\n")
    run = run_cli(base, users)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1 and "--trainer.default_root_dir" in errors[0], run.stderr[-2000:]
    assert [p.name for p in users.iterdir()] == ["config.yaml"], "refused before the run wrote anything"
    assert (users / "config.yaml").read_text() == "# the user's own\n"

    listed = tmp_path / "listed"
    listed.mkdir()
    run = run_cli([*base, "--trainer.callbacks+", "LearningRateMonitor"], listed)
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "LearningRateMonitor" in errors[0] and "trainer.logger is false" in errors[0], run.stderr[-2000:]
    assert list(listed.iterdir()) == []


def test_an_evaluation_without_a_logger_writes_what_was_asked_and_no_config_into_the_working_directory(tmp_path, tiny):
    """``predict|test --trainer.logger false``: Lightning's SaveConfigCallback wrote config.yaml into
    ``trainer.log_dir``, which without a logger is ``default_root_dir``, the working directory
    (overwriting a config.yaml of the user's there). An evaluation without a logger has no log
    directory: no config is saved, anywhere; the predictions asked for are written, the metrics printed."""
    config = "configs/lm/synthetic.yaml"
    fitted = tmp_path / "fit"
    done = run_cli(["fit", *tiny.args(config, directory=fitted)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    run = fitted / "runs" / "SyntheticLM-softmax" / "version_0"
    ckpt = run / "checkpoints" / "last.ckpt"
    before = sorted(p.name for p in run.iterdir())
    evaluation = [*tiny.args(config, model=False), "--ckpt_path", str(ckpt), "--trainer.logger", "false"]

    work = tmp_path / "work"
    work.mkdir()
    predictions = tmp_path / "out" / "score.tsv"
    done = run_cli(["predict", *evaluation, "--model.init_args.predict_output", str(predictions)], work)
    assert done.returncode == 0, done.stderr[-2000:]
    assert predictions.read_text().startswith("tokens\t") and "ppl\t" in predictions.read_text()
    assert list(work.iterdir()) == [], sorted(work.iterdir())

    (work / "config.yaml").write_text("# the user's own\n")
    done = run_cli(["test", *evaluation], work)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "test/ppl" in done.stdout, done.stdout[-2000:]
    assert [p.name for p in work.iterdir()] == ["config.yaml"] and (work / "config.yaml").read_text() == "# the user's own\n"
    assert sorted(p.name for p in run.iterdir()) == before, "an evaluation without a logger logged into the run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fit", "out", "work"]
    assert list((tmp_path / "out").iterdir()) == [predictions]


def test_an_evaluation_without_a_checkpoint_says_its_weights_are_untrained(tmp_path):
    """``test`` without ``--ckpt_path`` scores the model as built: one warning line says so (a
    table of metrics alone reads like a result)."""
    done = run_cli(["test", *TinyConfig().args("configs/lm/synthetic.yaml"), "--trainer.limit_test_batches", "1",
                    *run_dirs(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("warning: test without --ckpt_path")], done.stderr


def test_a_short_head_name_with_arguments_is_one_line_naming_its_class(tmp_path):
    """``--model.init_args.head mos`` followed by ``init_args`` options: the line says a short name
    takes none and gives the class path that does, not "unknown class 'mos'"."""
    done = run_cli(["fit", "--config", "configs/lm/synthetic.yaml", "--model.init_args.head", "mos",
                    "--model.init_args.head.init_args.num_components", "3", *run_dirs(tmp_path)])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: model.init_args.head 'mos' is a head's short name, which takes no init_args: to set its arguments name "
        "its class, --model.init_args.head heads.MixtureOfSoftmaxes --model.init_args.head.init_args.ARGUMENT VALUE")


@pytest.mark.parametrize("configs", [["configs/heads/mos.yaml"], ["configs/heads/mos.yaml", "configs/lm/synthetic.yaml"]])
def test_a_head_config_without_a_task_config_before_it_is_one_line(configs, tmp_path):
    """A head config alone, or before the task config, leaves the model without a task class when
    its head options are parsed: the line says to give a task config first."""
    done = run_cli(["fit", *[option for config in configs for option in ("--config", config)], *run_dirs(tmp_path)])
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: no task chosen before model option 'head.init_args.num_components': a head config composes after a task config")
