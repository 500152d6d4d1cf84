"""Training loaders that resume in the middle of an epoch exactly where a checkpoint left them.

Lightning saves ``state_dict()`` of every training loader that has one with each checkpoint of
the fit loop and calls ``load_state_dict()`` on the resumed run's loader before it iterates
(the stateful-loader protocol that ``datamodules/lm_stream.py: StreamLoader`` implements for
token streams). :class:`ResumableLoader` does the same for the map-style datamodules (hierarchy,
Chinese characters, captioning) and for pre-batched iterable datasets (translation's token
batches). Its state is the epoch, the number of batches it handed to the trainer in that epoch
(Lightning's fetcher does not read ahead of a loader with a length, so every counted batch was
trained on) and the random-number state at the moment of the save; a resumed run

* starts the epoch's order after those batches: a map-style loader asks its
  :class:`ResumableSampler` (the same seeded per-epoch permutation as
  ``datamodules/sharding.py: training_sampler``, cut per rank the same way) to start that many
  positions into this rank's share, so skipped samples are never loaded; an iterable dataset
  must yield the same batches for the same epoch, and the skipped ones are drawn and dropped;
* puts back the torch, Python and NumPy random states (dropout masks, random caption choice)
  right before it loads the first batch it trains on, mid-epoch or at the start of the next epoch after
  an end-of-epoch checkpoint. Nothing else between the save and that batch draws from them:
  the loaders draw their worker seeds from private generators, and evaluation runs without
  dropout.

Lightning calls ``load_state_dict`` only when it restarts an unfinished epoch; :class:`LoaderPosition`
keeps the same state among the checkpoint's callback states, so a checkpoint from the end of an
epoch gives its random state back as well.

Under DDP every rank holds the same position and all ranks run with the same random state
(seeded alike by ``seed_everything``); the checkpoint (written by rank 0) therefore fits all
of them. A mid-epoch position only means something for the same global batch: a run resumed with
another ``devices * batch_size`` from a mid-epoch checkpoint is refused (the same product on
another number of processes continues with the same samples; an end-of-epoch checkpoint resumes
on any layout).

Exactness needs the per-sample randomness to happen in the main process: with
``num_workers > 0`` each worker draws from its own generator, whose position a checkpoint does
not hold, so a dataset that draws at random per sample (captioning's ``captions_per_image``)
resumes with other draws; deterministic datasets (hierarchy, characters, translation) resume
exactly with workers too.
"""

from __future__ import annotations

import itertools
import random
import zlib
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset


class ResumableSampler(DistributedSampler):
    """A shuffling ``DistributedSampler`` (one permutation per ``(seed, epoch)``, rank ``r`` taking
    positions ``r, r + W, ...``) that can start ``start`` positions into this rank's share.

    ``len()`` stays the whole share: Lightning sizes the epoch from it and counts the batches a
    resumed epoch has already done itself.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.start = 0

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start :])


def random_state() -> dict[str, Any]:
    """The global random states a training step draws from."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "python": random.getstate(),
        # As plain numbers: checkpoints are read weights-only (no NumPy arrays).
        "numpy": [value.tolist() if isinstance(value, np.ndarray) else value for value in np.random.get_state()],
    }


def set_random_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))


class ResumableLoader(DataLoader):
    """A training ``DataLoader`` with Lightning's stateful-loader protocol (see the module doc).

    Args:
        dataset: a map-style dataset sampled by a :class:`ResumableSampler` (``sampler=``), or an
            ``IterableDataset`` yielding whole batches (``batch_size=None``) that are the same
            for the same epoch.
        epoch_fn: the current epoch, for an iterable dataset (a sampler knows its own epoch:
            Lightning calls its ``set_epoch``).
        world_size: processes the batches are sharded over, for an iterable dataset (a sampler
            knows its ``num_replicas``).
        **kwargs: ``DataLoader`` arguments.

    Shape: whatever the dataset and ``collate_fn`` yield.
    """

    def __init__(self, dataset: Dataset, *args: Any, epoch_fn: Callable[[], int] | None = None,
                 world_size: int | None = None, **kwargs: Any) -> None:
        sampler = kwargs.get("sampler")
        if not isinstance(dataset, IterableDataset) and not isinstance(sampler, ResumableSampler):
            raise TypeError(f"ResumableLoader over a map-style dataset needs sampler=ResumableSampler, got {type(sampler).__name__}")
        seed = sampler.seed if isinstance(sampler, ResumableSampler) else getattr(dataset, "seed", 0)
        # A private generator for the workers' base seed: a DataLoader draws one from the *global*
        # torch RNG each time it is iterated, which would move the dropout RNG between a
        # checkpoint and the next step differently in a resumed run.
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(dataset, *args, **kwargs)
        self.seed, self.epoch_fn = int(seed), epoch_fn
        self.world_size = sampler.num_replicas if isinstance(sampler, ResumableSampler) else int(world_size or 1)
        self._epoch, self._batches_done = 0, 0
        self._resume: dict[str, Any] | None = None

    def current_epoch(self) -> int:
        if isinstance(self.sampler, ResumableSampler):
            return int(self.sampler.epoch)
        return int(self.epoch_fn()) if self.epoch_fn is not None else self._epoch

    def global_batch(self) -> int | None:
        """Samples per step over all ranks (``None`` for pre-batched data: its batches are fixed)."""
        return None if self.batch_size is None else self.world_size * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        # A generator: its body runs at the first ``next()``, after Lightning has set the
        # sampler's epoch and loaded the checkpoint's state.
        epoch = self.current_epoch()
        resume, self._resume = self._resume, None
        skip, restore = 0, None
        if resume is not None and resume["epoch"] == epoch:  # a mid-epoch checkpoint
            skip, restore = int(resume["batches_done"]), resume["random_state"]
            self.check_layout(resume)
        elif resume is not None and resume["epoch"] + 1 == epoch:  # the end of the previous epoch
            restore = resume["random_state"]
        self._epoch, self._batches_done = epoch, skip
        self.generator.manual_seed(zlib.crc32(f"{self.seed}-{epoch}".encode()))  # the workers' seeds
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.start = skip * self.batch_size
            batches = super().__iter__()
        else:
            batches = super().__iter__()
            for _ in itertools.islice(batches, skip):  # the same batches for the same epoch: drop the trained ones
                pass
        if restore is not None:
            # Before the first batch is *loaded*: a dataset may draw per sample (caption choice).
            set_random_state(restore)
        for batch in batches:
            self._batches_done += 1
            yield batch
        if self.epoch_fn is None and not isinstance(self.sampler, ResumableSampler):
            self._epoch += 1

    def check_layout(self, resume: dict[str, Any]) -> None:
        """A mid-epoch position is exact for the same global batch: rank ``r`` of ``W`` takes
        permutation positions ``r, r + W, ...``, so ``k`` steps of ``W x B`` samples cover its first
        ``k·W·B`` positions whatever ``W`` is. Pre-batched data is sharded per rank: the same ``W``."""
        saved_world, saved_batch = resume.get("world_size"), resume.get("global_batch")
        if saved_batch is not None and saved_batch == self.global_batch():
            return
        if saved_batch is None and self.global_batch() is None and saved_world == self.world_size:
            return
        if saved_batch is not None:
            saved, here = f"{saved_world} process(es) x batch_size {saved_batch // saved_world} = {saved_batch} samples per step", (
                f"{self.world_size} x {self.batch_size} = {self.global_batch()}")
            fix = f"devices * data.init_args.batch_size = {saved_batch}"
        else:
            saved, here, fix = f"{saved_world} process(es)", f"{self.world_size}", f"{saved_world} devices"
        raise ValueError(
            f"checkpoint was written in the middle of epoch {resume['epoch']} by {saved} but this run has {here}: "
            f"its position in the epoch means other samples here (resume with {fix}, or from an end-of-epoch checkpoint)"
        )

    def state_dict(self) -> dict[str, Any]:
        """Epoch, batches handed out in it, the layout they were cut for, and the random state now."""
        return {"epoch": self._epoch, "batches_done": self._batches_done, "world_size": self.world_size,
                "global_batch": self.global_batch(), "random_state": random_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``batches_done`` batches of ``epoch`` (applied when iteration starts)."""
        self._resume = dict(state)
        if self.epoch_fn is None and not isinstance(self.sampler, ResumableSampler):
            self._epoch = int(state["epoch"])


def as_resumable(loader: DataLoader, epoch_fn: Callable[[], int] | None = None) -> ResumableLoader:
    """``loader``'s dataset, sampler and settings as a :class:`ResumableLoader` (no worker has
    started yet: a ``DataLoader`` starts its workers when it is first iterated)."""
    if loader.batch_sampler is not None and loader.batch_size is None:
        raise TypeError("as_resumable needs a loader built with batch_size and sampler, not a batch_sampler")
    settings: dict[str, Any] = {
        "batch_size": loader.batch_size, "num_workers": loader.num_workers, "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory, "drop_last": loader.drop_last, "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn, "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        settings["prefetch_factor"] = loader.prefetch_factor
    if isinstance(loader.dataset, IterableDataset):
        return ResumableLoader(loader.dataset, epoch_fn=epoch_fn, world_size=getattr(loader.dataset, "world_size", 1), **settings)
    return ResumableLoader(loader.dataset, sampler=loader.sampler, **settings)


def train_loaders(trainer: Any) -> list[Any]:
    """The trainer's training loaders as a list (one loader, or a CombinedLoader's collection)."""
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


class LoaderPosition(pl.Callback):
    """Keeps the :class:`ResumableLoader` state in the checkpoint's callback states too.

    Lightning hands a loader its saved state only when it *restarts* an epoch: a checkpoint
    written at the end of an epoch (the fit loop's epoch complete) resumes without a
    ``load_state_dict`` call, and the next epoch would start from a fresh process's random
    state. Callback states are restored on every resume, so this callback gives the state to a
    loader that did not get one, at ``on_train_start`` (before the first batch is loaded).
    Added to every task run by ``tasks/base.py: HeadTask.configure_callbacks``.
    """

    def __init__(self) -> None:
        self._trainer: Any = None
        self._saved: list[dict[str, Any]] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        fitting = self._trainer is not None and self._trainer.state.fn == "fit"
        loaders = train_loaders(self._trainer) if fitting else []
        return {"loaders": [loader.state_dict() for loader in loaders if isinstance(loader, ResumableLoader)]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = list(state_dict.get("loaders") or [])

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        saved, self._saved = self._saved, None
        loaders = [loader for loader in train_loaders(trainer) if isinstance(loader, ResumableLoader)]
        if saved and len(saved) == len(loaders):
            for loader, state in zip(loaders, saved):
                if loader._resume is None:
                    loader.load_state_dict(state)


def refuse_unresumable_mid_epoch(trainer: Any) -> None:
    """Refuse to resume from a mid-epoch checkpoint when a training loader cannot continue there.

    Lightning would only warn and start the epoch's order from its first batch again: the run
    would train some samples twice and others not at all in that epoch and drift from the run it
    continues (7% in val/loss on the hierarchy DS-Softmax). Called at the start of training,
    before any step, so nothing is trained or written.
    """
    if trainer.ckpt_path is None or trainer.num_training_batches in (0, float("inf")):
        return
    steps_per_epoch = -(-int(trainer.num_training_batches) // trainer.accumulate_grad_batches)
    if trainer.global_step % steps_per_epoch == 0:
        return
    loaders = train_loaders(trainer)
    drawing = sorted({type(loader.dataset).__name__ for loader in loaders if getattr(loader, "num_workers", 0) > 0
                      and getattr(getattr(loader, "dataset", None), "draws_per_sample", False)})
    if drawing:
        raise ValueError(
            f"checkpoint {trainer.ckpt_path} was written in the middle of epoch {trainer.current_epoch} (global step "
            f"{trainer.global_step}) but the training data ({', '.join(drawing)}) draws at random per sample inside "
            f"data-loader workers, whose random state a checkpoint does not hold: resume from an end-of-epoch "
            f"checkpoint (--checkpoint.every_n_epochs 1) or with --data.init_args.num_workers 0"
        )
    stuck = [type(loader).__name__ for loader in loaders if not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"))]
    unplaced = [loader for loader in loaders if isinstance(loader, ResumableLoader) and loader._resume is None]
    if unplaced and not stuck:
        raise ValueError(
            f"checkpoint {trainer.ckpt_path} was written in the middle of epoch {trainer.current_epoch} (global step "
            f"{trainer.global_step}) without the training loader's position (the loader that wrote it could not save "
            f"one); resume from an end-of-epoch checkpoint (--checkpoint.every_n_epochs 1)"
        )
    if stuck:
        raise ValueError(
            f"checkpoint {trainer.ckpt_path} was written in the middle of epoch {trainer.current_epoch} (global step "
            f"{trainer.global_step}) but the training loader ({', '.join(stuck)}) cannot resume mid-epoch (it has no "
            f"state_dict/load_state_dict); resume from an end-of-epoch checkpoint (--checkpoint.every_n_epochs 1) or "
            f"give the datamodule a resumable train loader (datamodules/resumable.py)"
        )
