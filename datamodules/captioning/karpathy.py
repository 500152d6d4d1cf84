"""COCO / Flickr8k / Flickr30k captions with Karpathy's splits.

The split files (``dataset_coco.json``, ``dataset_flickr8k.json``, ``dataset_flickr30k.json``:
``{"images": [{"filepath", "filename", "split", "sentences": [{"raw", "tokens"}], "cocoid" |
"imgid"}]}``) are read with an image root. ``restval`` (the COCO validation images not in
Karpathy's val/test) is folded into train by default, as in Karpathy & Fei-Fei (2015) and most
later work.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from datamodules.captioning.base import CaptionDataModule
from datamodules.captioning.dataset import CaptionRecord, load_image


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

    runtime_options: tuple[str, ...] = (*CaptionDataModule.runtime_options, "annotations", "image_root")

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
