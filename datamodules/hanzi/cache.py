"""The image cache both Chinese-character sources fill once and read through ``np.memmap``.

A cache is a directory holding ``images.u8`` (a raw uint8 array ``(N, size, size)``),
``codes.npy`` (the character of each image as an integer code) and ``meta.json`` (the
settings and counts), named by a hash of everything that determines the pixels, so epochs,
later runs and other processes never re-render or re-parse.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.files import atomic_path

CACHE_VERSION = 1
DEFAULT_CACHE_DIR = "~/.cache/headbench/hanzi"


def settings_key(settings: dict[str, Any]) -> str:
    """Short stable hash of the JSON-serialisable settings that determine a cache's pixels."""
    blob = json.dumps(settings, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class ImageCache:
    """A finished cache directory: ``images`` is a read-only ``(N, size, size)`` memmap."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.meta = json.loads((directory / "meta.json").read_text())
        self.codes = np.load(directory / "codes.npy")
        self.size = int(self.meta["size"])
        self._images: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    @property
    def images(self) -> np.ndarray:
        # Opened on first use so that DataLoader workers each map the file themselves.
        if self._images is None:
            self._images = np.memmap(
                self.directory / "images.u8", dtype=np.uint8, mode="r", shape=(len(self), self.size, self.size)
            )
        return self._images

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_images"] = None  # never pickle the mapped pixels into worker processes
        return state

    @staticmethod
    def exists(directory: Path) -> bool:
        return (directory / "meta.json").is_file()


def write_cache(
    directory: Path, size: int, batches: Iterable[tuple[np.ndarray, np.ndarray]], meta: dict[str, Any]
) -> ImageCache:
    """Stream ``(images (n, size, size) uint8, codes (n,))`` batches into a new cache directory.

    Written through :func:`datamodules.files.atomic_path`, so an interrupted build never leaves
    a cache that looks finished.
    """
    try:
        with atomic_path(directory, "image cache", "free space or set data.init_args.cache_dir", directory=True) as tmp:
            codes: list[np.ndarray] = []
            with (tmp / "images.u8").open("wb") as handle:
                for images, batch_codes in batches:
                    assert images.shape[1:] == (size, size) and images.dtype == np.uint8
                    handle.write(np.ascontiguousarray(images).tobytes())
                    codes.append(np.asarray(batch_codes, dtype=np.int64))
            all_codes = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
            np.save(tmp / "codes.npy", all_codes)
            meta = {**meta, "size": size, "count": int(all_codes.size)}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    except OSError:
        if not ImageCache.exists(directory):
            raise
        # Another process finished the same cache first: its copy holds the same pixels.
    return ImageCache(directory)


def to_input(pixels: np.ndarray) -> torch.Tensor:
    """uint8 image, white background -> float ``(1, H, W)`` with ink 1 and paper 0."""
    return torch.from_numpy((255.0 - pixels.astype(np.float32)) / 255.0).unsqueeze(0)


class CachedCharacters(Dataset):
    """Rows ``rows`` of a cache with their class ids."""

    def __init__(self, cache: ImageCache, rows: np.ndarray, targets: np.ndarray) -> None:
        self.cache, self.rows, self.targets = cache, rows, targets

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input": to_input(self.cache.images[self.rows[i]]), "target": int(self.targets[i])}


def select_classes(cache: ImageCache, lookup: dict[int, int]) -> CachedCharacters:
    """The rows of ``cache`` whose code has a class id in ``lookup`` (code -> class id)."""
    targets = np.array([lookup.get(int(c), -1) for c in cache.codes], dtype=np.int64)
    rows = np.flatnonzero(targets >= 0)
    return CachedCharacters(cache, rows, targets[rows])
