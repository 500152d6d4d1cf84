"""The project's LightningCLI: ``python -m app fit|validate|test|predict``.

``python -m app fit --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml`` trains and
evaluates. :class:`WorkbenchCLI` links data-derived sizes into the model, names runs after data and
head, checkpoints on ``val/loss`` (:class:`app.runtime.checkpoint.TopKAndLastCheckpoint`) and lets
what the user wrote win over a checkpoint's hyper-parameters; :func:`run_command` runs one command
with the run's lock, signal handling and one-line errors. The dispatch of every command (tools, demo)
and the console entry are :mod:`app.main`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from jsonargparse import ArgumentError, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningCLI

import datamodules  # noqa: F401  (registers data classes for short class paths)
import heads  # noqa: F401  (registers heads for short names)
import tasks  # noqa: F401
# Imported so their callbacks resolve by short name: --trainer.callbacks+=Mitosis.
import tasks.callbacks  # noqa: F401
from app.checkpoint_io import checkpoint_class_conflict, checkpoint_model_config
from app.errors import argument_error_line, check_config_files, lightning_error_line, root_user_error
from app.runtime import ranks, signals
from app.runtime.checkpoint import TopKAndLastCheckpoint
from app.runtime.directories import (
    CREATED_ROOTS,
    RESERVED_VERSIONS,
    check_writable_directory,
    checkpoint_directory,
    is_launching_process,
    release_unused_versions,
    reserve_version,
    resolve_resume,
    run_name,
)
from app.runtime.locks import acquire_run_lock, release_run_locks, remove_leftover_temporaries

#: Sizes only the data knows, passed to the model at instantiation when its ``__init__``
#: takes them (a link whose target a model lacks is skipped).
DATA_LINKS = ("num_classes", "source_vocab_size", "num_features")


class WorkbenchCLI(LightningCLI):
    """LightningCLI with data-derived sizes linked into the model, a TensorBoard logger named
    after the data and head, checkpointing on ``val/loss`` and learning-rate logging."""

    def add_arguments_to_parser(self, parser) -> None:
        for name in DATA_LINKS:
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        # --checkpoint.save_top_k K (best K on val/loss; -1 keeps all) and --checkpoint.save_last.
        parser.add_lightning_class_args(TopKAndLastCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/loss",
                "checkpoint.mode": "min",
                "checkpoint.save_last": True,
                "checkpoint.save_top_k": 1,
                "checkpoint.filename": "best-{epoch}-{step}",
            }
        )
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")

    def parse_arguments(self, parser, args) -> None:
        """Parse, resolve ``--ckpt_path last`` to its file, then let the checkpoint decide the model.

        ``test --config configs/lm/synthetic.yaml --ckpt_path <MoS run>/last.ckpt`` builds the
        checkpoint's model (its head, encoder and sizes), not the config's softmax: the arguments
        are parsed again with the checkpoint's model configuration placed after the config files
        and other options given before ``--ckpt_path`` and before the model options (``--model...``)
        found there. So the checkpoint supersedes those config files' model settings, while model
        options on the command line (wherever they stand) and everything after ``--ckpt_path``
        win, in their order: ``fit --ckpt_path last --model.init_args.head.init_args.group_lasso_weight
        0.001`` resumes with the new value (Lightning's own merge puts the checkpoint over
        everything: Lightning-AI/pytorch-lightning#21455). Asking for another class than the
        checkpoint's (a head, an encoder) is one error line naming both
        (:func:`~app.checkpoint_io.checkpoint_class_conflict`)."""
        self._user_args = args  # None: the shell's sys.argv, read by jsonargparse itself
        argv = list(sys.argv[1:] if args is None else args)
        # --print_config prints at the end of a parse and exits: the parses that only find the
        # checkpoint leave it out, so what is printed is the model the command would build.
        printing, quiet = print_config_split(argv)  # printing: the --print_config words, put back at the end
        refused: ArgumentError | None = None
        try:
            if printing:
                self.config = parser.parse_args(quiet)  # what super() does, without its warning for a given list
            else:
                super().parse_arguments(parser, args)
        except ArgumentError as error:
            # A model option only the checkpoint's classes take (a MoS head's option while the
            # config names a softmax): find the checkpoint without the model options, then parse
            # everything again with its model below.
            if not literal_ckpt_path(argv):
                raise
            refused = error
            self.config = parser.parse_args(without_model_options(quiet))
        subcommand = self.config.get("subcommand")
        self._written_logger = written_logger_settings(self.config[subcommand] if subcommand else self.config)
        if not subcommand or not self.config[subcommand].get("ckpt_path"):
            if refused is not None:
                raise refused
            if printing:
                parser.parse_args(quiet + printing)  # prints the configuration and exits
            return
        resolve_resume(self.config[subcommand], subcommand)
        ckpt_path = self.config[subcommand].ckpt_path
        # Read through the project's one reader (weights only, project class paths only, one line
        # for a damaged or foreign file), which also refuses another task's checkpoint.
        configured = self.config[subcommand].get("model")
        configured = configured.get("class_path") if configured else None
        hparams = checkpoint_model_config(ckpt_path, configured)
        if not hparams:
            if refused is not None:  # no model in the checkpoint: the options were wrong after all
                raise refused
            if printing:
                parser.parse_args(quiet + printing)  # prints the configuration and exits
            return
        saved = {"class_path": hparams.get("class_path", configured), "init_args": hparams.get("dict_kwargs", hparams)}
        self.config = parser.parse_args(with_checkpoint_model(quiet, saved, str(ckpt_path)) + printing)  # printing: prints, exits
        self._written_logger = written_logger_settings(self.config[subcommand])
        resolve_resume(self.config[subcommand], subcommand)
        checkpoint_class_conflict(ckpt_path, saved, self.config[subcommand].model)

    def _parse_ckpt_path(self) -> None:
        """Done in :meth:`parse_arguments` (Lightning's own merge would put the checkpoint's
        hyper-parameters over what the user wrote). Lightning 2.6 calls this private hook right
        after ``parse_arguments``; tests/test_ckpt_path_model.py pins the resulting behaviour."""

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        given = self._get(self.config_init, "trainer", default={}).get("callbacks")
        # a copy: the Trainer extends the very list it is given with its default callbacks
        given = list(given) if isinstance(given, list) else given
        trainer = super().instantiate_trainer(**kwargs)
        if trainer.logger is None:  # --trainer.logger false: nothing to log a learning rate to
            ours = self._get(self.config_init, "lr_monitor", default=None)
            trainer.callbacks = [c for c in trainer.callbacks if c is not ours]
            listed = [type(c).__name__ for c in trainer.callbacks if isinstance(c, LearningRateMonitor)]
            if listed:  # refused now, before the run writes anything (Lightning refuses it at the first step)
                raise ValueError(
                    f"trainer.callbacks lists {listed[0]} but trainer.logger is false: a learning-rate monitor "
                    f"logs to the logger (remove it from trainer.callbacks or enable the logger)"
                )
        trainer.callbacks.append(signals.InterruptCheckpoint())
        ranks.watch(trainer)  # app.main.run waits for the ranks its launcher starts
        plain_progress_output(trainer, given)
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's run of ``subcommand``; a checkpoint whose weights do not fit the model the
        settings build (a size given explicitly that differs from the checkpoint's) is one line.
        (The Trainer loads the state dict deep inside ``fit``/``test``; this private hook of
        Lightning 2.6 is the one place around all four commands. Pinned by
        tests/test_ckpt_path_model.py.)"""
        try:
            super()._run_subcommand(subcommand)
        except RuntimeError as error:
            text = str(error)
            if not text.startswith("Error(s) in loading state_dict"):
                raise
            first = text.splitlines()[1].strip() if len(text.splitlines()) > 1 else text
            raise ValueError(
                f"checkpoint {self.config[subcommand].get('ckpt_path')} does not fit the model the settings build ({first}): "
                f"a model setting given on the command line or in a config after --ckpt_path differs from the "
                f"checkpoint's; drop it to use the checkpoint's settings"
            ) from None

    def before_fit(self) -> None:
        """Hold the checkpoint directory for this run (refused while another run holds it), then
        remove what an interrupted checkpoint write left there. Runs before anything is written."""
        directory = checkpoint_directory(self.trainer)
        if directory is None or not is_launching_process():
            return
        check_writable_directory(directory, "checkpoint.dirpath")
        argv = sys.argv[1:] if self._user_args is None else list(self._user_args)
        if acquire_run_lock(directory, argv) is not None:
            remove_leftover_temporaries(directory)
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if isinstance(self.trainer.checkpoint_callback, TopKAndLastCheckpoint) and ckpt_path:
            here = Path(str(ckpt_path)).expanduser().absolute().parent == directory.absolute()
            self.trainer.checkpoint_callback.resuming_here = here

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        logger = config.trainer.logger
        if isinstance(logger, Namespace) and logger.get("init_args", {}).get("name") == "auto":
            logger.init_args.name = run_name(config)
        # Refuse an unwritable output directory before anything is built or written, instead
        # of a traceback from deep inside the logger after the data has been prepared.
        if isinstance(logger, Namespace) and logger.get("init_args", {}).get("save_dir"):
            check_writable_directory(logger.init_args.save_dir, "trainer.logger.init_args.save_dir")
        if config.trainer.get("default_root_dir"):
            check_writable_directory(config.trainer.default_root_dir, "trainer.default_root_dir")
        if config.get("checkpoint") and config.checkpoint.get("dirpath"):
            check_writable_directory(config.checkpoint.dirpath, "checkpoint.dirpath")
        init_args = logger.get("init_args", {}) if isinstance(logger, Namespace) else {}
        if "version" in init_args and init_args.version is None and init_args.get("save_dir") and is_launching_process():
            # Claim version_N now with an atomic mkdir: loggers number versions by listing the
            # directory much later, so two runs started together could share (and clobber) one.
            init_args.version = reserve_version(Path(init_args.save_dir) / (init_args.get("name") or ""))

    def after_instantiate_classes(self) -> None:
        """Give the logger's ``name`` and ``version`` back the values written (``auto``, none)
        once the logger is built with the ones derived for this run (``SyntheticLM-mos``, the
        reserved or resumed ``N``): the ``config.yaml`` saved in the run (by Lightning's
        ``SaveConfigCallback`` when the run starts, from this configuration) then reproduces the
        run, and ``fit --config <run>/config.yaml`` starts a new ``version_N`` instead of writing
        into this one. An explicit resume (``--ckpt_path``) still continues its own version."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        logger = config.trainer.get("logger")
        if isinstance(logger, Namespace) and isinstance(logger.get("init_args"), Namespace):
            for key, value in getattr(self, "_written_logger", {}).items():
                logger.init_args[key] = value


def written_logger_settings(config: Namespace) -> dict[str, Any]:
    """The logger's ``name`` and ``version`` as the configuration gives them, before the run
    derives its own (:func:`run_name`, :func:`reserve_version`, :func:`resolve_resume`)."""
    logger = config.trainer.get("logger") if config.get("trainer") else None
    init_args = logger.get("init_args") if isinstance(logger, Namespace) else None
    if not isinstance(init_args, Namespace):
        return {}
    return {key: init_args[key] for key in ("name", "version") if key in init_args}


TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "auto", "default_hp_metric": False},
    },
    "accelerator": "auto",
    "devices": 1,
    "log_every_n_steps": 10,
    # Checkpoints are written to a temporary file and renamed: a kill mid-write keeps last.ckpt.
    "plugins": {"class_path": "app.checkpoint_io.AtomicCheckpointIO"},
}


def build_cli(argv: list[str] | None, run: bool, prog: str = "python -m app") -> WorkbenchCLI:
    return WorkbenchCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        trainer_defaults=TRAINER_DEFAULTS,
        # Parse errors are raised (ArgumentError) so run_command() can turn them into one line.
        parser_kwargs={"exit_on_error": False, "prog": prog},
        args=argv,
        run=run,
    )


def run_command(argv: list[str], from_shell: bool = False, run: bool = True, prog: str = "python -m app") -> WorkbenchCLI:
    """Build the LightningCLI for ``argv`` (``fit|validate|test|predict ...`` or only options) and,
    with ``run``, run its subcommand; while it runs, SIGINT/SIGTERM stop it with a checkpoint and the
    checkpoint directory is locked. Parse errors, Lightning's setting checks and user errors raised
    inside come out as one-line ``ValueError``; what a refused run created is removed.
    ``from_shell``: LightningCLI reads ``sys.argv`` itself (passing it again makes Lightning warn
    that both were given)."""
    check_config_files(argv)
    RESERVED_VERSIONS.clear()
    CREATED_ROOTS.clear()
    signals.install_handlers()
    try:
        cli = build_cli(None if from_shell else argv, run, prog)
        stopped = signals.interruption(argv)
        if stopped is not None:  # a signal Lightning absorbed (e.g. during the last batch)
            raise stopped
        return cli
    except ArgumentError as error:
        give_back_run_directories(refused=True)
        raise ValueError(argument_error_line(str(error))) from None
    except ValueError as error:
        give_back_run_directories(refused=True)
        root = root_user_error(error)
        if root is error:
            raise
        raise root.with_traceback(None) from error
    except MisconfigurationException as error:  # Lightning's own checks of trainer settings
        give_back_run_directories(refused=True)
        raise ValueError(lightning_error_line(error)) from None
    except BaseException as error:
        give_back_run_directories()
        stopped = signals.interruption(argv)
        if stopped is not None:
            raise stopped from error
        raise
    finally:
        release_run_locks()
        signals.restore_handlers()


def option_spans(argv: list[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of each ``--option value`` or ``--option=value`` in ``argv`` (the
    subcommand and bare words are spans of their own)."""
    spans, position = [], 0
    while position < len(argv):
        arg = argv[position]
        takes_value = arg.startswith("-") and "=" not in arg and arg not in ("-h", "--help") and position + 1 < len(argv)
        end = position + (2 if takes_value and not argv[position + 1].startswith("--") else 1)
        spans.append((position, end))
        position = end
    return spans


def is_model_option(arg: str) -> bool:
    return arg == "--model" or arg.startswith(("--model.", "--model="))


def is_ckpt_path_option(arg: str) -> bool:
    return arg == "--ckpt_path" or arg.startswith("--ckpt_path=")


def literal_ckpt_path(argv: list[str]) -> str | None:
    """The checkpoint file named on the command line (``None`` for none or ``last``/``best``)."""
    for start, end in reversed(option_spans(argv)):
        if is_ckpt_path_option(argv[start]):
            value = argv[start].partition("=")[2] if "=" in argv[start] else argv[end - 1]
            return value if value not in ("last", "best", "hpc") and Path(value).is_file() else None
    return None


def print_config_split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The words of ``argv`` that ask for ``--print_config`` (``--print_config`` or
    ``--print_config=FLAGS``; empty if none), and ``argv`` without them."""
    printing = [arg for arg in argv if arg == "--print_config" or arg.startswith("--print_config=")]
    return printing, [arg for arg in argv if arg not in printing]


def without_model_options(argv: list[str]) -> list[str]:
    return [arg for start, end in option_spans(argv) if not is_model_option(argv[start]) for arg in argv[start:end]]


def with_checkpoint_model(argv: list[str], model: dict[str, Any], ckpt_path: str) -> list[str]:
    """``argv`` with the checkpoint's ``model`` configuration after what stands before
    ``--ckpt_path`` (except the model options there, moved after it) and ``--ckpt_path`` set to the
    file it resolved to; everything from ``--ckpt_path`` on follows unchanged. Without
    ``--ckpt_path`` on the command line (it came from a config file) the model goes after all
    config files and other options."""
    spans = option_spans(argv)
    flag = next((i for i in range(len(spans) - 1, -1, -1) if is_ckpt_path_option(argv[spans[i][0]])), len(spans))
    before = [argv[a:b] for a, b in spans[:flag]]
    others = [arg for span in before if not is_model_option(span[0]) for arg in span]
    model_options = [arg for span in before if is_model_option(span[0]) for arg in span]
    after = [arg for a, b in spans[flag + 1:] for arg in argv[a:b]]
    resolved = ["--ckpt_path", ckpt_path] if flag < len(spans) else []
    return [*others, "--model", json.dumps(model), *model_options, *resolved, *after]


def give_back_run_directories(refused: bool = False) -> None:
    """After a failure: release the checkpoint directory's lock, then remove what the run
    created but never wrote to (its reserved version directory, its checkpoint directory); after
    a user error (``refused``) also the logs of a version directory that holds no checkpoint."""
    release_run_locks()
    release_unused_versions(refused)


def plain_progress_output(trainer: pl.Trainer, given: Any) -> None:
    """The text progress bar and model summary whether or not ``rich`` is installed (Lightning
    picks its rich variants by default when it is, and ``rich`` arrives with other packages, e.g.
    ``transformers``): a run's terminal output, which logs and the resume tests read line by line,
    does not depend on the environment. A progress bar or summary the user configures is kept."""
    from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary, RichProgressBar, TQDMProgressBar

    given = given if isinstance(given, list) else [given] if given is not None else []
    keep_bar = any(isinstance(c, ProgressBar) for c in given)
    keep_summary = any(isinstance(c, ModelSummary) for c in given)
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) is RichProgressBar and not keep_bar:
            trainer.callbacks[index] = TQDMProgressBar()
        elif type(callback) is RichModelSummary and not keep_summary:
            trainer.callbacks[index] = ModelSummary(max_depth=callback._max_depth)
