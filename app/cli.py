"""The project's LightningCLI: ``python -m app fit|validate|test|predict``.

``python -m app fit --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml`` trains and
evaluates. :class:`WorkbenchCLI` links data-derived sizes into the model, names runs after data and
head, checkpoints on ``val/loss`` (:class:`app.runtime.checkpoint.TopKAndLastCheckpoint`) and lets
what the user wrote win over a checkpoint's hyper-parameters; :func:`run_command` runs one command
with the run's lock, signal handling and one-line errors. The dispatch of every command (tools, demo)
and the console entry are :mod:`app.main`.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from jsonargparse import ArgumentError, DefaultHelpFormatter, Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

import datamodules  # noqa: F401  (registers data classes for short class paths)
import heads  # noqa: F401  (registers heads for short names)
import tasks  # noqa: F401
# Imported so their callbacks resolve by short name: --trainer.callbacks+=Mitosis.
import tasks.callbacks  # noqa: F401
from app.checkpoint_io.policy import SYMBOLIC_CKPT_PATHS, parse_with_checkpoint
from app.checkpoint_io.reading import HANDED_OVER
from app.errors import argument_error_line, check_config_files, lightning_error_line, root_user_error
from app.runtime import ranks, signals
from app.runtime.checkpoint import TopKAndLastCheckpoint
from app.runtime.directories import (
    CREATED_ROOTS,
    RESERVED_VERSIONS,
    STARTED,
    RunStarted,
    check_writable_directory,
    checkpoint_directory,
    disk_full_line,
    evaluation_log_directory,
    is_disk_full,
    is_launching_process,
    quiet_disk_full_in_threads,
    release_unused_versions,
    remove_empty_logs,
    reserve_version,
    run_name,
)
from app.runtime.locks import acquire_run_lock, release_run_locks, remove_leftover_temporaries
from app.runtime.notices import quiet_iterable_length_notice, quiet_lightning_notices, quiet_unrestored_callbacks_notice
from app.runtime.progress import choose_progress_bar, fit_summary
from app.runtime.settings import check_run_settings, out_of_memory_line

#: Sizes only the data knows, passed to the model at instantiation when its ``__init__``
#: takes them (a link whose target a model lacks is skipped).
DATA_LINKS = datamodules.base.DATA_LINKS


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
        # fit: start the network (every weight but the head) from a trained run (start_from_pretrained).
        parser.add_argument("--pretrained.checkpoint", type=Optional[str], default=None, help=(
            "fit: a checkpoint of a trained run of the same task and data; every weight but the head starts from it "
            "(the paper's recipe for DS-Softmax: train the softmax model, then the sparse head on its layers)"))
        parser.add_argument("--pretrained.freeze_steps", type=int, default=0, help=(
            "fit: with --pretrained.checkpoint, only the head trains for this many optimizer steps (0: everything trains; "
            "-1: the whole run, as DS-Softmax's Algorithm 1 trains only the head on the pre-trained network)"))

    def parse_arguments(self, parser, args) -> None:
        """Parse the command line; with ``--ckpt_path`` the checkpoint decides the model's
        architecture and the command line the rest (:func:`app.checkpoint_io.policy.parse_with_checkpoint`)."""
        self._user_args = args  # None: the shell's sys.argv
        argv = list(sys.argv[1:] if args is None else args)
        self.config = parse_with_checkpoint(parser, argv, self.record_written_logger)
        subcommand = self.config.get("subcommand")
        # Before LightningCLI seeds the run and builds anything from these settings.
        check_run_settings(self.config[subcommand] if subcommand else self.config)

    def record_written_logger(self, config: Namespace) -> None:
        """Keep the logger's ``name`` and ``version`` as written, before the run derives its own."""
        subcommand = config.get("subcommand")
        self._written_logger = written_logger_settings(config[subcommand] if subcommand else config)

    def _parse_ckpt_path(self) -> None:
        """Done in :meth:`parse_arguments` (Lightning's own merge would put the checkpoint's
        hyper-parameters over what the user wrote). Lightning 2.6 calls this private hook right
        after ``parse_arguments``; tests/test_ckpt_path_model.py pins the resulting behaviour."""

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        written = self._get(self.config_init, "trainer", default={})
        given, strategy = written.get("callbacks"), written.get("strategy")
        # a copy: the Trainer extends the very list it is given with its default callbacks
        given = list(given) if isinstance(given, list) else given
        quiet_iterable_length_notice(self.datamodule)
        trainer = super().instantiate_trainer(**kwargs)
        if self.subcommand in ("validate", "test", "predict"):
            # An evaluation trains nothing: no learning rate to log, and the checkpoint callback
            # restores none of the evaluated run's bookkeeping (nor warns that its directory moved).
            unused = self._get(self.config_init, "lr_monitor", default=None)
            trainer.callbacks = [c for c in trainer.callbacks if c is not unused]
            if isinstance(trainer.checkpoint_callback, TopKAndLastCheckpoint):
                trainer.checkpoint_callback.evaluating = True
            if trainer.logger is None:
                # --trainer.logger false: an evaluation has no log directory for its config.yaml, and
                # Lightning's fallback (default_root_dir, the working directory) is no output of
                # it: the config is not saved (fit keeps it beside its checkpoints/ there).
                trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, SaveConfigCallback)]
        elif trainer.logger is None:  # --trainer.logger false: nothing to log a learning rate to
            ours = self._get(self.config_init, "lr_monitor", default=None)
            trainer.callbacks = [c for c in trainer.callbacks if c is not ours]
            listed = [type(c).__name__ for c in trainer.callbacks if isinstance(c, LearningRateMonitor)]
            if listed:  # refused now, before the run writes anything (Lightning refuses it at the first step)
                raise ValueError(
                    f"trainer.callbacks lists {listed[0]} but trainer.logger is false: a learning-rate monitor "
                    f"logs to the logger (remove it from trainer.callbacks or enable the logger)"
                )
            # Without a logger Lightning saves the config into default_root_dir, overwriting a file of
            # that name there; a resume (--ckpt_path) continues the run that wrote it.
            resuming = self.config_init[self.subcommand].get("ckpt_path")
            savers = [] if resuming else [c for c in trainer.callbacks if isinstance(c, SaveConfigCallback)]
            for saver in savers:
                saved = os.path.join(trainer.default_root_dir, saver.config_filename)
                if os.path.lexists(saved):
                    raise ValueError(
                        f"{saved} exists, and fit --trainer.logger false saves the run's {saver.config_filename} in "
                        f"trainer.default_root_dir ({trainer.default_root_dir}): move that file, or set "
                        f"--trainer.default_root_dir to a directory without one")
        trainer.callbacks.append(signals.InterruptCheckpoint())
        trainer.callbacks.append(RunStarted())
        ranks.watch(trainer)  # app.main.run waits for the ranks its launcher starts
        ranks.limit_collective_wait(trainer, strategy)  # a stalled rank ends the run within minutes
        plain_progress_output(trainer, given)
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's run of ``subcommand``; a checkpoint whose weights do not fit the model the
        settings build (a size given explicitly that differs from the checkpoint's), a batch
        too large for memory and a full disk under the run's directories are one line each.
        (The Trainer loads the state dict deep inside ``fit``/``test``; this private hook of
        Lightning 2.6 is the one place around all four commands. Pinned by
        tests/test_ckpt_path_model.py.)"""
        previous_hook = threading.excepthook
        threading.excepthook = quiet_disk_full_in_threads(previous_hook)
        try:
            with quiet_unrestored_callbacks_notice(subcommand):
                super()._run_subcommand(subcommand)
        except OSError as error:
            if not is_disk_full(error):
                raise
            # run_command then removes the version directory of a run stopped before its first batch
            log_dir = self.trainer.log_dir if self.trainer.logger is not None else None
            remove_empty_logs(log_dir)
            raise ValueError(disk_full_line(error, log_dir)) from None
        except RuntimeError as error:
            line = out_of_memory_line(error, subcommand, self.config[subcommand].get("data"))
            if line is not None:
                raise ValueError(line) from None
            text = str(error)
            if not text.startswith("Error(s) in loading state_dict"):
                raise
            first = text.splitlines()[1].strip() if len(text.splitlines()) > 1 else text
            raise ValueError(
                f"checkpoint {self.config[subcommand].get('ckpt_path')} does not fit the model the settings build ({first}): "
                f"a model setting given on the command line or in a config after --ckpt_path differs from the "
                f"checkpoint's; drop it to use the checkpoint's settings"
            ) from None
        finally:
            threading.excepthook = previous_hook

    def before_fit(self) -> None:
        """Hold the checkpoint directory for this run (refused while another run holds it), then
        remove what an interrupted checkpoint write left there. Runs before anything is written."""
        start_from_pretrained(self.config_init[self.subcommand], self.model, self.datamodule, self.trainer)
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

    def after_fit(self) -> None:
        """End a ``fit`` with where its results are: best and last checkpoint, logs."""
        if self.trainer.is_global_zero:
            print("\n".join(fit_summary(self.trainer)), flush=True)

    def instantiate_classes(self) -> None:
        """Lightning's; with ``--ckpt_path`` a model the checkpoint's own hyper-parameters cannot
        build (an edited value a constructor refuses) is one line naming the file: the model is
        rebuilt from the checkpoint alone (:func:`app.checkpoint_io.restore`), and if that fails the
        checkpoint is at fault; otherwise the error is the command line's and stands."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
            if not ckpt_path or str(ckpt_path) in SYMBOLIC_CKPT_PATHS:
                raise
            from app.checkpoint_io import restore

            try:
                restore(str(ckpt_path), data=False)
            except ValueError as refused:
                raise refused from error
            raise

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        if self.subcommand in ("validate", "test", "predict") and not config.get("ckpt_path") and is_launching_process():
            print(f"warning: {self.subcommand} without --ckpt_path evaluates the model as the settings build it, with "
                  f"untrained weights; pass --ckpt_path FILE (or last) to evaluate a trained run", file=sys.stderr)
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
        if "version" not in init_args or init_args.version is not None or not init_args.get("save_dir"):
            return  # no logger, or its directory is the user's choice
        if self.subcommand in ("validate", "test", "predict"):
            # An evaluation logs into the run it evaluates (version_N/test), never a version of its own.
            save_dir, name, version = evaluation_log_directory(
                Path(init_args.save_dir), init_args.get("name") or "", config.get("ckpt_path"), self.subcommand)
            init_args.save_dir, init_args.name, init_args.version = str(save_dir), name, version
            if self.subcommand == "predict":
                # predict logs no metrics: a CSV logger (same directory layout) writes no empty events file
                config.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(
                    save_dir=init_args.save_dir, name=name, version=version))
        elif is_launching_process():
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


def start_from_pretrained(config: Namespace, model: pl.LightningModule, datamodule: Any, trainer: pl.Trainer) -> None:
    """``fit --pretrained.checkpoint PATH [--pretrained.freeze_steps N]``: the network's weights
    from ``PATH`` (read by the project's one reader, :func:`app.checkpoint_io.read_checkpoint`),
    then only the head trains for ``N`` steps (:class:`tasks.callbacks.FreezeNetwork`). A resumed
    run (``--ckpt_path``) takes its weights from the checkpoint it resumes and only freezes."""
    from app.checkpoint_io import read_checkpoint
    from tasks.callbacks import FreezeNetwork

    pretrained = config.get("pretrained") or Namespace()
    path, steps = pretrained.get("checkpoint"), pretrained.get("freeze_steps") or 0
    if not isinstance(steps, int) or steps < -1:
        raise ValueError(f"--pretrained.freeze_steps must be an integer >= -1, got {steps!r} (0: everything trains, -1: only the head)")
    if not path:
        if steps:
            rank_zero_info(f"pretrained.freeze_steps {steps} is not used: no --pretrained.checkpoint, the network trains from its initialisation")
        return
    if not config.get("ckpt_path"):
        loaded = model.load_network(read_checkpoint(str(path)), str(path), datamodule)
        rank_zero_info(f"network started from {path} ({loaded} tensors; the head keeps its initialisation)")
    if steps:
        trainer.callbacks.append(FreezeNetwork(steps))


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


class EpilogFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, keeping the line breaks of the epilog (the heads list)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in text.splitlines())


def heads_epilog() -> str:
    """The registered heads, one line each, for ``fit --help`` (and the other subcommands')."""
    from heads.registry import available_heads, head_class

    lines = ["heads (--model.init_args.head NAME, or --config configs/heads/NAME.yaml):"]
    for name in available_heads():
        doc = (head_class(name).__doc__ or "").strip().splitlines()
        lines.append(f"  {name:<17}{doc[0].rstrip('.') if doc else ''}")
    return "\n".join(lines)


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
        # The subcommands' parsers take the main parser's formatter (jsonargparse).
        parser_kwargs={"exit_on_error": False, "prog": prog, "formatter_class": EpilogFormatter,
                       **{name: {"epilog": heads_epilog()} for name in ("fit", "validate", "test", "predict")}},
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
    quiet_lightning_notices()
    RESERVED_VERSIONS.clear()
    CREATED_ROOTS.clear()
    STARTED.clear()
    signals.install_handlers(argv)
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
        HANDED_OVER.clear()  # a checkpoint read for the model but never restored (an error, --print_config)
        release_run_locks()
        signals.restore_handlers()


def give_back_run_directories(refused: bool = False) -> None:
    """After a failure: release the checkpoint directory's lock, then remove what the run
    created but never wrote to (its reserved version directory, its checkpoint directory); after
    a user error (``refused``) also the logs of a version directory that holds no checkpoint."""
    release_run_locks()
    release_unused_versions(refused)


def plain_progress_output(trainer: pl.Trainer, given: Any, terminal: bool | None = None) -> None:
    """The text progress bar and model summary whether or not ``rich`` is installed (Lightning
    picks its rich variants by default when it is, and ``rich`` arrives with other packages, e.g.
    ``transformers``): a run's terminal output, which logs and the resume tests read line by line,
    does not depend on the environment. When stdout is not a terminal (``terminal``: by default
    ``sys.stdout.isatty()``), whole lines (:class:`~app.runtime.progress.LineProgressBar`) instead
    of a redrawn bar. A progress bar or summary the user configures is kept."""
    from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary, RichProgressBar, TQDMProgressBar

    given = given if isinstance(given, list) else [given] if given is not None else []
    keep_bar = any(isinstance(c, ProgressBar) for c in given)
    keep_summary = any(isinstance(c, ModelSummary) for c in given)
    bar = choose_progress_bar(terminal) or TQDMProgressBar
    for index, callback in enumerate(trainer.callbacks):
        if type(callback) in (RichProgressBar, TQDMProgressBar) and not keep_bar:
            trainer.callbacks[index] = bar()
        elif type(callback) is RichModelSummary and not keep_summary:
            trainer.callbacks[index] = ModelSummary(max_depth=callback._max_depth)
