"""Image captioning data: images with several reference captions each.

Two sources share one base class (:class:`CaptionDataModule`: tokenisation, vocabulary,
image transforms, batching):

* :class:`KarpathyCaptions` reads the Karpathy-split JSON files (``dataset_coco.json``,
  ``dataset_flickr8k.json``, ``dataset_flickr30k.json``: ``{"images": [{"filepath",
  "filename", "split", "sentences": [{"raw", "tokens"}], "cocoid" | "imgid"}]}``) with an
  image root. ``restval`` (the 30,504 COCO validation images not in Karpathy's val/test)
  is folded into train by default, as in Karpathy & Fei-Fei (2015) and most later work.
* :class:`datamodules.scenes.SyntheticScenes` (the embedded default) draws shapes and
  describes them.

Batches: ``images (B, 3, S, S)`` normalised with the ImageNet statistics torchvision's
ResNets expect; the captions of those images flattened to ``N`` rows, ``caption_input
(N, T)`` = ``[BOS, w_1 .. w_n]`` padded with PAD and ``caption_output (N, T)`` =
``[w_1 .. w_n, EOS]`` padded with ``IGNORE_INDEX``, and ``caption_image (N,)`` giving each
caption's image row. Training takes ``captions_per_image`` captions of every image, so the
encoder runs once for several captions (the ``seq_per_img`` trick of common captioning
code); evaluation takes all of them (``val/loss`` averages over every reference) and also
carries ``references`` (raw strings, for the COCO metrics) and ``image_id``.

No horizontal flips: captions say "left of" and "right of".
"""

from __future__ import annotations

import json
import random
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from datamodules.bpe import BOS_ID, EOS_ID, PAD_ID, TextTokenizer, decode_ids, train_bpe
from datamodules.sharding import evaluation_loader, rank_and_world, training_sampler
from datamodules.vocab import Vocabulary
from heads.base import IGNORE_INDEX

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIALS = (PAD, UNK, BOS, EOS)  # ids PAD_ID, UNK_ID, BOS_ID, EOS_ID (datamodules/bpe.py)
TOKENIZERS = ("word", "bpe")
#: torchvision's ImageNet normalisation (what its pretrained ResNets were trained with).
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class CaptionRecord:
    """One image and its reference captions.

    ``source`` is whatever the data module's ``load_image`` needs (a path, a scene);
    ``tokens`` optionally holds pre-tokenised captions (Karpathy's ``tokens`` field).
    """

    image_id: int
    source: Any
    captions: list[str]
    tokens: list[list[str]] | None = None
    name: str = ""


def simple_words(caption: str) -> list[str]:
    """Lower-case words with punctuation removed (for captions without given tokens)."""
    return re.sub(r"[^\w\s']", " ", caption.lower()).split()


def load_image(path: Path) -> Image.Image:
    """Open an image as RGB, or raise one ``ValueError`` line naming the file."""
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"caption image {path} does not exist (check data.init_args.image_root, or set data.init_args.skip_bad_images: true)") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"cannot decode caption image {path}: {error} (replace the file, or set data.init_args.skip_bad_images: true)") from None


class CaptionDataset(Dataset):
    """Images (loaded lazily) with their encoded captions.

    ``captions_per_image = 0`` returns every caption (evaluation); ``k > 0`` draws ``k``
    of them at random (with replacement only when an image has fewer than ``k``).
    """

    def __init__(
        self,
        records: list[CaptionRecord],
        load: Callable[[CaptionRecord], Image.Image],
        transform: Callable[[Image.Image], Tensor],
        encoded: list[list[list[int]]],
        captions_per_image: int,
        skip_bad_images: bool,
    ) -> None:
        self.records, self.load, self.transform, self.encoded = records, load, transform, encoded
        self.captions_per_image = captions_per_image
        self.skip_bad_images = skip_bad_images
        self.bad_images: list[str] = []  # files skipped while loading (this process only)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def draws_per_sample(self) -> bool:
        """Whether loading a sample draws random numbers (the captions kept of an image): in
        data-loader workers those draws cannot be resumed mid-epoch (datamodules/resumable.py)."""
        return self.captions_per_image > 0

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        record = self.records[index]
        try:
            image = self.transform(self.load(record))  # (3, S, S)
        except ValueError:
            if not self.skip_bad_images:
                raise
            self.bad_images.append(record.name)
            if len(self.bad_images) == 1:
                warnings.warn(f"skipping undecodable caption image {record.name} (further ones are counted in bad_images)", stacklevel=2)
            return None
        captions = self.encoded[index]
        k = self.captions_per_image
        if k > 0:
            if len(captions) >= k:
                chosen = random.sample(range(len(captions)), k)
            else:
                chosen = [random.randrange(len(captions)) for _ in range(k)]
            captions = [captions[i] for i in chosen]
        return {"image": image, "captions": captions, "image_id": record.image_id, "references": record.captions, "index": index}


def collate_captions(items: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Stack images and flatten their captions into teacher-forcing rows (see module doc)."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    images = torch.stack([item["image"] for item in items])  # (B, 3, S, S)
    rows = [(b, ids) for b, item in enumerate(items) for ids in item["captions"]]
    T = max(len(ids) for _, ids in rows) + 1  # + BOS on the input side, + EOS on the output side
    caption_input = torch.full((len(rows), T), PAD_ID, dtype=torch.long)
    caption_output = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
    for r, (b, ids) in enumerate(rows):
        n = len(ids)
        caption_input[r, 0] = BOS_ID
        caption_input[r, 1 : n + 1] = torch.tensor(ids, dtype=torch.long)
        if items[b].get("padding"):
            continue  # a DDP padding image (see padding_image): its captions score nothing
        caption_output[r, :n] = torch.tensor(ids, dtype=torch.long)
        caption_output[r, n] = EOS_ID
    return {
        "images": images,
        "caption_input": caption_input,  # (N, T)
        "caption_output": caption_output,  # (N, T)
        "caption_image": torch.tensor([b for b, _ in rows], dtype=torch.long),  # (N,)
        "image_id": torch.tensor([item["image_id"] for item in items], dtype=torch.long),  # (B,)
        "references": [item["references"] for item in items],
        "index": torch.tensor([item["index"] for item in items], dtype=torch.long),
        # (B,) False for DDP padding images: not decoded, not scored (their targets are ignored).
        "scored": torch.tensor([not item.get("padding", False) for item in items], dtype=torch.bool),
    }


def padding_image(item: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of an evaluation item that only keeps a DDP rank in step: ``collate_captions``
    ignores its caption targets and marks it unscored (``scored`` False), so the task neither
    counts its tokens nor decodes it."""
    return None if item is None else {**item, "padding": True}


class CaptionDataModule(pl.LightningDataModule):
    """Shared machinery of captioning data sources; subclasses provide the records.

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

    def class_counts(self) -> Tensor:
        """``(num_classes,)`` occurrences of each id among the training targets (every caption's
        pieces, cut at ``max_length``, plus its EOS); heads start their biases from it."""
        vocab, ids = self.vocab, []
        for record in self.records("train"):
            for pieces in self.pieces(record):
                ids += vocab.encode(pieces[: self.max_length])
                ids.append(EOS_ID)
        return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=self.num_classes)

    def decode(self, ids: Sequence[int]) -> str:
        """Caption text from generated ids (specials dropped)."""
        return decode_ids(ids, self.vocab, self.text_tokenizer)

    def state_for_checkpoint(self) -> dict[str, Any]:
        """Vocabulary and tokenizer, so a checkpoint decodes captions on its own."""
        return {"caption_itos": list(self.vocab.itos), "caption_tokenizer": self.text_tokenizer.state()}

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
            return DataLoader(dataset, sampler=training_sampler(dataset, rank, world_size), **args)
        if stage == "eval":
            return evaluation_loader(dataset, rank, world_size, padding_image, **args)
        return DataLoader(dataset, **args)

    def train_dataloader(self) -> DataLoader:
        # Resumes mid-epoch from a checkpoint (datamodules/resumable.py).
        from datamodules.resumable import as_resumable

        return as_resumable(self._loader("train", "train"))

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", "eval")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", "eval")

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_split, "predict")


# ---------------------------------------------------------------------------------- Karpathy
def read_karpathy_json(path: Path) -> Any:
    """Parse a Karpathy split file; every way it can fail is one ``ValueError`` naming it."""
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.read().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 (byte 0x{error.object[error.start]:02x} at offset {error.start}); is this a Karpathy split file?") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno}); re-download the Karpathy split file") from None
    except RecursionError:
        raise ValueError(f"{path} nests JSON too deeply to be a Karpathy split file") from None


#: The ``split`` values of Karpathy's files (``restval``: COCO validation images outside his val/test).
KARPATHY_SPLITS = ("train", "val", "test", "restval")


def _is_id(value: Any) -> bool:
    """An image id usable as an int64 (outputs carry it in a tensor): an int or digit string."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def check_karpathy_entry(entry: Any, position: int, path: Path) -> None:
    """Refuse an ``images`` entry whose fields lack the types :meth:`KarpathyCaptions.load_records`
    relies on, naming the entry, so a damaged file never fails later with a ``TypeError``."""
    where = f"{path}: image entry {position}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where} is a {type(entry).__name__}, not an object (is this a Karpathy split file?)")
    missing = [key for key in ("filename", "split", "sentences") if key not in entry]
    if missing or ("cocoid" not in entry and "imgid" not in entry):
        raise ValueError(f"{where} lacks {', '.join(missing) or 'cocoid/imgid'} (is this a Karpathy split file?)")
    for key in ("filename", "split", "filepath"):
        if key in entry and not isinstance(entry[key], str):
            raise ValueError(f"{where} has a non-string {key} {entry[key]!r}; fix the entry or re-download the file")
    if entry["split"] not in KARPATHY_SPLITS:
        # Left unchecked, such an entry belongs to no split: a misspelt "val" trains with no validation.
        raise ValueError(
            f"{where} has split {entry['split']!r}; valid values are {', '.join(KARPATHY_SPLITS)} "
            f"(fix the entry or re-download the file)"
        )
    if not _is_id(entry.get("cocoid", entry.get("imgid"))):
        key = "cocoid" if "cocoid" in entry else "imgid"
        raise ValueError(f"{where} has {key} {entry[key]!r}, expected a non-negative integer; fix the entry or re-download the file")
    sentences = entry["sentences"]
    if not isinstance(sentences, list):
        raise ValueError(f"{where} has sentences of type {type(sentences).__name__}, expected a list of {{raw, tokens}} objects")
    for number, sentence in enumerate(sentences):
        raw_ok = isinstance(sentence, dict) and isinstance(sentence.get("raw", ""), str)
        tokens = sentence.get("tokens", []) if isinstance(sentence, dict) else None
        if not raw_ok or not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError(
                f"{where}, sentence {number}: expected an object with a string 'raw' and/or a list of "
                f"string 'tokens', got {str(sentence)[:80]!r}; fix the entry or re-download the file"
            )


class KarpathyCaptions(CaptionDataModule):
    """COCO / Flickr8k / Flickr30k with Karpathy's splits.

    Args:
        annotations: path of ``dataset_coco.json`` (or the Flickr files of the same format).
        image_root: directory the entries' ``filepath/filename`` are relative to
            (``filepath`` is ``train2014`` / ``val2014`` for COCO and absent for Flickr).
        restval_to_train: fold the ``restval`` split into ``train``.
        **kwargs: see :class:`CaptionDataModule`.

    Image ids in outputs are ``cocoid`` when the entry has one (so results JSON files score
    on the COCO server), else ``imgid``.
    """

    def __init__(self, annotations: str, image_root: str, restval_to_train: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.annotations = Path(annotations)
        self.image_root = Path(image_root)
        self.restval_to_train = restval_to_train
        self._entries: list[dict[str, Any]] | None = None

    def entries(self) -> list[dict[str, Any]]:
        if self._entries is None:
            if not self.annotations.is_file():
                raise ValueError(f"Karpathy split file {self.annotations} does not exist (download dataset_coco.json from Karpathy's neuraltalk2 page and set data.init_args.annotations)")
            data = read_karpathy_json(self.annotations)
            if not isinstance(data, dict) or not isinstance(data.get("images"), list):
                raise ValueError(f"{self.annotations} is not a Karpathy split file: expected a JSON object with an 'images' list")
            for position, entry in enumerate(data["images"]):
                check_karpathy_entry(entry, position, self.annotations)
            self._entries = data["images"]
        return self._entries

    def split_of(self, entry: dict[str, Any]) -> str:
        split = entry["split"]
        return "train" if split == "restval" and self.restval_to_train else split

    def load_records(self, split: str) -> list[CaptionRecord]:
        records = []
        for entry in self.entries():
            if self.split_of(entry) != split:
                continue
            path = self.image_root / entry.get("filepath", "") / entry["filename"]
            sentences = entry["sentences"]
            tokens = [s["tokens"] for s in sentences] if all("tokens" in s for s in sentences) else None
            captions = [s.get("raw") or " ".join(s.get("tokens", [])) for s in sentences]
            if not captions:
                continue
            image_id = int(entry["cocoid"] if "cocoid" in entry else entry["imgid"])
            records.append(CaptionRecord(image_id, path, captions, tokens, str(path)))
        if not records:
            # Said here, naming the file: an empty training split would otherwise surface as a
            # vocabulary of specials only ("num_classes >= 5") and an empty val split as a run
            # that never validates.
            found = Counter(entry["split"] for entry in self.entries() if entry["sentences"])
            wanted = "'train' or 'restval'" if split == "train" and self.restval_to_train else repr(split)
            held = ", ".join(f"{name} {found[name]}" for name in KARPATHY_SPLITS)
            raise ValueError(
                f"{self.annotations} has no {split} images: no entry with split {wanted} and at least one "
                f"sentence (images per split: {held}); use a complete Karpathy split file"
            )
        if self.skip_bad_images:
            kept = [r for r in records if Path(r.source).is_file()]
            missing = [r.name for r in records if not Path(r.source).is_file()]
            if missing:
                self.skipped_images.extend(missing)
                warnings.warn(f"{split}: skipped {len(missing)} missing caption images (first: {missing[0]})", stacklevel=2)
            records = kept
        return records

    def load_image(self, record: CaptionRecord) -> Image.Image:
        return load_image(record.source)
