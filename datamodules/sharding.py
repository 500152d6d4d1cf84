"""DDP sharding for the map-style datamodules (hierarchy, Chinese characters, captioning).

Training: one seeded shuffle per epoch cut into per-rank slices, so 1 process with batch 2B sees
the same samples per step as 2 processes with batch B. Evaluation: rank ``r`` gets items
``r, r + W, ...``; every rank runs the same number of steps and the (at most one) extra item per
rank is a padding copy whose targets are ignored, so every sample is counted exactly once (no
``DistributedSampler`` repeats).
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from datamodules.resumable import ResumableSampler
from heads.base import IGNORE_INDEX



def rank_and_world(datamodule: L.LightningDataModule) -> tuple[int, int]:
    """``(global_rank, world_size)`` of the trainer the datamodule is attached to, else ``(0, 1)``."""
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None:
        return 0, 1
    return trainer.global_rank, trainer.world_size


def training_sampler(dataset: Dataset, rank: int, world_size: int) -> ResumableSampler:
    """The epoch's shuffled order, cut the same way on any number of processes.

    One permutation seeded by ``(seed, epoch)`` (Lightning calls ``set_epoch``; ``seed`` is the
    run's ``seed_everything`` value, as for Lightning's own distributed sampler), rank ``r``
    taking positions ``r, r + W, ...``: with ``W`` processes of ``B`` rows, step ``k`` covers
    positions ``k·W·B ... (k+1)·W·B - 1`` of the permutation, exactly the rows one process of
    ``W·B`` rows sees at step ``k``. So 1 x 2B and 2 x B train on the same global batches
    (Lightning's own replacement sampler would, but its 1-process RandomSampler draws another
    order). Being a ``DistributedSampler`` keeps Lightning from replacing it; being a
    :class:`~datamodules.resumable.ResumableSampler` lets a ``StatefulDataLoader``
    (:func:`~datamodules.resumable.training_loader`) start it in the middle of an epoch.
    """
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    return ResumableSampler(dataset, num_replicas=world_size, rank=rank, seed=seed)


class EvaluationShard(Dataset):
    """Rank ``rank``'s share of an evaluation set: items ``rank, rank + W, rank + 2W, ...``.

    Every rank gets ``ceil(N / W)`` items so that all ranks run the same number of steps (a DDP
    forward may broadcast buffers, which every rank must join); the at most one missing item
    per rank is ``pad(last item)``, an item that counts nothing (target ``IGNORE_INDEX``, or a
    flag the task reads). Lightning's ``DistributedSampler`` would instead repeat real samples,
    which the metrics would then count twice.
    """

    def __init__(self, dataset: Dataset, rank: int, world_size: int, pad: Callable[[Any], Any]) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"EvaluationShard needs 0 <= rank < world_size, got rank {rank} of world size {world_size} (pass the trainer's global_rank and world_size)")
        self.dataset, self.rank, self.world_size, self.pad = dataset, rank, world_size, pad
        self.total = len(dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return math.ceil(self.total / self.world_size)

    def __getitem__(self, position: int) -> Any:
        index = self.rank + position * self.world_size
        if index < self.total:
            return self.dataset[index]
        return self.pad(self.dataset[self.total - 1])


class ShardedOrder(DistributedSampler):
    """Sequential order over a dataset that is already this rank's shard (:class:`EvaluationShard`).

    A ``DistributedSampler`` of one replica: Lightning leaves loaders with a
    ``DistributedSampler`` alone instead of sharding (and padding) them a second time.
    """

    def __init__(self, shard: Dataset) -> None:
        super().__init__(shard, num_replicas=1, rank=0, shuffle=False)


def evaluation_loader(dataset: Dataset, rank: int, world_size: int, pad: Callable[[Any], Any], **loader_args: Any) -> DataLoader:
    """A DataLoader over this rank's :class:`EvaluationShard` of ``dataset``, every sample of the
    set scored by exactly one rank.

    Its workers' base seed comes from a private generator: a ``DataLoader`` otherwise draws it
    from the global torch RNG at every iteration, so each validation would move the dropout RNG
    of the training steps after it, and a run resumed from a checkpoint would draw other masks.
    """
    shard = EvaluationShard(dataset, rank, world_size, pad)
    loader_args.setdefault("generator", torch.Generator().manual_seed(0))
    return DataLoader(shard, sampler=ShardedOrder(shard), **loader_args)


def ignored_target(item: dict[str, Any]) -> dict[str, Any]:
    """A padding copy of a classification sample: its target is ignored by loss and metrics."""
    target = item["target"]
    return {**item, "target": torch.full_like(target, IGNORE_INDEX) if isinstance(target, Tensor) else IGNORE_INDEX}
