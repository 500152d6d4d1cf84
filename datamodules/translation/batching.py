"""Token-count batches of sentence pairs, sharded over DDP ranks.

Batches hold up to ``max_tokens`` padded tokens (``sentences x longest side``), built from
sentences sorted by length (length buckets of width one, so padding is minimal) and
visited in a seeded random order every epoch. Under DDP every rank computes the same batch
list and takes a disjoint share: training trims the list to a multiple of the world size so
all ranks run the same number of steps; evaluation and prediction take ``batches[rank::world]``
with no repetition, so every sentence is scored exactly once (a rank one batch short runs an
unscored filler batch so that every rank still takes the same number of steps).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from datamodules.bpe import BOS_ID, EOS_ID, PAD_ID
from heads.base import IGNORE_INDEX


def token_batches(
    source_lengths: Sequence[int],
    target_lengths: Sequence[int],
    max_tokens: int,
    max_sentences: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
) -> list[list[int]]:
    """Group sentence indices into batches of at most ``max_tokens`` padded tokens.

    Sentences are sorted by (target, source) length — random tie order when shuffling —
    and cut greedily; a sentence longer than ``max_tokens`` gets a batch of its own.
    With ``shuffle`` the batch order is a permutation seeded by ``(seed, epoch)``, the
    same on every rank.
    """
    count = len(source_lengths)
    rng = random.Random(f"{seed}-{epoch}")
    indices = list(range(count))
    if shuffle:
        rng.shuffle(indices)
    indices.sort(key=lambda i: (target_lengths[i], source_lengths[i]))  # stable: shuffled ties
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in indices:
        width = max(source_lengths[i], target_lengths[i])
        grown = max(longest, width)
        full = max_sentences is not None and len(current) >= max_sentences
        if current and (full or grown * (len(current) + 1) > max_tokens):
            batches.append(current)
            current, grown = [], width
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    if shuffle:
        rng.shuffle(batches)
    return batches


def shard_batches(batches: list[list[int]], rank: int, world_size: int, even: bool) -> list[list[int]]:
    """This rank's share of ``batches``.

    ``even`` (training): every rank gets the same number of batches, trimming the
    remainder (or repeating batches if there are fewer batches than ranks). Otherwise
    (evaluation): a disjoint strided share with no padding, so the ranks together see
    every sentence exactly once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if even:
        if len(batches) < world_size:
            batches = [batches[i % len(batches)] for i in range(world_size)] if batches else []
        batches = batches[: len(batches) - len(batches) % world_size]
    return batches[rank::world_size]


@dataclass
class Example:
    index: int
    source: list[int]
    target: list[int] | None
    source_text: str
    reference: str | None


def collate(examples: list[Example]) -> dict[str, Any]:
    """Pad a batch.

    Returns ``source (B, S)`` and ``source_lengths (B,)`` (source pieces + EOS, PAD after),
    ``target_input (B, T)`` (BOS + pieces) and ``target_output (B, T)`` (pieces + EOS, then
    ``IGNORE_INDEX``), plus ``index (B,)`` line numbers and the raw ``source_text`` /
    ``reference`` strings for BLEU and output files. A ``filler`` key marks a batch that
    only keeps DDP ranks in step and must not be scored.
    """
    B = len(examples)
    S = max(len(e.source) for e in examples) + 1
    source = torch.full((B, S), PAD_ID, dtype=torch.long)
    source_lengths = torch.zeros(B, dtype=torch.long)
    for row, example in enumerate(examples):
        ids = example.source + [EOS_ID]
        source[row, : len(ids)] = torch.tensor(ids)
        source_lengths[row] = len(ids)
    batch: dict[str, Any] = {
        "source": source,
        "source_lengths": source_lengths,
        "index": torch.tensor([e.index for e in examples], dtype=torch.long),
        "source_text": [e.source_text for e in examples],
        "reference": [e.reference for e in examples],
    }
    if all(e.target is not None for e in examples):
        T = max(len(e.target) for e in examples) + 1
        target_input = torch.full((B, T), PAD_ID, dtype=torch.long)
        target_output = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(examples):
            target_input[row, : len(example.target) + 1] = torch.tensor([BOS_ID] + example.target)
            target_output[row, : len(example.target) + 1] = torch.tensor(example.target + [EOS_ID])
        batch["target_input"], batch["target_output"] = target_input, target_output
    return batch


class TokenBatchStream(IterableDataset):
    """Yields this rank's collated token-count batches; an epoch counter reshuffles them.

    Being an ``IterableDataset`` keeps Lightning from wrapping it in a ``DistributedSampler``
    (which would pad the evaluation set with duplicates); sharding is done here instead.
    Dataloader workers split the rank's batches between them.

    Its state (``state_dict`` / ``load_state_dict``, saved per worker by a ``StatefulDataLoader``)
    is the epoch and the batches this copy has yielded in it: the next iteration of the same epoch
    starts after them without collating the skipped ones; a state from an earlier epoch starts the
    next one from its first batch.
    """

    def __init__(
        self,
        examples: list[Example],
        max_tokens: int,
        max_sentences: int | None,
        shuffle: bool,
        seed: int,
        rank: int,
        world_size: int,
        even: bool,
        epoch_fn: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self.examples = examples
        self.source_lengths = [len(e.source) + 1 for e in examples]
        self.target_lengths = [len(e.target) + 1 if e.target is not None else 0 for e in examples]
        self.max_tokens, self.max_sentences = max_tokens, max_sentences
        self.shuffle, self.seed = shuffle, seed
        self.rank, self.world_size, self.even = rank, world_size, even
        self.epoch_fn = epoch_fn
        self.epoch = 0
        self.position = (0, 0)  # (epoch, batches yielded in it)
        self._resume: tuple[int, int] | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        batches = token_batches(self.source_lengths, self.target_lengths, self.max_tokens, self.max_sentences, self.shuffle, self.seed, epoch)
        return shard_batches(batches, self.rank, self.world_size, self.even)

    def steps(self) -> int:
        """Batches every rank yields: the largest share, so all ranks take the same number of
        steps (a DDP forward may broadcast buffers, which needs every rank to join)."""
        total = len(token_batches(self.source_lengths, self.target_lengths, self.max_tokens, self.max_sentences))
        if self.even:
            total = max(total, self.world_size)
            return (total - total % self.world_size) // self.world_size
        return math.ceil(total / self.world_size)

    def __len__(self) -> int:
        return self.steps()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch = self.epoch_fn() if self.epoch_fn is not None else self.epoch
        self.epoch += 1
        batches: list[list[int] | None] = list(self.batches(epoch))
        # Evaluation shares can differ by one batch: the short ranks add a *filler* batch
        # that the task runs but does not score, so no sentence is counted twice.
        batches += [None] * (self.steps() - len(batches))
        worker = get_worker_info()
        if worker is not None:
            batches = batches[worker.id :: worker.num_workers]
        resume, self._resume = self._resume, None
        start = resume[1] if resume is not None and resume[0] == epoch else 0
        self.position = (epoch, start)
        for batch in batches[start:]:
            self.position = (epoch, self.position[1] + 1)
            if batch is None:
                yield {**collate(self.examples[:1]), "filler": True}
            else:
                yield collate([self.examples[i] for i in batch])

    def state_dict(self) -> dict[str, int]:
        """The epoch in progress (or last finished) and the batches yielded in it; a loaded state
        until the next iteration starts (a worker reports its state before it yields)."""
        epoch, done = self._resume if self._resume is not None else self.position
        return {"epoch": epoch, "batches_done": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Start the next iteration of the same epoch after ``batches_done`` batches."""
        self._resume = (int(state["epoch"]), int(state["batches_done"]))
