"""The project's LightningCLI: ``python -m app fit|validate|test|predict``.

``python -m app fit --config configs/lm/synthetic.yaml --config configs/heads/mos.yaml`` trains and
evaluates. :class:`WorkbenchCLI` links data-derived sizes into the model, names runs after data and
head, checkpoints on ``val/loss`` (:class:`app.runtime.checkpoint.TopKAndLastCheckpoint`) and lets
what the user wrote win over a checkpoint's hyper-parameters; :func:`run_command` runs one command
with the run's lock, signal handling and one-line errors. The dispatch of every command (tools, demo)
and the console entry are :mod:`app.main`.
"""

from __future__ import annotations

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
import heads.ds_callbacks  # noqa: F401
import heads.lightrnn_callbacks  # noqa: F401
import tasks.hanzi_callbacks  # noqa: F401
from app.checkpoint_io import checkpoint_model_config
from app.errors import argument_error_line, check_config_files, lightning_error_line, root_user_error
from app.runtime import signals
from app.runtime.checkpoint import TopKAndLastCheckpoint
from app.runtime.directories import (
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
        self._user_args = args  # None: the shell's sys.argv, read by jsonargparse itself
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if subcommand:
            # Before Lightning reads the checkpoint's hyper-parameters (_parse_ckpt_path), so
            # `--ckpt_path last` and the file it stands for behave the same.
            resolve_resume(self.config[subcommand], subcommand)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        trainer.callbacks.append(signals.InterruptCheckpoint())
        return trainer

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

    def _parse_ckpt_path(self) -> None:
        """Checkpoint hyper-parameters fill in the model; what the user wrote wins.

        Lightning merges the checkpoint's ``hyper_parameters`` *over* the parsed configuration,
        so ``fit --ckpt_path last.ckpt --model.init_args.head.init_args.group_lasso_weight
        0.001`` silently resumes with the old value (Lightning-AI/pytorch-lightning#21455, open).
        Here the model arguments given in ``--config`` files and on the command line are parsed
        again without defaults and applied on top, so the checkpoint only supplies what the user
        left out (e.g. ``test --ckpt_path`` with no model config builds the trained model).
        """
        subcommand = self.config.get("subcommand")
        if not subcommand or not self.config[subcommand].get("ckpt_path"):
            return
        # Lightning's own merge (super()._parse_ckpt_path) reads the file with its own torch.load;
        # this reads it through the project's one reader (weights only, project class paths only,
        # one line for a damaged or foreign file) and refuses another task's checkpoint.
        model = self.config[subcommand].get("model")
        hparams = checkpoint_model_config(self.config[subcommand].ckpt_path, model.get("class_path") if model else None)
        if hparams:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        written = self.parser.parse_args(self._user_args, defaults=False)[subcommand].get("model")
        if written:
            self.config = self.parser.parse_object({subcommand: {"model": written.as_dict()}}, self.config)

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


def build_cli(argv: list[str] | None, run: bool) -> WorkbenchCLI:
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
        parser_kwargs={"exit_on_error": False},
        args=argv,
        run=run,
    )


def run_command(argv: list[str], from_shell: bool = False, run: bool = True) -> WorkbenchCLI:
    """Build the LightningCLI for ``argv`` (``fit|validate|test|predict ...`` or only options) and,
    with ``run``, run its subcommand; while it runs, SIGINT/SIGTERM stop it with a checkpoint and the
    checkpoint directory is locked. Parse errors, Lightning's setting checks and user errors raised
    inside come out as one-line ``ValueError``; what a refused run created is removed.
    ``from_shell``: LightningCLI reads ``sys.argv`` itself (passing it again makes Lightning warn
    that both were given)."""
    check_config_files(argv)
    RESERVED_VERSIONS.clear()
    signals.install_handlers()
    try:
        cli = build_cli(None if from_shell else argv, run)
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


def give_back_run_directories(refused: bool = False) -> None:
    """After a failure: release the checkpoint directory's lock, then remove what the run
    created but never wrote to (its reserved version directory, its checkpoint directory); after
    a user error (``refused``) also the logs of a version directory that holds no checkpoint."""
    release_run_locks()
    release_unused_versions(refused)

