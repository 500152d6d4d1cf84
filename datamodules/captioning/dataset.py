"""Caption records, the dataset that loads their images and draws their captions, and the
collate function that flattens captions into teacher-forcing rows.

Batches: ``images (B, 3, S, S)``; the captions of those images flattened to ``N`` rows,
``caption_input (N, T)`` = ``[BOS, w_1 .. w_n]`` padded with PAD and ``caption_output (N, T)`` =
``[w_1 .. w_n, EOS]`` padded with ``IGNORE_INDEX``, and ``caption_image (N,)`` giving each
caption's image row; evaluation batches also carry ``references`` (raw strings, for the COCO
metrics) and ``image_id``.
"""

from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset

from datamodules.bpe import BOS_ID, EOS_ID, PAD_ID
from heads.base import IGNORE_INDEX


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
