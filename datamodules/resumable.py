"""Training loaders that resume in the middle of an epoch exactly where a checkpoint left them.

The training loaders of the map-style datamodules (hierarchy, Chinese characters, captioning) and
of translation's pre-batched token stream are torchdata ``StatefulDataLoader``s
(:func:`training_loader`). Lightning saves ``state_dict()`` of every training loader that has one
with each checkpoint of the fit loop and calls ``load_state_dict()`` on the resumed run's loader
before it iterates; the loader then continues after the batches it had handed to the trainer
(Lightning's fetcher does not read ahead of a loader with a length, so every counted batch was
trained on):

* a map-style dataset is sampled by a :class:`ResumableSampler` (the same seeded per-epoch
  permutation as ``datamodules/sharding.py: training_sampler``, cut per rank the same way), whose
  state is the number of permutation positions all ranks have consumed; the resumed sampler starts
  there, so skipped samples are never loaded;
* an iterable dataset yields the same batches for the same epoch and keeps a state of its own
  (translation's ``TokenBatchStream``: the epoch and the batches it yielded), so it starts after
  the trained ones. Without one, torchdata draws and drops them, and counts them again in the
  next state it saves.

What the loader does not hold, :class:`TrainingRandomState` keeps among the checkpoint's callback
states (restored on every resume, mid-epoch or after an end-of-epoch checkpoint):

* the torch, Python and NumPy random states at the save (dropout masks, random caption choice),
  put back at ``on_train_start``, before the resumed run draws anything or loads a batch. Nothing
  between the save and the next batch of the uninterrupted run draws from them either: the
  loaders draw their worker seeds from private generators, and evaluation runs without dropout;
* the layout the position was counted in. Under DDP every rank holds the same position and all
  ranks run with the same random state (seeded alike by ``seed_everything``); the checkpoint
  (written by rank 0) therefore fits all of them. A mid-epoch position only means something for the
  same global batch: a run resumed with another ``devices * batch_size`` from a mid-epoch
  checkpoint is refused (the same product on another number of processes continues with the same
  samples; an end-of-epoch checkpoint resumes on any layout).

Exactness needs the per-sample randomness to happen in the main process: with
``num_workers > 0`` each worker draws from its own generator, whose position a checkpoint does
not hold, so a dataset that draws at random per sample (captioning's ``captions_per_image``)
resumes with other draws and such a mid-epoch resume is refused
(:func:`refuse_unresumable_mid_epoch`); deterministic datasets (hierarchy, characters,
translation) resume exactly with workers too.

The language model's TBPTT stream keeps a loader of its own (``datamodules/lm_stream.py:
StreamLoader``, where its docstring says why).
"""

from __future__ import annotations

import itertools
import random
import warnings
from typing import Any, Iterator

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader


class ResumableSampler(DistributedSampler):
    """A shuffling ``DistributedSampler`` (one permutation per ``(seed, epoch)``, rank ``r`` taking
    positions ``r, r + W, ...``) whose state a ``StatefulDataLoader`` saves and restores.

    The state counts positions of the permutation over all ranks: after ``n`` samples on each of
    ``W`` ranks the first ``n·W`` positions are consumed whatever ``W`` is, so a resumed sampler on
    ``W'`` processes starts ``n·W / W'`` samples into its share of the same epoch (a state from an
    earlier epoch starts the next one from its first sample). torchdata's
    ``StatefulDistributedSampler`` counts this rank's samples, which mean other positions on
    another number of processes. ``len()`` stays the whole share: Lightning sizes the epoch from it
    and counts the batches a resumed epoch has already done itself.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.yielded = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples into this rank's share)

    def __iter__(self) -> Iterator[int]:
        resume, self._resume = self._resume, None
        self.yielded = 0
        return self._indices(resume)

    def _indices(self, resume: tuple[int, int] | None) -> Iterator[int]:
        # A generator: the permutation is drawn at the first index, after Lightning has set the
        # epoch (it creates the loader's iterator before it calls ``set_epoch`` on a resume).
        start = resume[1] if resume is not None and resume[0] == self.epoch else 0
        self.yielded = start
        for index in itertools.islice(super().__iter__(), start, None):
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        """The epoch and the permutation positions all ranks have consumed in it."""
        return {"epoch": int(self.epoch), "positions": self.yielded * self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the next iteration of the same epoch after ``positions`` positions of its permutation."""
        positions = int(state["positions"])
        if positions % self.num_replicas:
            raise ValueError(f"a sampler position of {positions} samples cannot be split over {self.num_replicas} "
                             f"processes (resume with the devices * data.init_args.batch_size of the checkpoint)")
        self._resume = (int(state["epoch"]), positions // self.num_replicas)


def training_loader(dataset: Dataset, **kwargs: Any) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` for a training split (see the module doc).

    Args:
        dataset: a map-style dataset sampled by a :class:`ResumableSampler` (``sampler=``), or an
            ``IterableDataset`` yielding whole batches (``batch_size=None``) that are the same
            for the same epoch.
        **kwargs: ``DataLoader`` arguments.
    """
    sampler = kwargs.get("sampler")
    if not isinstance(dataset, IterableDataset) and not isinstance(sampler, ResumableSampler):
        raise TypeError(f"training_loader over a map-style dataset needs sampler=ResumableSampler, got {type(sampler).__name__}")
    seed = sampler.seed if isinstance(sampler, ResumableSampler) else getattr(dataset, "seed", 0)
    # A private generator for the workers' base seed: a DataLoader draws one from the *global*
    # torch RNG each time it is iterated, which would move the dropout RNG between a
    # checkpoint and the next step differently in a resumed run.
    kwargs.setdefault("generator", torch.Generator().manual_seed(int(seed)))
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.14: nothing a user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(dataset, **kwargs)


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


def train_loaders(trainer: Any) -> list[Any]:
    """The trainer's training loaders as a list (one loader, or a CombinedLoader's collection)."""
    loaders = trainer.train_dataloader
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def samples_per_step(trainer: Any) -> list[int | None]:
    """Samples per step over all ranks of each resumable training loader (``None`` for pre-batched
    data: its batches are fixed)."""
    return [None if loader.batch_size is None else trainer.world_size * loader.batch_size
            for loader in train_loaders(trainer) if isinstance(loader, StatefulDataLoader)]


def resumed_mid_epoch(trainer: Any) -> bool:
    """Whether the trainer resumes from a checkpoint written in the middle of an epoch."""
    if trainer.ckpt_path is None or trainer.num_training_batches in (0, float("inf")):
        return False
    steps_per_epoch = -(-int(trainer.num_training_batches) // trainer.accumulate_grad_batches)
    return trainer.global_step % steps_per_epoch != 0


def check_layout(saved: dict[str, Any], world_size: int, global_batches: list[int | None], epoch: int) -> None:
    """A mid-epoch position is exact for the same global batch: rank ``r`` of ``W`` takes
    permutation positions ``r, r + W, ...``, so ``k`` steps of ``W x B`` samples cover its first
    ``k·W·B`` positions whatever ``W`` is. Pre-batched data is sharded per rank: the same ``W``."""
    saved_world = saved["world_size"]
    for saved_batch, here in zip(saved["global_batches"], global_batches):
        if saved_batch is not None and saved_batch == here:
            continue
        if saved_batch is None and here is None and saved_world == world_size:
            continue
        if saved_batch is not None:
            was = f"{saved_world} process(es) x batch_size {saved_batch // saved_world} = {saved_batch} samples per step"
            now = f"{world_size} x {(here or 0) // world_size} = {here}"
            fix = f"devices * data.init_args.batch_size = {saved_batch}"
        else:
            was, now, fix = f"{saved_world} process(es)", f"{world_size}", f"{saved_world} devices"
        raise ValueError(
            f"checkpoint was written in the middle of epoch {epoch} by {was} but this run has {now}: "
            f"its position in the epoch means other samples here (resume with {fix}, or from an end-of-epoch checkpoint)"
        )


class TrainingRandomState(pl.Callback):
    """Keeps what a ``StatefulDataLoader``'s state does not hold among the checkpoint's callback
    states: the global random states at the save and the layout (processes, samples per step) the
    loader's position was counted in.

    Callback states are restored on every resume, so at ``on_train_start``, before the first batch
    is loaded, a mid-epoch resume without a saved loader position or on another layout is refused
    and the random states are put back, mid-epoch or at the start of the epoch after an
    end-of-epoch checkpoint. Acts only when the training loaders are
    resumable ones (the language model restores its own, with its carried LSTM state). Added to
    every task run by ``tasks/base.py: HeadTask.configure_callbacks``.
    """

    def __init__(self) -> None:
        self._trainer: Any = None
        self._saved: dict[str, Any] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        fitting = self._trainer is not None and self._trainer.state.fn == "fit"
        if not fitting or not samples_per_step(self._trainer):
            return {}
        return {"random_state": random_state(), "world_size": self._trainer.world_size,
                "global_batches": samples_per_step(self._trainer)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict) or None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        saved, self._saved = self._saved, None
        if not samples_per_step(trainer):
            return
        if resumed_mid_epoch(trainer):
            if saved is None:
                raise ValueError(
                    f"checkpoint {trainer.ckpt_path} was written in the middle of epoch {trainer.current_epoch} (global "
                    f"step {trainer.global_step}) without the training loader's position (the loader that wrote it could "
                    f"not save one); resume from an end-of-epoch checkpoint (--checkpoint.every_n_epochs 1)"
                )
            check_layout(saved, trainer.world_size, samples_per_step(trainer), trainer.current_epoch)
        if saved is not None:
            set_random_state(saved["random_state"])


def refuse_unresumable_mid_epoch(trainer: Any) -> None:
    """Refuse to resume from a mid-epoch checkpoint when a training loader cannot continue there.

    Lightning would only warn and start the epoch's order from its first batch again: the run
    would train some samples twice and others not at all in that epoch and drift from the run it
    continues. Called at the start of training, before any step, so nothing is trained or written
    (:class:`TrainingRandomState` refuses a checkpoint without the position of a loader that has one).
    """
    if not resumed_mid_epoch(trainer):
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
    if stuck:
        raise ValueError(
            f"checkpoint {trainer.ckpt_path} was written in the middle of epoch {trainer.current_epoch} (global step "
            f"{trainer.global_step}) but the training loader ({', '.join(stuck)}) cannot resume mid-epoch (it has no "
            f"state_dict/load_state_dict); resume from an end-of-epoch checkpoint (--checkpoint.every_n_epochs 1) or "
            f"give the datamodule a resumable train loader (datamodules/resumable.py)"
        )
