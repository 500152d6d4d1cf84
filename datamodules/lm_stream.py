"""Contiguous token streams for truncated back-propagation through time (TBPTT).

A split is one long token sequence. Under DDP each rank takes one contiguous shard of the
*predictions* (so every target token is scored exactly once across ranks, and no rank sees
a padding duplicate from a ``DistributedSampler``). Each shard is cut into ``batch_size``
contiguous rows; batches are consecutive time windows of those rows, so the recurrent
state carried from one batch to the next continues the same text. Rows are padded at
their end with ``pad_target`` (the heads' ignore index) so all ranks yield the same
number of batches, which DDP training needs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset


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
        num_predictions = tokens.numel() - 1
        per_rank = math.ceil(num_predictions / world_size)
        self.row_length = math.ceil(per_rank / batch_size)
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
        for start, length in self.window_starts(self.epoch):
            yield {
                "input": self.inputs[:, start : start + length],
                "target": self.targets[:, start : start + length],
            }
        self.epoch += 1
