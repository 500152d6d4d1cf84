"""What every captioning source shares (:class:`CaptionDataModule`): tokenisation, vocabulary,
image transforms, batching. Sources: :class:`datamodules.captioning.KarpathyCaptions` (COCO,
Flickr) and :class:`datamodules.scenes.SyntheticScenes` (the embedded default, shapes it draws
and describes).

Images are normalised with the ImageNet statistics torchvision's ResNets expect. Training takes
``captions_per_image`` captions of every image, so the encoder runs once for several captions
(the ``seq_per_img`` trick of common captioning code); evaluation takes all of them
(``val/loss`` averages over every reference). Batches: see :mod:`datamodules.captioning.dataset`.

No horizontal flips: captions say "left of" and "right of".
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader
from torchvision import transforms

from datamodules.base import HeadDataModule
from datamodules.bpe import EOS_ID, TextTokenizer, train_bpe
from datamodules.captioning.dataset import CaptionDataset, CaptionRecord, collate_captions, padding_image, simple_words
from datamodules.resumable import training_loader
from datamodules.sharding import evaluation_loader, rank_and_world, training_sampler
from datamodules.vocab import Vocabulary

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIALS = (PAD, UNK, BOS, EOS)  # ids PAD_ID, UNK_ID, BOS_ID, EOS_ID (datamodules/bpe.py)
TOKENIZERS = ("word", "bpe")
#: torchvision's ImageNet normalisation (what its pretrained ResNets were trained with).
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class CaptionDataModule(HeadDataModule):
    """Shared machinery of captioning data sources; subclasses provide the records. The classes
    are the caption pieces of :attr:`vocab`, decoded with :attr:`text_tokenizer`.

    Args:
        tokenizer: ``word`` (whitespace words, ``count_threshold``) or ``bpe``
            (sentencepiece BPE with ``bpe_vocab_size`` pieces, trained on the training
            captions; the BPE-MoS setting).
        count_threshold: words seen fewer times in training captions become ``<unk>``
            (5 in Karpathy's COCO preprocessing).
        bpe_vocab_size: BPE model size (``tokenizer: bpe``).
        bpe_cache_dir: where trained BPE models are cached (default: no cache).
        max_length: training captions are cut to this many tokens (16 in Karpathy's code).
        image_size: images are resized to ``image_size x image_size``.
        batch_size: images per training batch.
        eval_batch_size: images per evaluation batch (default ``batch_size``).
        captions_per_image: captions per image in each training batch.
        num_workers: data-loader workers.
        skip_bad_images: skip (and count) missing or undecodable images instead of stopping
            with an error naming the file.
        predict_split: which split ``predict`` captions.
    """

    #: Where data is read, cached or fetched from and how it is loaded: the command line's
    #: choice, never a checkpoint's (:mod:`app.checkpoint_io.policy`).
    runtime_options: tuple[str, ...] = ("bpe_cache_dir", "num_workers")

    frequency_ordered = True  # Vocabulary ids: specials, then decreasing frequency

    def __init__(
        self,
        tokenizer: str = "word",
        count_threshold: int = 5,
        bpe_vocab_size: int = 1000,
        bpe_cache_dir: str | None = None,
        max_length: int = 16,
        image_size: int = 224,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        captions_per_image: int = 5,
        num_workers: int = 0,
        skip_bad_images: bool = False,
        predict_split: str = "test",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown caption tokenizer {tokenizer!r}: valid are {', '.join(TOKENIZERS)} (set data.init_args.tokenizer)")
        for key, value, minimum in (
            ("count_threshold", count_threshold, 1),
            ("max_length", max_length, 1),
            ("image_size", image_size, 16),
            ("batch_size", batch_size, 1),
            ("captions_per_image", captions_per_image, 1),
            ("num_workers", num_workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} needs {key} to be an integer >= {minimum}, got {value!r} (set data.init_args.{key})")
        if predict_split not in ("train", "val", "test"):
            raise ValueError(f"{name} needs predict_split in train, val, test, got {predict_split!r} (set data.init_args.predict_split)")
        self.tokenizer_kind = tokenizer
        self.count_threshold = count_threshold
        self.bpe_vocab_size = bpe_vocab_size
        self.bpe_cache_dir = bpe_cache_dir
        self.max_length = max_length
        self.image_size = image_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.captions_per_image = captions_per_image
        self.num_workers = num_workers
        self.skip_bad_images = skip_bad_images
        self.predict_split = predict_split
        self._records: dict[str, list[CaptionRecord]] = {}
        self._vocab: Vocabulary | None = None
        self._tokenizer: TextTokenizer | None = None
        self.skipped_images: list[str] = []  # missing files dropped in setup (skip_bad_images)

    # ------------------------------------------------------------------ subclass interface
    def load_records(self, split: str) -> list[CaptionRecord]:
        """All records of ``split`` (``train``, ``val``, ``test``)."""
        raise NotImplementedError

    def load_image(self, record: CaptionRecord) -> Image.Image:
        """The RGB image of ``record`` (raise ``ValueError`` naming the file on failure)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ records and text
    def records(self, split: str) -> list[CaptionRecord]:
        if split not in self._records:
            self._records[split] = self.load_records(split)
        return self._records[split]

    def pieces(self, record: CaptionRecord) -> list[list[str]]:
        """Token pieces of every caption of ``record``."""
        tokenizer = self.text_tokenizer
        if tokenizer.kind == "word":
            if record.tokens is not None:
                return [[t.lower() for t in tokens] for tokens in record.tokens]
            return [simple_words(c) for c in record.captions]
        return [tokenizer.tokenize(c) for c in record.captions]

    @property
    def text_tokenizer(self) -> TextTokenizer:
        """The caption tokenizer (``word``, or BPE trained on the training captions on first use)."""
        if self._tokenizer is None:
            if self.tokenizer_kind == "word":
                self._tokenizer = TextTokenizer("word")
            else:
                lines = [c.lower() for r in self.records("train") for c in r.captions]
                proto = train_bpe(lines, self.bpe_vocab_size, self.bpe_cache_dir, lowercase=True)
                self._tokenizer = TextTokenizer("bpe", proto, lowercase=True)
        return self._tokenizer

    @property
    def vocab(self) -> Vocabulary:
        """Training-caption vocabulary, built on first use (specials, then by frequency)."""
        if self._vocab is None:
            counts: Counter = Counter()
            for record in self.records("train"):
                for pieces in self.pieces(record):
                    counts.update(pieces)
            threshold = self.count_threshold if self.tokenizer_kind == "word" else 1
            self._vocab = Vocabulary(counts, specials=SPECIALS, min_count=threshold, unk=UNK)
        return self._vocab

    @property
    def num_classes(self) -> int:
        return len(self.vocab)

    @property
    def class_names(self) -> list[str]:
        """The caption pieces in id order (:attr:`vocab`)."""
        return list(self.vocab.itos)

    def class_counts(self) -> Tensor:
        """``(num_classes,)`` occurrences of each id among the training targets (every caption's
        pieces, cut at ``max_length``, plus its EOS); heads start their biases from it."""
        vocab, ids = self.vocab, []
        for record in self.records("train"):
            for pieces in self.pieces(record):
                ids += vocab.encode(pieces[: self.max_length])
                ids.append(EOS_ID)
        return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=self.num_classes)

    # ------------------------------------------------------------------ datasets
    def transform(self) -> Callable[[Image.Image], Tensor]:
        return transforms.Compose(
            [
                transforms.Resize((self.image_size, self.image_size)),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )

    def dataset(self, split: str) -> CaptionDataset:
        records = self.records(split)
        vocab = self.vocab
        encoded = [[vocab.encode(p[: self.max_length]) for p in self.pieces(r)] for r in records]
        k = self.captions_per_image if split == "train" else 0
        return CaptionDataset(records, self.load_image, self.transform(), encoded, k, self.skip_bad_images)

    def _loader(self, split: str, stage: str) -> DataLoader:
        """``stage`` ``train``: a seeded shuffle cut the same way on any number of processes;
        ``eval``: this rank's share of the split, every image scored by exactly one rank (no
        DistributedSampler repeats); ``predict``: Lightning's own (unrepeated) predict sampler."""
        dataset = self.dataset(split)
        args: dict[str, Any] = {
            "batch_size": self.batch_size if stage == "train" else self.eval_batch_size,
            "num_workers": self.num_workers,
            "collate_fn": collate_captions,
            "persistent_workers": self.num_workers > 0,
        }
        rank, world_size = rank_and_world(self)
        if stage == "train":
            return training_loader(dataset, sampler=training_sampler(dataset, rank, world_size), **args)
        if stage == "eval":
            return evaluation_loader(dataset, rank, world_size, padding_image, **args)
        return DataLoader(dataset, **args)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", "train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", "eval")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", "eval")

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_split, "predict")
