"""Parallel text for machine translation: files, tokenisation, vocabularies and token batching.

Layout: ``{data_dir}/{split}.{lang}`` or ``{split}.{lang}.gz``, UTF-8, one sentence per line,
line ``i`` of the two language files aligned. Built-in sources name their splits and the
language pairs they hold (``SOURCES``); ``files`` accepts any pair and split names.

Batches hold up to ``max_tokens`` padded tokens (``sentences x longest side``), built from
sentences sorted by length (length buckets of width one, so padding is minimal) and
visited in a seeded random order every epoch. Under DDP every rank computes the same batch
list and takes a disjoint share: training trims the list to a multiple of the world size so
all ranks run the same number of steps; evaluation and prediction take ``batches[rank::world]``
with no repetition, so every sentence is scored exactly once (a rank one batch short runs an
unscored filler batch so that every rank still takes the same number of steps).

Empty lines: a training pair with an empty side teaches nothing and is dropped (the
number dropped is reported once). In validation, test and predict an empty source line is
kept by default (``empty_source="translate"``): the model sees only EOS and its output (often
empty) still fills that line of the output file, so outputs stay aligned with inputs;
``empty_source="error"`` refuses such a file instead, naming file and line.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from datamodules.bpe import BOS_ID, EOS_ID, PAD_ID, TextTokenizer, decode_ids, train_bpe
from datamodules.download import download_file
from datamodules.text import read_lines as read_text_lines
from datamodules.vocab import Vocabulary
from heads.base import IGNORE_INDEX

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
SPECIALS = (PAD, UNK, BOS, EOS)  # ids PAD_ID, UNK_ID, BOS_ID, EOS_ID (datamodules/bpe.py)


@dataclass(frozen=True)
class ParallelSource:
    """A known corpus: its default splits and the language pairs it holds (both directions)."""

    splits: tuple[str, str, str]
    pairs: tuple[tuple[str, str], ...]
    base_url: str | None = None  # download location of the ``{split}.{lang}.gz`` files
    checksums: dict[str, str] | None = None  # file name -> SHA-256 of the published file


MULTI30K_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
#: SHA-256 of the multi30k/dataset ``data/task1/raw`` files, computed with
#: ``datamodules.download.file_checksum`` from the unchanged copies in ``../shared/data/multi30k``.
#: Other files of that directory (e.g. ``test_2017_flickr``) download unverified, with a warning.
MULTI30K_TASK1_SHA256 = {
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
}
SOURCES: dict[str, ParallelSource] = {
    "multi30k": ParallelSource(
        ("train", "val", "test_2016_flickr"), (("de", "en"), ("fr", "en"), ("cs", "en")), MULTI30K_URL, MULTI30K_TASK1_SHA256
    ),
    # fairseq's examples/translation/prepare-iwslt14.sh output (tokenised, lower-cased).
    "iwslt14": ParallelSource(("train", "valid", "test"), (("de", "en"),)),
    # User-provided files, e.g. train / newstest2013 / newstest2014.
    "wmt14": ParallelSource(("train", "newstest2013", "newstest2014"), (("en", "de"), ("en", "fr"))),
    "synthetic": ParallelSource(("train", "valid", "test"), (("src", "tgt"),)),
    "files": ParallelSource(("train", "valid", "test"), ()),
}


# ---------------------------------------------------------------------------------- files
def find_text_file(directory: Path, split: str, lang: str) -> Path | None:
    for name in (f"{split}.{lang}", f"{split}.{lang}.gz"):
        if (directory / name).exists():
            return directory / name
    return None


def read_lines(path: Path) -> list[str]:
    """Lines of a (optionally gzipped) UTF-8 file, newline stripped.

    Raises:
        ValueError: a line that is not UTF-8 (naming file and line) or a damaged gzip file
            (see :func:`datamodules.text.read_lines`, which also recognises gzip by content).
    """
    return list(read_text_lines(path))


def read_parallel(source_path: Path, target_path: Path) -> tuple[list[str], list[str]]:
    """Aligned source/target lines; refuses files of different lengths naming both."""
    source, target = read_lines(source_path), read_lines(target_path)
    if len(source) != len(target):
        raise ValueError(
            f"parallel files must have the same number of lines: {source_path} has {len(source)}, "
            f"{target_path} has {len(target)} (fix or re-extract the corpus)"
        )
    return source, target


# ---------------------------------------------------------------------------------- synthetic
def synthetic_corpus(num_sentences: int, seed: int, words: int = 12, min_len: int = 3, max_len: int = 8) -> tuple[list[str], list[str]]:
    """A toy language pair that needs attention but no world knowledge.

    Source sentences are random strings of ``words`` source words; the translation maps
    every word through a fixed bilingual lexicon and swaps each adjacent pair of words (a
    local reordering), so a model must learn a lexicon and to attend off the diagonal.
    """
    rng = random.Random(seed)
    lexicon = {f"s{i}": f"t{(i * 5 + 3) % words}" for i in range(words)}
    source_words = list(lexicon)
    sources, targets = [], []
    for _ in range(num_sentences):
        sentence = [rng.choice(source_words) for _ in range(rng.randint(min_len, max_len))]
        translated = [lexicon[w] for w in sentence]
        for i in range(0, len(translated) - 1, 2):
            translated[i], translated[i + 1] = translated[i + 1], translated[i]
        sources.append(" ".join(sentence))
        targets.append(" ".join(translated))
    return sources, targets


# ---------------------------------------------------------------------------------- batching
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
        for batch in batches:
            if batch is None:
                yield {**collate(self.examples[:1]), "filler": True}
            else:
                yield collate([self.examples[i] for i in batch])


# ---------------------------------------------------------------------------------- datamodule
class TranslationDataModule(pl.LightningDataModule):
    """Parallel corpus -> tokenised, frequency-ordered, token-batched translation data.

    Args:
        source: corpus kind, one of ``multi30k``, ``iwslt14``, ``wmt14``, ``synthetic``,
            ``files`` (see ``SOURCES`` for splits and language pairs).
        data_dir: directory of ``{split}.{lang}[.gz]`` files (``synthetic`` writes there).
        src_lang / tgt_lang: translation direction, e.g. ``de`` -> ``en``.
        train_split / val_split / test_split: file prefixes (default: the source's own).
        predict_file: a source-language file to translate in ``predict`` (default: the
            test split's source file).
        download: fetch missing Multi30k files (``{split}.{lang}.gz`` of the three splits) from
            GitHub, checksum-verified, in ``prepare_data`` (or on the first read of a size, which
            the CLI does at instantiation, before ``prepare_data``).
        base_url: download location instead of the source's own (a mirror holding the same
            file names; the checksums still apply).
        tokenizer: ``bpe`` (sentencepiece, trained on the training split), ``word``, or
            ``presegmented`` (subword-nmt ``@@`` pieces already in the files, e.g. IWSLT'14
            as prepared by fairseq; outputs and references lose the markers).
        vocab_size: BPE pieces per model; for ``word``, the most words kept (0 = all).
        joint_bpe: one BPE model over both languages (else one per language).
        min_count: drop words seen fewer times (``word`` tokenizer).
        lowercase: lower-case all text before tokenising (outputs are then lower case).
        cache_dir: where trained BPE models and synthetic data are kept.
        max_tokens: padded tokens per batch (``sentences x max(source, target length)``).
        max_sentences: optional cap on sentences per batch.
        eval_max_tokens: ``max_tokens`` for validation/test/predict (default: same).
        max_train_length: drop training pairs with a side longer than this many pieces.
        empty_source: ``translate`` (keep empty eval/predict lines) or ``error``.
        synthetic_size: training pairs of the synthetic corpus (valid/test get a tenth).
        seed: shuffling and synthetic-data seed.
        num_workers: dataloader workers.
    """

    def __init__(
        self,
        source: str = "multi30k",
        data_dir: str = "../shared/data/multi30k/task1",
        src_lang: str = "de",
        tgt_lang: str = "en",
        train_split: str | None = None,
        val_split: str | None = None,
        test_split: str | None = None,
        predict_file: str | None = None,
        download: bool = False,
        base_url: str | None = None,
        tokenizer: str = "bpe",
        vocab_size: int = 8000,
        joint_bpe: bool = True,
        min_count: int = 1,
        lowercase: bool = False,
        cache_dir: str = ".cache/translation",
        max_tokens: int = 4000,
        max_sentences: int | None = None,
        eval_max_tokens: int | None = None,
        max_train_length: int = 128,
        empty_source: str = "translate",
        synthetic_size: int = 2000,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if source not in SOURCES:
            raise ValueError(f"unknown translation source {source!r}: valid sources are {', '.join(SOURCES)} (set data.init_args.source)")
        pairs = SOURCES[source].pairs
        if pairs and (src_lang, tgt_lang) not in pairs and (tgt_lang, src_lang) not in pairs:
            valid = ", ".join(f"{a}-{b}, {b}-{a}" for a, b in pairs)
            raise ValueError(
                f"{source} has no {src_lang}-{tgt_lang} language pair: valid pairs are {valid} "
                f"(set data.init_args.src_lang / tgt_lang)"
            )
        if download and source != "synthetic" and SOURCES[source].base_url is None and base_url is None:
            raise ValueError(
                f"translation source {source!r} has no download location (only multi30k has one): put its "
                f"files in data_dir and set data.init_args.download false, or give data.init_args.base_url"
            )
        if src_lang == tgt_lang:
            raise ValueError(f"src_lang and tgt_lang must differ, both are {src_lang!r} (set data.init_args.tgt_lang)")
        if tokenizer not in ("bpe", "word", "presegmented"):
            raise ValueError(f"unknown tokenizer {tokenizer!r}: valid kinds are bpe, word, presegmented (set data.init_args.tokenizer)")
        if empty_source not in ("translate", "error"):
            raise ValueError(f"unknown empty_source policy {empty_source!r}: valid policies are translate, error (set data.init_args.empty_source)")
        for key, value in (("max_tokens", max_tokens), ("max_train_length", max_train_length), ("synthetic_size", synthetic_size)):
            if value < 1:
                raise ValueError(f"TranslationDataModule needs {key} >= 1, got {value} (set data.init_args.{key})")
        defaults = SOURCES[source].splits
        self.splits = {
            "train": train_split or defaults[0],
            "val": val_split or defaults[1],
            "test": test_split or defaults[2],
        }
        self.data_path = Path(data_dir)
        if source == "synthetic":  # one directory per generated corpus, never a stale one
            self.data_path = self.data_path / f"size{synthetic_size}-seed{seed}"
        self.cache_path = Path(cache_dir)
        self.source_tokenizer: TextTokenizer | None = None
        self.target_tokenizer: TextTokenizer | None = None
        self.source_vocab: Vocabulary | None = None
        self.target_vocab: Vocabulary | None = None
        self._examples: dict[str, list[Example]] = {}

    # ------------------------------------------------------------------ sizes (lazy)
    @property
    def num_classes(self) -> int:
        """Target vocabulary size (specials + pieces seen in the training targets)."""
        self._build_vocabularies()
        return len(self.target_vocab)

    @property
    def source_vocab_size(self) -> int:
        self._build_vocabularies()
        return len(self.source_vocab)

    @property
    def frequency_ordered(self) -> bool:
        return True

    # ------------------------------------------------------------------ files
    def _split_path(self, split: str, lang: str) -> Path:
        if self.hparams.source == "synthetic":
            self._write_synthetic()
        path = find_text_file(self.data_path, split, lang)
        if path is None and self.hparams.download and self.hparams.source != "synthetic":
            # Every read of a split file comes through here, and the first one can come before
            # Lightning calls prepare_data (the CLI reads num_classes at instantiation): fetch
            # and verify the missing files first.
            self.prepare_data()
            path = find_text_file(self.data_path, split, lang)
        if path is None:
            # Say where the files are expected in terms the user can check: the resolved path of a
            # relative data_dir, and whether that directory exists at all.
            location = str(self.data_path) if self.data_path.is_absolute() else f"{self.data_path} (= {self.data_path.resolve()})"
            state = "" if self.data_path.is_dir() else ", a directory that does not exist"
            how = (
                "set data.init_args.download: true to fetch them, or put them there"
                if SOURCES[self.hparams.source].base_url
                else "put them there"
            )
            raise ValueError(
                f"no {split}.{lang} or {split}.{lang}.gz in {location}{state} (translation source "
                f"{self.hparams.source!r}); {how}, or set data.init_args.data_dir"
            )
        return path

    def _write_synthetic(self) -> None:
        if find_text_file(self.data_path, "test", "tgt") is not None:
            return
        self.data_path.mkdir(parents=True, exist_ok=True)
        size, seed = self.hparams.synthetic_size, self.hparams.seed
        for offset, (split, count) in enumerate((("train", size), ("valid", max(10, size // 10)), ("test", max(10, size // 10)))):
            sources, targets = synthetic_corpus(count, seed * 1000 + offset)
            for lang, lines in (("src", sources), ("tgt", targets)):
                partial = self.data_path / f"{split}.{lang}.tmp"
                partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
                partial.replace(self.data_path / f"{split}.{lang}")

    def _missing_files(self) -> list[str]:
        """``{split}.{lang}.gz`` names of the files of the three splits not in ``data_dir``."""
        langs = (self.hparams.src_lang, self.hparams.tgt_lang)
        return [
            f"{split}.{lang}.gz"
            for split in dict.fromkeys(self.splits.values())
            for lang in langs
            if find_text_file(self.data_path, split, lang) is None
        ]

    def prepare_data(self) -> None:
        """Write the synthetic corpus, or download missing files (``download: true``): each
        through :func:`datamodules.download.download_file` (checksum, timeout, atomic rename),
        so no reader ever sees a partial or unverified file."""
        if self.hparams.source == "synthetic":
            self._write_synthetic()
            return
        if not self.hparams.download:
            return
        source = SOURCES[self.hparams.source]
        base_url = self.hparams.base_url or source.base_url
        base_url = base_url if base_url.endswith("/") else base_url + "/"
        checksums = source.checksums or {}
        for name in self._missing_files():
            download_file(base_url + name, self.data_path / name, checksums.get(name))

    # ------------------------------------------------------------------ tokenisation
    def _build_vocabularies(self) -> None:
        if self.target_vocab is not None:
            return
        hp = self.hparams
        train_paths = self._split_path(self.splits["train"], hp.src_lang), self._split_path(self.splits["train"], hp.tgt_lang)
        source_lines, target_lines = read_parallel(*train_paths)
        for path, lines in zip(train_paths, (source_lines, target_lines)):
            if not any(line.strip() for line in lines):  # else the vocabulary is the specials alone
                raise ValueError(f"{path} gives no usable train sentences (every line is blank): put one sentence per line "
                                 f"in it or point data.init_args.data_dir at the corpus")
        if hp.tokenizer in ("word", "presegmented"):
            self.source_tokenizer = TextTokenizer(hp.tokenizer, lowercase=hp.lowercase)
            self.target_tokenizer = self.source_tokenizer
        elif hp.joint_bpe:
            proto = train_bpe(source_lines + target_lines, hp.vocab_size, self.cache_path, hp.lowercase, seed=hp.seed)
            self.source_tokenizer = TextTokenizer("bpe", proto, hp.lowercase)
            self.target_tokenizer = self.source_tokenizer
        else:
            self.source_tokenizer = TextTokenizer("bpe", train_bpe(source_lines, hp.vocab_size, self.cache_path, hp.lowercase, seed=hp.seed), hp.lowercase)
            self.target_tokenizer = TextTokenizer("bpe", train_bpe(target_lines, hp.vocab_size, self.cache_path, hp.lowercase, seed=hp.seed), hp.lowercase)
        max_size = hp.vocab_size + len(SPECIALS) if hp.tokenizer == "word" and hp.vocab_size > 0 else None
        min_count = hp.min_count if hp.tokenizer == "word" else 1
        self.source_vocab = self._count_vocabulary(self.source_tokenizer, source_lines, max_size, min_count)
        self.target_vocab = self._count_vocabulary(self.target_tokenizer, target_lines, max_size, min_count)

    @staticmethod
    def _count_vocabulary(tokenizer: TextTokenizer, lines: list[str], max_size: int | None, min_count: int) -> Vocabulary:
        counts: Counter = Counter()
        for line in lines:
            counts.update(tokenizer.tokenize(line))
        return Vocabulary(counts, specials=SPECIALS, max_size=max_size, min_count=min_count, unk=UNK)

    def state_for_checkpoint(self) -> dict[str, Any]:
        """Tokenizers (BPE model protos) and vocabularies, stored in every checkpoint."""
        self._build_vocabularies()
        return {
            "source_tokenizer": self.source_tokenizer.state(),
            "target_tokenizer": self.target_tokenizer.state(),
            "source_itos": list(self.source_vocab.itos),
            "target_itos": list(self.target_vocab.itos),
            "src_lang": self.hparams.src_lang,
            "tgt_lang": self.hparams.tgt_lang,
        }

    def load_state_for_checkpoint(self, state: dict[str, Any]) -> None:
        """Use a checkpoint's tokenizers and vocabularies (re-encodes any split already read)."""
        check_tokenizer_state(state)
        self.source_tokenizer = TextTokenizer.from_state(state["source_tokenizer"])
        self.target_tokenizer = TextTokenizer.from_state(state["target_tokenizer"])
        self.source_vocab = Vocabulary.from_itos(state["source_itos"], unk=UNK)
        self.target_vocab = Vocabulary.from_itos(state["target_itos"], unk=UNK)
        self._examples.clear()

    def decode_target(self, ids: Sequence[int]) -> str:
        """Detokenised text of generated target ids (specials dropped)."""
        self._build_vocabularies()
        return decode_ids(ids, self.target_vocab, self.target_tokenizer)

    # ------------------------------------------------------------------ examples
    def examples(self, stage: str) -> list[Example]:
        """Encoded examples of ``train`` / ``val`` / ``test`` / ``predict`` (cached)."""
        if stage in self._examples:
            return self._examples[stage]
        self._build_vocabularies()
        hp = self.hparams
        if stage == "predict":
            path = Path(hp.predict_file) if hp.predict_file else self._split_path(self.splits["test"], hp.src_lang)
            if not path.exists():
                raise ValueError(f"predict_file {path} does not exist (set data.init_args.predict_file)")
            source_lines, target_lines = read_lines(path), []
            source_name = str(path)
        else:
            split = self.splits[stage]
            source_path = self._split_path(split, hp.src_lang)
            source_lines, target_lines = read_parallel(source_path, self._split_path(split, hp.tgt_lang))
            source_name = str(source_path)
        examples, dropped = [], 0
        for index, source_line in enumerate(source_lines):
            reference = target_lines[index] if target_lines else None
            source_ids = self.source_vocab.encode(self.source_tokenizer.tokenize(source_line))
            target_ids = self.target_vocab.encode(self.target_tokenizer.tokenize(reference)) if reference is not None else None
            if stage == "train":
                if not source_ids or not target_ids or max(len(source_ids), len(target_ids)) > hp.max_train_length:
                    dropped += 1
                    continue
            elif not source_ids and hp.empty_source == "error":
                raise ValueError(
                    f"{source_name} line {index + 1} is empty and empty_source='error' "
                    f"(remove the line or set data.init_args.empty_source: translate)"
                )
            if reference is not None and self.target_tokenizer.kind == "presegmented":
                reference = self.target_tokenizer.detokenize(reference.split())  # BLEU on words, not pieces
            examples.append(Example(index, source_ids, target_ids, source_line, reference))
        if dropped:
            print(f"translation data: dropped {dropped} of {len(source_lines)} training pairs (empty side or longer than {hp.max_train_length} pieces)")
        if not examples:
            raise ValueError(f"{source_name} gives no usable {stage} sentences")
        self._examples[stage] = examples
        return examples

    def class_counts(self) -> torch.Tensor:
        """``(num_classes,)`` occurrences of each target id in the training targets the decoder
        predicts (every sentence's pieces plus its EOS); heads start their biases from it."""
        examples = self.examples("train")
        ids = torch.tensor([t for e in examples for t in e.target], dtype=torch.long)
        counts = torch.bincount(ids, minlength=self.num_classes)
        counts[EOS_ID] += len(examples)
        return counts

    # ------------------------------------------------------------------ loaders
    def _rank(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _current_epoch(self) -> int:
        trainer = getattr(self, "trainer", None)
        return trainer.current_epoch if trainer is not None else 0

    def _loader(self, stage: str) -> DataLoader:
        hp = self.hparams
        rank, world_size = self._rank()
        training = stage == "train"
        stream = TokenBatchStream(
            self.examples(stage),
            max_tokens=hp.max_tokens if training else (hp.eval_max_tokens or hp.max_tokens),
            max_sentences=hp.max_sentences,
            shuffle=training,
            seed=hp.seed,
            rank=rank,
            world_size=world_size,
            even=training,
            epoch_fn=self._current_epoch if training else None,
        )
        return DataLoader(stream, batch_size=None, num_workers=hp.num_workers)

    def train_dataloader(self) -> DataLoader:
        # Resumes mid-epoch from a checkpoint (datamodules/resumable.py): the same token batches
        # for the same epoch, the trained ones drawn and dropped.
        from datamodules.resumable import as_resumable

        return as_resumable(self._loader("train"), epoch_fn=self._current_epoch)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


def check_tokenizer_state(state: dict[str, Any] | None, where: str = "checkpoint") -> None:
    """Refuse a checkpoint that cannot detokenise its own predictions."""
    required = ("source_tokenizer", "target_tokenizer", "source_itos", "target_itos")
    missing = [key for key in required if not state or key not in state]
    if missing:
        raise ValueError(
            f"{where} has no tokenizer model (missing datamodule_state {', '.join(missing)}): it was not "
            f"saved by TranslationTask with a TranslationDataModule; retrain or use a checkpoint that has one"
        )
