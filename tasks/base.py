"""What every task shares: building its head, summing head regularisers, logging head
statistics, optimizers from config, and head structure saved with checkpoints."""

from __future__ import annotations

import io
import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from datamodules.base import HeadDataModule, StateDecoder, as_head_datamodule
from datamodules.fingerprint import checkpoint_origin, data_fingerprint, origin_mismatch
from datamodules.resumable import TrainingRandomState, refuse_unresumable_mid_epoch
from heads.base import OutputHead
from heads.registry import HeadSpec
from heads.registry import build_head as registry_build_head
from heads.registry import short_name
from tasks.checkpoint_fit import check_fits_model, check_fits_trainer, check_param_groups, check_scheduler_states
from tasks.finite_guard import NonFiniteGuard, step_overflow
from tasks.tensorboard import experiment_summary, hparams_columns, metric_columns
from heads.base import IGNORE_INDEX



#: Keys a ``compile`` mapping may hold: the keyword arguments of :func:`torch.compile`.
COMPILE_OPTIONS = ("fullgraph", "dynamic", "backend", "mode", "options", "disable")


def compile_options(value: Any, owner: str) -> dict[str, Any] | None:
    """The ``torch.compile`` keyword arguments a task's ``compile`` setting asks for: None for
    ``false``, ``{}`` for ``true``, the mapping itself when its keys are torch.compile's."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        unknown = sorted(str(key) for key in value if key not in COMPILE_OPTIONS)
        if not unknown:
            try:  # torch.compile checks backend, mode and options when called, before anything runs
                torch.compile(_identity, **value)
            except (RuntimeError, TypeError, ValueError) as error:
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise ValueError(
                    f"{owner} got compile {value!r}, which torch.compile refuses: {reason[:300]} "
                    f"(fix model.init_args.compile)"
                ) from None
            return dict(value)
        problem = f"unknown key(s) {', '.join(unknown)}"
    else:
        problem = repr(value)
    raise ValueError(
        f"{owner} needs compile to be true, false or a mapping of torch.compile options "
        f"({', '.join(COMPILE_OPTIONS)}), got {problem} (fix model.init_args.compile)"
    )


def _identity(x: Any) -> Any:
    return x


def check_optimizer_settings(optimizer: OptimizerCallable) -> None:
    """Build ``optimizer`` on one probe parameter so that the settings it refuses (a negative
    learning rate, a beta outside [0, 1)) are one line naming the option now, not torch's bare
    ``Invalid learning rate: -1.0`` once fit has set everything up."""
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))])
    except RuntimeError:
        return  # a setting that depends on the device (fused kernels): judged by the real construction
    except ValueError as error:
        settings = getattr(optimizer, "keywords", {})
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        # The option torch complains about: named in its message (weight_decay, "beta" for
        # betas, "epsilon" for eps), else the one whose value it quotes (lr: "Invalid learning rate: -1.0").
        named = [name for name in settings if name.rstrip("s") in reason]
        quoted = [name for name, value in settings.items() if not isinstance(value, bool) and str(value) in reason]
        chosen = named if len(named) == 1 else quoted
        # The CLI's factory is functools.partial(instantiator, OptimizerClass, **settings).
        classes = [arg for arg in getattr(optimizer, "args", ()) if isinstance(arg, type)]
        owner = classes[0] if classes else getattr(optimizer, "func", optimizer)
        name = getattr(owner, "__name__", type(optimizer).__name__)
        if len(chosen) == 1:
            key = f"model.init_args.optimizer.init_args.{chosen[0]}"
            shown = f"invalid value {settings[chosen[0]]!r} for {key}"
        else:
            key = "model.init_args.optimizer.init_args"
            shown = f"invalid settings for {key}"
        raise ValueError(f"{shown}: {name} refuses it ({reason}) (fix --{key} or its entry in the config)") from None


def built_modules(**arguments: Any) -> list[str]:
    """The names of ``arguments`` (a task's ``__init__`` arguments, e.g. ``encoder=encoder``) that
    hold a built ``nn.Module`` that ``save_hyperparameters`` would record: what the task passes it
    in ``ignore``, as Lightning recommends (the module's weights are in the state dict, and a module
    is no hyper-parameter a checkpoint could rebuild it from; Lightning warns otherwise).

    Not when LightningCLI builds the task: Lightning then saves the configuration as written, where
    the same argument is the encoder's ``class_path`` + ``init_args`` (how a checkpoint rebuilds
    its architecture), and ``ignore`` would drop it. LightningCLI hands that configuration over in
    Lightning's private context variable ``_given_hyperparameters`` (Lightning 2.6); without
    it, nothing is ignored (the warning shows, the checkpoints keep their encoders).
    Pinned by tests/test_captioning.py::test_restoring_a_task_with_a_built_encoder_prints_no_warning."""
    try:
        from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
    except ImportError:  # another Lightning: leave the hyper-parameters as Lightning records them
        return []
    if _given_hyperparameters.get() is not None:
        return []
    return [name for name, value in arguments.items() if isinstance(value, torch.nn.Module)]


def build_head(spec: HeadSpec, in_features: int, num_classes: int) -> OutputHead:
    """Instantiate a task's head (see :func:`heads.registry.build_head`)."""
    return registry_build_head(spec, in_features, num_classes, ignore_index=IGNORE_INDEX)


def global_mean_count(count: Tensor) -> Tensor:
    """The number a rank divides its summed training loss by so that a DDP step is the exact
    per-token (per-sample) mean over the *global* batch: the mean of ``count`` over ranks.

    DDP averages the ranks' gradients. Token batches (and the last batch of an epoch) give the
    ranks different numbers of targets, so dividing by the rank's own count would weight one
    rank's targets more than another's; dividing every rank's sum by ``sum_r count_r / world``
    makes the averaged gradient that of (all ranks' summed losses) / (all ranks' counts), what one
    process computes on the union of the ranks' batches. One scalar all-reduce per step; 1 process: ``count``.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return count.clamp(min=1)
    total = count.detach().clone()
    torch.distributed.all_reduce(total)
    return total.clamp(min=1) / torch.distributed.get_world_size()


class HeadTask(pl.LightningModule):
    """Base LightningModule for a task built around one :class:`OutputHead`.

    Subclasses build ``self.head`` (via :func:`build_head`) and call
    :meth:`add_head_regularization` on their task loss.

    Head structure: a head that changes shape during training (DS-Softmax mitosis and
    pruning) overrides ``structure() -> dict`` and ``load_structure(dict)`` of the head contract; the structure is
    saved in the checkpoint and restored *before* the state dict is loaded, so a model
    built from the original config can load it (``fit --ckpt_path``, ``test --ckpt_path``,
    ``load_from_checkpoint``).
    """

    head: OutputHead
    #: The submodules ``compile`` applies to (``torch.compile`` of each one's ``forward``, in place:
    #: state-dict keys and checkpoints stay the same). Tasks add the networks they call as modules.
    compiled_modules: tuple[str, ...] = ("head",)
    #: Constructor arguments that choose what runs or where (a compile backend, output files,
    #: decoding settings): set from the command line only, never saved with or read from a
    #: checkpoint (:mod:`app.checkpoint_io.policy`).
    runtime_options: tuple[str, ...] = ("compile",)
    #: Batch key of the classes the head is to predict (``IGNORE_INDEX`` where nothing is), aligned
    #: with :meth:`head_input`; the tools that read a model's contexts (``analyze``, ``convert ds``,
    #: ``bench ds``) pair the two through it and :meth:`hidden_states`.
    target_key: str = "target"

    def __init__(
        self,
        optimizer: OptimizerCallable = torch.optim.Adam,
        lr_scheduler: LRSchedulerCallable | None = None,
        monitor: str = "val/loss",
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__()
        self.compile_options = compile_options(compile, type(self).__name__)
        # The CLI hands the optimizer over as functools.partial(cls, **init_args). A non-finite
        # setting (YAML `.nan`, `.inf`) is refused here, naming its key: torch would say only
        # "Invalid learning rate: nan" once fit starts, or accept an infinite one.
        for name, value in getattr(optimizer, "keywords", {}).items():
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                key = f"model.init_args.optimizer.init_args.{name}"
                raise ValueError(f"invalid value {value!r} for {key}: expected finite float (fix --{key} or its entry in the config)")
        check_optimizer_settings(optimizer)
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.monitor = monitor
        self._hparams_logged: set[str] = set()  # stages whose HPARAMS row is written (log_hparams)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                             strict: bool | None = None, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint`` on the checkpoint as the project reads it
        (:func:`app.checkpoint_io.read_checkpoint`: ``weights_only=True``, class paths only from the
        project, runtime options dropped), not on the raw file, whose
        nested ``class_path`` entries Lightning would otherwise import as written."""
        if isinstance(checkpoint_path, (str, os.PathLike)):
            # The application's reader, imported on use (tasks do not import app at load time).
            from app.checkpoint_io.reading import read_checkpoint

            buffer = io.BytesIO()
            torch.save(read_checkpoint(os.fspath(checkpoint_path)), buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, **kwargs)

    # ------------------------------------------------------------------ loss
    def add_head_regularization(self, loss: Tensor, stage: str = "train") -> Tensor:
        """Add the head's weighted auxiliary losses to ``loss`` and log each one."""
        for name, value in self.head.regularization().items():
            loss = loss + value
            self.log(f"{stage}/reg/{name}", value.detach(), on_step=True, on_epoch=False)
        return loss

    def log_reduced(self, name: str, value: Any, **kwargs: Any) -> None:
        """Log a value every rank already holds in full (a metric computed over all ranks' data,
        e.g. a torchmetrics ``compute()``). Under DDP it is reduced with ``max``, which returns
        identical values unchanged: the same figure with one or many processes, and no advice
        from Lightning to synchronise what is already synchronised. Every rank must call it."""
        self.log(name, value, sync_dist=True, reduce_fx="max", **kwargs)

    #: The metrics the task logs under ``val/`` and ``test/`` that TensorBoard's HPARAMS tab lists
    #: (``("ppl", "acc@1")`` becomes ``val/ppl``, ``val/acc@1``, ``test/ppl``, ``test/acc@1``).
    hparams_metrics: tuple[str, ...] = ()
    #: The submodules before the head, named in the HPARAMS ``encoder`` column.
    encoder_modules: tuple[str, ...] = ("encoder",)

    def log_hparams(self, stage: str, values: dict[str, Tensor | float]) -> None:
        """Write the run's HPARAMS row (:func:`tasks.tensorboard.hparams_columns`) with the
        :attr:`hparams_metrics` among ``values`` (just logged as ``{stage}/{name}``), once per
        stage of a run: the first validation that is not the sanity check, the test.

        Lightning logs ``self.hparams`` when fit starts (the full configuration, kept in
        ``hparams.yaml``); with ``default_hp_metric`` off that writes no HPARAMS record, so this is
        the one: it writes the columns and the metric names, and TensorBoard shows the values the
        task logged under those tags."""
        if self.trainer.sanity_checking or stage in self._hparams_logged:
            return
        metrics = {f"{stage}/{name}": float(values[name]) for name in self.hparams_metrics if name in values}
        if not metrics:
            return
        self._hparams_logged.add(stage)
        datamodule = self.datamodule
        head_type = type(self.head)
        row = hparams_columns(
            self.head,
            head_name=short_name(head_type) or head_type.__name__,
            head_spec=self.hparams.get("head"),
            networks=[self.get_submodule(name) for name in self.encoder_modules],
            data_name=type(datamodule).__name__ if datamodule is not None else "none",
        )
        # The metrics' values are the scalars the task has just logged under the same tags, which
        # TensorBoard's HPARAMS reads: only the hparams records are written here (Lightning's
        # log_hyperparams would log the metrics a second time at the same step).
        step = self.trainer.global_step
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger) and self.trainer.is_global_zero:
                # The experiment record with every task's metric names goes first: TensorBoard keeps
                # a tag's first record and takes the whole table's columns from one run's. The
                # run's own records (its columns and its status) follow. The writer is the
                # SummaryWriter's file writer, the one add_hparams itself writes through (no public
                # call writes a summary proto); tests/events.py check_hparams reads them back.
                from torch.utils.tensorboard.summary import hparams as hparams_summary

                _, session_start, session_end = hparams_summary(row, metrics)
                writer = logger.experiment._get_file_writer()
                for record in (experiment_summary(row, metric_columns(all_hparams_metrics())), session_start, session_end):
                    writer.add_summary(record, step)

    def head_input(self, batch: dict[str, Any]) -> Tensor:
        """What the head reads for ``batch``: ``(..., d)``, aligned with ``batch[target_key]``."""
        raise NotImplementedError

    @torch.no_grad()
    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        """:meth:`head_input` in eval mode, the batch moved to the model's device (what the analysis
        tools read)."""
        was_training = self.training
        self.eval()
        try:
            return self.head_input({k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()})
        finally:
            self.train(was_training)

    def configure_model(self) -> None:
        """``compile``: wrap the forward of each of :attr:`compiled_modules` in ``torch.compile``
        (once; before any strategy wraps the model, so DDP sees the compiled modules)."""
        if self.compile_options is None or getattr(self, "_compiled", False):
            return
        for name in self.compiled_modules:
            self.get_submodule(name).compile(**self.compile_options)
        self._compiled = True

    def configure_callbacks(self) -> list[pl.Callback]:
        """Every task run stops on a non-finite loss or non-finite weights before either reaches a
        checkpoint (:class:`tasks.finite_guard.NonFiniteGuard`, where the checks are described), and
        resumes the random state of its training loader's position from any checkpoint
        (:class:`datamodules.resumable.TrainingRandomState`).

        Lightning calls this at every ``fit``/``validate``/``test``/``predict`` and puts what it
        returns in ``trainer.callbacks``: a Trainer that already ran this task (the demo's ``test``
        after its ``fit``) holds both, so only those it lacks are returned (returning them again
        would replace them, with Lightning's notice that they "override existing callbacks passed
        to Trainer")."""
        held = self._trainer.callbacks if self._trainer is not None else []
        return [callback() for callback in (NonFiniteGuard, TrainingRandomState)
                if not any(isinstance(c, callback) for c in held)]

    def on_fit_start(self) -> None:
        # The schedulers are built (strategy setup) and not yet restored: check the saved states now.
        self._check_saved_schedulers()

    def _check_saved_schedulers(self) -> None:
        """The LR scheduler states of the checkpoint ``fit --ckpt_path`` resumes from (kept by
        :meth:`on_load_checkpoint`) against the schedulers the run built, before Lightning restores
        them (:func:`tasks.checkpoint_fit.check_scheduler_states`)."""
        pending, self._saved_schedulers = getattr(self, "_saved_schedulers", None), None
        if pending is not None and self.trainer.ckpt_path:  # (not one kept by an earlier fit that stopped)
            check_scheduler_states(self.trainer, *pending)

    def on_train_start(self) -> None:
        # A mid-epoch checkpoint resumes exactly only with a stateful train loader; refuse otherwise.
        refuse_unresumable_mid_epoch(self.trainer)
        if self.trainer.ckpt_path:  # the optimizer's groups as restored, before its first step reads them
            check_param_groups(self.trainer, str(self.trainer.ckpt_path))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    def log_head_stats(self, stage: str = "train") -> None:
        """Log the head's scalar statistics (tensors with more than one element are skipped
        here; callbacks write them as histograms)."""
        for name, value in self.head.stats().items():
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    continue
                value = value.detach().float()
            if isinstance(value, (int, float)) and not math.isfinite(float(value)):
                continue
            # Averaged over DDP ranks (each rank's statistics describe its own shard of the batch).
            self.log(f"{stage}/head/{name}", value, on_step=True, on_epoch=False, sync_dist=True)

    # ------------------------------------------------------------------ optim
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        try:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        except RuntimeError as error:
            # torch refuses a step size beyond the float range (e.g. Adam with lr 1e39) before
            # touching a weight: the same divergence as a non-finite loss, said the same way.
            if "without overflow" not in str(error):
                raise
            raise step_overflow(self.trainer, error) from None
        self.head.after_optimizer_step(optimizer)  # with the step's learning rate (see heads.base)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        config: dict[str, Any] = {"scheduler": scheduler, "interval": "epoch"}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = self.monitor
        elif getattr(scheduler, "step_per_batch", False):
            config["interval"] = "step"
        return {"optimizer": optimizer, "lr_scheduler": config}

    #: Start the head's class biases at the training unigram (see ``OutputHead.init_unigram_bias``)
    #: when fitting from scratch; tasks expose it as the ``unigram_bias_init`` argument.
    unigram_bias_init: bool = False

    # ------------------------------------------------------------------ data
    @property
    def datamodule(self) -> HeadDataModule | None:
        """The trainer's datamodule (the data contract, :class:`datamodules.base.HeadDataModule`),
        ``None`` for a model used without a trainer or fed plain loaders; another kind of
        datamodule is refused in one line."""
        return as_head_datamodule(self._trainer.datamodule if self._trainer is not None else None)

    def class_names(self) -> list[str] | None:
        """The label of every class id: the datamodule's, else the loaded checkpoint's
        (``datamodule_state``), else ``None``."""
        datamodule = self.datamodule
        if datamodule is not None:
            return datamodule.class_names
        return None if self._checkpoint_decoder is None else self._checkpoint_decoder.class_names

    def decode_text(self, ids: list[int]) -> str:
        """Text of generated class ids with the datamodule's decoder, else with the loaded
        checkpoint's vocabulary and tokenizer (a model restored without its data)."""
        datamodule = self.datamodule
        if datamodule is not None:
            return datamodule.decode(ids)
        if self._checkpoint_decoder is None:
            raise ValueError(
                f"no vocabulary to detokenise with: attach the {type(self).__name__}'s datamodule or load a checkpoint that stores one"
            )
        return self._checkpoint_decoder.decode(ids)

    #: The decoder of the loaded checkpoint's ``datamodule_state`` (set by ``on_load_checkpoint``).
    _checkpoint_decoder: StateDecoder | None = None

    def setup(self, stage: str) -> None:
        datamodule = self.datamodule
        if stage == "fit" and self.unigram_bias_init and datamodule is not None:
            self.init_bias_from_data(datamodule)
        if self.head.requires_frequency_order and datamodule is not None:
            if not datamodule.frequency_ordered:
                raise ValueError(
                    f"{type(self.head).__name__} needs class ids sorted by decreasing frequency but "
                    f"{type(datamodule).__name__} does not declare frequency_ordered = True (use a "
                    f"frequency-ordered vocabulary or another head)"
                )

    def init_bias_from_data(self, datamodule: HeadDataModule) -> bool:
        """Set the head's biases to the log unigram of ``datamodule.class_counts()`` before the
        first step of a fresh run (never when resuming: the checkpoint's weights load after this;
        nor for a source that counts no classes)."""
        if self.trainer.ckpt_path is not None or self.trainer.global_step > 0:
            return False
        counts = datamodule.class_counts()
        if counts is None:
            return False
        counts = counts.double()
        log_unigram = torch.log((counts + 1) / (counts + 1).sum())  # add-one: unseen classes stay finite
        return self.head.init_unigram_bias(log_unigram.to(self.device))

    # ------------------------------------------------------------------ checkpoints
    #: True for a task that replaces its datamodule's vocabularies with the checkpoint's when it
    #: loads one (translation re-encodes its inputs with the saved tokenizers): then the data's own
    #: vocabulary fingerprint is not compared.
    adopts_checkpoint_vocabulary: bool = False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        structure = self.head.structure()
        if structure:  # a head whose constructor fixes its shape saves no key
            checkpoint["head_structure"] = structure
        datamodule = self.datamodule
        if datamodule is not None:
            cls = type(datamodule)
            checkpoint["datamodule_class_path"] = f"{cls.__module__}.{cls.__qualname__}"
            checkpoint["datamodule_state"] = datamodule.state_for_checkpoint()
        # task, head and data fingerprint, compared when the checkpoint is loaded (datamodules/fingerprint.py)
        checkpoint["headbench"] = checkpoint_origin(self, datamodule)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.check_checkpoint_origin(checkpoint)
        state = checkpoint.get("datamodule_state")
        if state is not None:
            self._checkpoint_decoder = StateDecoder(state, self.checkpoint_name())
        structure = checkpoint.get("head_structure")
        if structure is not None:
            try:
                self.head.load_structure(structure)
            except (ValueError, TypeError, KeyError, IndexError) as error:  # an edited structure: the head's words, the file's name
                raise ValueError(f"{self.checkpoint_name()}: head_structure does not fit the head ({' '.join(str(error).split())})") from None
        self._renumber_optimizer_for_added_parameters(checkpoint)
        # The weights' dtypes and shapes and the optimizer state against this model, before either is loaded.
        where = self.checkpoint_name().removeprefix("checkpoint").strip() or "(in memory)"
        precision = getattr(self._trainer, "precision", None) if self._trainer is not None else None
        check_fits_model(checkpoint, self, where, precision)
        if self._trainer is not None:
            check_fits_trainer(checkpoint, self._trainer, where)
            if self._trainer.state.fn == "fit" and "lr_schedulers" in checkpoint:
                # checked when the run's schedulers exist: at on_fit_start, or now for a strategy that
                # restores the checkpoint after its setup (on_fit_start has run, the schedulers are built)
                self._saved_schedulers = (checkpoint["lr_schedulers"], where)
                if getattr(self._trainer.strategy, "restore_checkpoint_after_setup", False):
                    self._check_saved_schedulers()

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, where a head's refusal of its entries (a ``ValueError``:
        a DS-Softmax head's index buffers, :func:`heads.ds.head.packed_structure_problem`) names the
        checkpoint being restored (the Trainer's ``--ckpt_path``, a tool's file)."""
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        except ValueError as error:
            if self.checkpoint_name() == "checkpoint":
                raise
            raise ValueError(f"{self.checkpoint_name()}: {' '.join(str(error).split())}") from None

    def _renumber_optimizer_for_added_parameters(self, checkpoint: dict[str, Any]) -> None:
        """Parameters a checkpoint does not hold (added to a head since it was written, filled by the
        head's state-dict hook, e.g. Mixtape's gate biases) start with fresh optimizer state: the
        saved optimizer's parameter numbers are moved past them so a resumed run continues the rest."""
        saved = checkpoint.get("state_dict") or {}
        names = [name for name, _ in self.named_parameters()]
        kept = [i for i, name in enumerate(names) if name in saved]
        if len(kept) == len(names) or not kept:
            return
        for optimizer_state in checkpoint.get("optimizer_states") or []:
            groups = optimizer_state.get("param_groups") or []
            if len(groups) != 1 or len(groups[0].get("params", [])) != len(kept):
                continue  # not the one-group layout of configure_optimizers: left to the optimizer to refuse
            new_index = dict(zip(groups[0]["params"], kept))
            groups[0]["params"] = list(range(len(names)))
            optimizer_state["state"] = {new_index[k]: v for k, v in optimizer_state.get("state", {}).items()}

    #: The file a tool restores this model from (:func:`app.checkpoint_io.restoring.build_model`).
    restored_from: str | None = None

    def checkpoint_name(self) -> str:
        """``checkpoint <path>`` while a Trainer or a tool restores one, else ``checkpoint``."""
        path = self._trainer.ckpt_path if self._trainer is not None else None
        path = path or self.restored_from
        return f"checkpoint {path}" if path else "checkpoint"

    def check_checkpoint_origin(self, checkpoint: dict[str, Any]) -> None:
        """Refuse another task's or another head's checkpoint, one trained with another number of
        classes, and one trained on another vocabulary / label set of the same size (its
        ``data_fingerprint`` differs from the data's). A checkpoint without the ``headbench``
        record every run writes was not written by this version of the project: refused."""
        self.check_checkpoint_sizes(checkpoint)
        saved = checkpoint.get("headbench")
        if not isinstance(saved, dict):
            raise ValueError(
                f"{self.checkpoint_name()} stores no headbench record (task, head and data fingerprint, written with every "
                f"checkpoint of python -m app fit): it was edited or written by another version of the project"
            )
        current = checkpoint_origin(self, None)
        problem = origin_mismatch(saved, current)
        if problem:
            raise ValueError(f"{self.checkpoint_name()} {problem}")
        datamodule = self.datamodule
        if datamodule is not None and not self.adopts_checkpoint_vocabulary:
            current["data_fingerprint"] = data_fingerprint(datamodule)
            problem = origin_mismatch(saved, current)
            if problem:
                raise ValueError(f"{self.checkpoint_name()} {problem}")

    def load_network(self, checkpoint: dict[str, Any], where: str, datamodule: HeadDataModule | None = None) -> int:
        """Start this model's network from another run's checkpoint: every weight but the head's
        (``head.*``) is copied from its ``state_dict``; the head keeps its own initialisation.
        DS-Softmax §3's recipe: train the softmax model, then train the sparse head on its layers.

        Refused in one line naming ``where``: a checkpoint of another task, one trained on another
        vocabulary or label set (``datamodule``'s fingerprint), and a network that differs (a
        weight missing, of another shape or dtype). Returns the number of tensors copied."""
        saved = checkpoint.get("headbench")
        current = checkpoint_origin(self, None)
        if isinstance(saved, dict):
            if datamodule is not None and not self.adopts_checkpoint_vocabulary:
                current["data_fingerprint"] = data_fingerprint(datamodule)
            problem = origin_mismatch({**saved, "head": None}, current)
            if problem:
                raise ValueError(f"--pretrained.checkpoint {where} {problem.split(':')[0]}: start from a run of the same task and data")
        state = checkpoint["state_dict"]
        network = {name: value for name, value in self.state_dict().items() if not name.startswith("head.")}
        for name, target in network.items():
            value = state.get(name)
            if value is None or value.shape != target.shape or value.dtype != target.dtype:
                found = "has no such weight" if value is None else f"has {str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
                raise ValueError(
                    f"--pretrained.checkpoint {where}: the network's {name} is {str(target.dtype).removeprefix('torch.')} "
                    f"{tuple(target.shape)} but the checkpoint {found}: start from a run with the same encoder settings")
        with torch.no_grad():
            for name, target in network.items():
                target.copy_(state[name])
        return len(network)

    def check_checkpoint_sizes(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint whose class count differs from this model's, naming both."""
        saved = checkpoint.get("hyper_parameters", {}).get("num_classes")
        if saved is not None and int(saved) != int(self.head.num_classes):
            raise ValueError(
                f"{self.checkpoint_name()} was trained with a vocabulary of {saved} classes but the data gives "
                f"{self.head.num_classes}: use the data (and vocabulary settings) the checkpoint was "
                f"trained on"
            )


def all_hparams_metrics() -> list[tuple[str, ...]]:
    """The :attr:`HeadTask.hparams_metrics` of every task class imported (``tasks`` imports them
    all), by class path: what the HPARAMS experiment record lists (:func:`tasks.tensorboard.metric_columns`)."""
    classes, pending = set(), [HeadTask]
    while pending:
        for subclass in pending.pop().__subclasses__():
            if subclass not in classes:
                classes.add(subclass)
                pending.append(subclass)
    ordered = sorted(classes, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
    return [cls.hparams_metrics for cls in ordered if cls.hparams_metrics]
