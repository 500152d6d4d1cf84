"""Contiguous token streams for truncated back-propagation through time (TBPTT).

A split is one long token sequence of ``M`` predictions. It is cut into
``world_size * batch_size`` contiguous *global rows* of equal length, and rank ``r`` takes
global rows ``r*B .. (r+1)*B - 1``: a contiguous shard, every target token scored exactly
once across ranks, and no padding duplicate from a ``DistributedSampler``. Because the layout
depends only on the product ``world_size * batch_size``, 1 process with ``B`` rows and 2
processes with ``B/2`` rows each see exactly the same global batch (the DDP equivalence test
relies on it). Batches are consecutive time windows of the rows, so the recurrent state carried
from one batch to the next continues the same text. The last global rows are padded at their end
with ``pad_target`` (the heads' ignore index) so all ranks yield the same number of batches,
which DDP training needs.

Resuming mid-epoch: :class:`StreamLoader` is a ``DataLoader`` with Lightning's stateful
protocol (``state_dict`` / ``load_state_dict``): a checkpoint records the epoch and how many
windows were handed to the trainer, and a resumed run continues with the next window.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset


class TBPTTStream(IterableDataset):
    """Yields ``{"input": (B, T), "target": (B, T)}`` windows of a contiguous stream.

    Args:
        tokens: ``(L,)`` token ids of the whole split.
        batch_size: number of parallel rows ``B`` per rank.
        bptt: window length ``T``.
        rank / world_size: this process's shard of the stream.
        variable_length: AWD-LSTM's random window (``T ~ N(bptt, 5)``, halved with
            probability 0.05, at least 5), drawn from ``seed`` and the epoch so every rank
            draws the same lengths.
        pad_target: target id for padding (contributes no loss).
        pad_input: input id used where the target is padding.
    """

    def __init__(
        self,
        tokens: Tensor,
        batch_size: int,
        bptt: int,
        rank: int = 0,
        world_size: int = 1,
        variable_length: bool = False,
        seed: int = 0,
        pad_target: int = -100,
        pad_input: int = 0,
    ) -> None:
        super().__init__()
        if tokens.dim() != 1 or tokens.numel() < 2:
            raise ValueError(f"a token stream needs at least 2 tokens, got shape {tuple(tokens.shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.batch_size, self.bptt = batch_size, bptt
        self.variable_length, self.seed = variable_length, seed
        self.epoch = 0
        #: Windows of the epoch to skip at the next iteration (set by :class:`StreamLoader` on resume).
        self.start_window = 0
        num_predictions = tokens.numel() - 1
        # Global rows first, then this rank's B of them: the layout depends on world_size * B only.
        self.row_length = math.ceil(num_predictions / (world_size * batch_size))
        per_rank = batch_size * self.row_length
        start = min(rank * per_rank, num_predictions)
        stop = min(start + per_rank, num_predictions)
        inputs = torch.full((batch_size * self.row_length,), pad_input, dtype=torch.long)
        targets = torch.full((batch_size * self.row_length,), pad_target, dtype=torch.long)
        inputs[: stop - start] = tokens[start:stop]
        targets[: stop - start] = tokens[start + 1 : stop + 1]
        self.inputs = inputs.view(batch_size, self.row_length)  # (B, L)
        self.targets = targets.view(batch_size, self.row_length)  # (B, L)
        self.num_targets = stop - start

    def window_starts(self, epoch: int) -> list[tuple[int, int]]:
        """(start, length) of each window for an epoch; identical on every rank."""
        if not self.variable_length:
            return [(s, min(self.bptt, self.row_length - s)) for s in range(0, self.row_length, self.bptt)]
        rng = np.random.default_rng([self.seed, epoch])
        windows, start = [], 0
        while start < self.row_length:
            base = self.bptt if rng.random() < 0.95 else self.bptt / 2
            length = max(5, int(rng.normal(base, 5)))
            length = min(length, self.row_length - start)
            windows.append((start, length))
            start += length
        return windows

    def __len__(self) -> int:
        return len(self.window_starts(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        skip, self.start_window = self.start_window, 0
        for start, length in self.window_starts(self.epoch)[skip:]:
            yield {
                "input": self.inputs[:, start : start + length],
                "target": self.targets[:, start : start + length],
            }
        self.epoch += 1


class StreamLoader(DataLoader):
    """``DataLoader`` of one :class:`TBPTTStream` whose position survives a checkpoint.

    Lightning saves ``state_dict()`` with every checkpoint of the fit loop and calls
    ``load_state_dict()`` before it iterates the resumed epoch. The state counts the windows
    this loader handed to the trainer in the current epoch; Lightning's fetcher does not read
    ahead of a loader with a length, so every counted window has been trained on. The loader
    (not the dataset copy a worker holds) owns the epoch counter, so each iteration starts the
    worker's copy at the right epoch and window.

    Not a torchdata ``StatefulDataLoader`` like the other tasks' training loaders
    (``datamodules/resumable.py``): Lightning 2 does not do truncated back-propagation through
    time, so the carried LSTM state lives in the model (``tasks/language_model.py``), saved with
    the ``(epoch, window)`` it continues and put back before that window; the resume is exact
    only if the stream starts at that window of that epoch, whose window lengths depend on the
    epoch. This loader sets both on the stream before each iteration; a ``StatefulDataLoader``
    saves a count of batches without their epoch and leaves the epoch's lengths to the dataset.

    Shape: yields ``{"input": (B, T), "target": (B, T)}`` like the stream.
    """

    def __init__(self, dataset: TBPTTStream, num_workers: int = 0, **kwargs: Any) -> None:
        # batch_size=None: the stream already yields whole (B, T) batches. Workers are not
        # persistent, so each epoch's worker receives the stream with its current epoch/window.
        # **kwargs: Lightning rebuilds loaders from their attributes (e.g. to track predict
        # indices), passing every DataLoader argument by name.
        kwargs.setdefault("batch_size", None)
        # A private generator: every iteration of a DataLoader draws a base seed for its
        # workers from ``generator``, which defaults to the *global* torch RNG. Each training
        # epoch and each validation would then advance the RNG that dropout uses, so the RNG
        # state saved in a checkpoint would depend on whether a validation or a new epoch's
        # loader came between the save and the next training window. With its own generator the
        # stream leaves the global RNG alone (its windows come from ``seed`` and the epoch).
        kwargs.setdefault("generator", torch.Generator().manual_seed(dataset.seed))
        super().__init__(dataset, num_workers=num_workers, **kwargs)
        self._next_epoch, self._next_window = dataset.epoch, 0
        self._epoch, self._windows_done = dataset.epoch, 0

    def __iter__(self):
        stream: TBPTTStream = self.dataset
        stream.epoch, stream.start_window = self._next_epoch, self._next_window
        self._epoch, self._windows_done = self._next_epoch, self._next_window
        self._next_epoch, self._next_window = self._epoch + 1, 0
        for batch in super().__iter__():
            self._windows_done += 1
            yield batch
        stream.epoch = self._next_epoch  # __len__ of the next epoch (variable window lengths)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "windows_done"}`` of the iteration in progress (or last finished)."""
        return {"epoch": self._epoch, "windows_done": self._windows_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``windows_done`` windows of ``epoch`` (the next epoch if it was complete)."""
        epoch, done = int(state["epoch"]), int(state["windows_done"])
        stream: TBPTTStream = self.dataset
        if done >= len(stream.window_starts(epoch)):
            epoch, done = epoch + 1, 0
        self._next_epoch, self._next_window = epoch, done
        stream.epoch = epoch
