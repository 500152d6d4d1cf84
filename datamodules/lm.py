"""Base class of the word-level language-modeling data sources.

Every source turns each split into one long stream of token ids (each sentence/line is its
words followed by ``<eos>``, the Penn Treebank / AWD-LSTM convention) and serves it as
truncated-BPTT windows of contiguous rows through :class:`datamodules.lm_stream.TBPTTStream`.
Under DDP each rank streams its own contiguous shard, so every target token is scored exactly
once (no padding duplicates from a ``DistributedSampler``).

Vocabulary id order is a contract (Mixtape's gate sharing and the DS-Softmax analyses rely
on it): ``<unk>`` = 0, ``<eos>`` = 1, then every other word by decreasing count in the
training split, ties broken by first appearance.

Subclasses implement two hooks, both free to do I/O and cached by this class:

* ``_build_vocabulary()`` -> :class:`Vocabulary` (from the training split);
* ``_build_split(split)`` -> ``(L,)`` LongTensor of ids for ``"train"``/``"valid"``/``"test"``;

and may override ``_compute_true_entropy()`` when the true distribution is known.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from datamodules.base import DataState, HeadDataModule, check_data_state
from datamodules.lm_stream import StreamLoader, TBPTTStream
from datamodules.vocab import Vocabulary
from heads.base import IGNORE_INDEX

SPECIALS = ("<unk>", "<eos>")
SPLITS = ("train", "valid", "test")


def check_positive(value: Any, key: str, owner: str, minimum: int = 1) -> int:
    """One-line error for an integer data argument below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner} needs {key} to be an integer >= {minimum}, got {value!r} (set data.init_args.{key})")
    return value


class LanguageModelingDataModule(HeadDataModule):
    """Contiguous token streams of train/valid/test splits for truncated BPTT.

    The classes are the words of :attr:`vocabulary`; besides the base contract it offers
    :class:`datamodules.base.TokenWindows` (``bptt``).

    Args:
        batch_size: parallel rows per rank in training.
        eval_batch_size: parallel rows per rank in validation, test and predict.
        bptt: window length (tokens per row per batch).
        variable_bptt: AWD-LSTM's random training window length around ``bptt``.
        seed: seed of the random window lengths (and of generated data where relevant).
        num_workers: DataLoader workers, 0 or 1: the stream is one ordered sequence, and
            each extra worker of an iterable dataset would replay all of it.
    """

    #: Where data is read, cached or fetched from and how it is loaded: the command line's
    #: choice, never a checkpoint's (:mod:`app.checkpoint_io.policy`).
    runtime_options: tuple[str, ...] = ("num_workers",)

    #: Ids are sorted by decreasing training frequency after the specials.
    frequency_ordered: ClassVar[bool] = True

    def __init__(
        self,
        batch_size: int = 20,
        eval_batch_size: int = 10,
        bptt: int = 35,
        variable_bptt: bool = False,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_positive(batch_size, "batch_size", name)
        check_positive(eval_batch_size, "eval_batch_size", name)
        check_positive(bptt, "bptt", name)
        if num_workers not in (0, 1):
            raise ValueError(
                f"{name} needs num_workers to be 0 or 1, got {num_workers!r}: a token stream is one "
                f"ordered sequence and every extra worker would replay all of it (set data.init_args.num_workers)"
            )
        self.batch_size, self.eval_batch_size, self.bptt = batch_size, eval_batch_size, bptt
        self.variable_bptt, self.seed, self.num_workers = variable_bptt, seed, num_workers
        self._vocabulary: Vocabulary | None = None
        self._splits: dict[str, Tensor] = {}
        self._true_entropy: float | None = None
        self._true_entropy_known = False

    # ----------------------------------------------------------------- subclass hooks
    def _build_vocabulary(self) -> Vocabulary:
        raise NotImplementedError

    def _build_split(self, split: str) -> Tensor:
        raise NotImplementedError

    def _compute_true_entropy(self) -> float | None:
        """Nats per test target under the true distribution; None for real corpora."""
        return None

    # ----------------------------------------------------------------- lazy properties
    @property
    def vocabulary(self) -> Vocabulary:
        """Frequency-ordered vocabulary (``<unk>``, ``<eos>``, then by decreasing train count)."""
        if self._vocabulary is None:
            self._vocabulary = self._build_vocabulary()
        return self._vocabulary

    @property
    def num_classes(self) -> int:
        """Vocabulary size, i.e. the number of classes the output head predicts."""
        return len(self.vocabulary)

    @property
    def class_names(self) -> list[str]:
        """The words in id order (:attr:`vocabulary`)."""
        return list(self.vocabulary.itos)

    @property
    def eos_index(self) -> int:
        return self.vocabulary.index("<eos>")

    @property
    def true_entropy(self) -> float | None:
        """Mean nats per test target under the true distribution (None when unknown)."""
        if not self._true_entropy_known:
            self._true_entropy = self._compute_true_entropy()
            self._true_entropy_known = True
        return self._true_entropy

    def split(self, name: str) -> Tensor:
        """``(L,)`` ids of one split, built on first use and cached."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; valid splits are {list(SPLITS)}")
        if name not in self._splits:
            self._splits[name] = self._build_split(name)
        return self._splits[name]

    def class_counts(self) -> Tensor:
        """``(num_classes,)`` occurrences of each id in the training stream (heads start their biases from it)."""
        return torch.bincount(self.split("train"), minlength=self.num_classes)

    # ----------------------------------------------------------------- checkpoints
    def load_state_for_checkpoint(self, state: DataState, where: str = "checkpoint") -> None:
        """Use a checkpoint's vocabulary (its ``class_names``) instead of rebuilding it."""
        self._vocabulary = Vocabulary.from_itos(check_data_state(state, where)["class_names"])

    # ----------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str | None = None) -> None:
        needed = {"fit": ("train", "valid"), "validate": ("valid",), "test": ("test",), "predict": ("test",)}
        for name in needed.get(stage, SPLITS) if stage else SPLITS:
            self.split(name)

    def _rank_and_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _loader(self, split: str, batch_size: int, variable_length: bool) -> StreamLoader:
        rank, world_size = self._rank_and_world()
        stream = TBPTTStream(
            self.split(split),
            batch_size,
            self.bptt,
            rank=rank,
            world_size=world_size,
            variable_length=variable_length,
            seed=self.seed,
            pad_target=IGNORE_INDEX,
            pad_input=self.eos_index,
        )
        # A StreamLoader remembers how far the epoch got, so a mid-epoch checkpoint resumes
        # at the next window instead of replaying the epoch (see datamodules/lm_stream.py).
        return StreamLoader(stream, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, self.variable_bptt)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid", self.eval_batch_size, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, False)


def encode_lines(lines: list[list[str]], vocabulary: Vocabulary) -> Tensor:
    """Concatenate tokenised lines into one id stream, ``<eos>`` after each line.

    Shape: returns ``(sum(len(line) + 1),)`` int64.
    """
    stoi, unk, eos = vocabulary.stoi, vocabulary.index("<unk>"), vocabulary.index("<eos>")
    ids: list[int] = []
    for tokens in lines:
        ids.extend(stoi.get(token, unk) for token in tokens)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def count_tokens(lines: list[list[str]]) -> dict[str, int]:
    """Token counts in first-appearance order (the tie-break of the id order); ``<eos>``
    counted once per line."""
    counts: dict[str, int] = {}
    for tokens in lines:
        for token in tokens:
            counts[token] = counts.get(token, 0) + 1
    counts["<eos>"] = counts.get("<eos>", 0) + len(lines)
    return counts


def not_a_regular_file(path: Path) -> str | None:
    """What stands at ``path`` instead of a regular file, as the end of a sentence naming it ("is
    a directory, not a file"); None when nothing is there (the file is missing) or it is a file."""
    if not os.path.lexists(path):
        return None
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is a symbolic link that loops back on itself, not a file"
        if os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return f"cannot be read ({os.strerror(error.errno or 0)})"
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    for is_kind, kind in kinds:
        if is_kind(mode):
            return f"is {kind}, not a regular file"
    return None


def where_files_are_missing(data_dir: Path, missing: list[Path], kind: str | None = None) -> str:
    """The first half of a missing-corpus message: the data directory that does not exist, the
    first path that holds something other than a file (a directory, a FIFO, a looping link), or
    the first missing file (with how many ``kind`` files are missing when ``kind`` is given)."""
    if not data_dir.is_dir():
        return f"data directory {os.path.abspath(data_dir)} does not exist"
    for path in missing:
        problem = not_a_regular_file(path)
        if problem is not None:
            return f"{os.path.abspath(path)} {problem}"
    return f"{os.path.abspath(missing[0])} is missing" + (f" ({len(missing)} {kind} files missing)" if kind else "")
