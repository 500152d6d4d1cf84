"""The offline default Chinese-character source: GB2312 level-1 characters rendered from CJK
fonts with handwriting-like distortion (:mod:`datamodules.fonts`), cached once per split.

Class order (``classes``): GB2312 code order of level 1 (3,755 characters, which GB2312 sorts
by pinyin). Character frequencies are not known, so no frequency order is claimed.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info

from datamodules.fonts import Distortion, FontFace, faces_summary, find_cjk_fonts, gb2312_level1, render_sample
from datamodules.hanzi.base import HanziDataModule
from datamodules.hanzi.cache import CACHE_VERSION, DEFAULT_CACHE_DIR, ImageCache, select_classes, settings_key, write_cache

#: Writer seeds of the splits: training writers count up from 0, validation and test writers
#: from these offsets, so the three never share a distortion seed.
VAL_SEED_OFFSET = 10_000
TEST_SEED_OFFSET = 20_000

def _worker_signals() -> None:
    """Signal dispositions of a render process. A forked worker inherits the run's graceful-stop
    handlers (app/runtime/signals.py), under which ``Pool.terminate``'s SIGTERM would only set a flag
    and leave the pool waiting for the worker forever; the worker dies on SIGTERM instead and
    leaves Ctrl-C to the main process, which stops the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _render_task(task: tuple[FontFace, list[str], int, Distortion, int, int]) -> tuple[np.ndarray, np.ndarray]:
    face, characters, size, distortion, seed, writer = task
    face_id = zlib.crc32(face.name.encode())  # stable across font lists, unlike a position
    images = np.stack(
        [render_sample(face, ch, size, distortion, (seed, writer, face_id, ord(ch))) for ch in characters]
    )
    return images, np.array([ord(ch) for ch in characters], dtype=np.int64)


def as_distortion(value: Distortion | dict[str, Any]) -> Distortion:
    """``value`` as a :class:`Distortion` (a dict holds its fields, as saved in checkpoints)."""
    if isinstance(value, Distortion):
        return value
    if isinstance(value, dict):
        fields = set(Distortion.__dataclass_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(
                f"FontRenderedHanzi distortion has unknown field(s) {', '.join(unknown)}; the fields are "
                f"{', '.join(sorted(fields))} (fix data.init_args.distortion)")
        return Distortion(**value)
    raise ValueError(f"FontRenderedHanzi needs distortion to be a Distortion or a dict of its fields, got {value!r} (fix data.init_args.distortion)")


class FontRenderedHanzi(HanziDataModule):
    """The offline default: GB2312 level-1 characters rendered from every CJK font found.

    Each font is a writer family; each writer seed is one distorted "hand". Splits:

    * train: seeds ``0 .. train_writers-1`` in every font except ``held_out_font``;
    * val: seeds ``10000 ..`` (``val_writers`` of them) in every font;
    * test: seeds ``20000 ..`` (``test_writers``) in every font.

    So val/test measure unseen distortions and, when ``held_out_font`` is set, an unseen
    font design as well. A sample's pixels depend only on (``seed``, writer seed, font name,
    character), never on the class subset or the number of render processes.

    Args:
        train_writers / val_writers / test_writers: writer seeds per font and split.
        held_out_font: substring of a font name (e.g. ``"Serif"``) kept out of training.
        distortion: the handwriting-like distortion (see :class:`~datamodules.fonts.Distortion`).
        font_paths: font files/directories to use instead of searching packages and system.
        seed: base seed of all distortions.
        render_workers: processes rendering the cache (the machine's cores by default).
        (others: see :class:`HanziDataModule`.)
    """

    runtime_options: tuple[str, ...] = (*HanziDataModule.runtime_options, "font_paths", "render_workers")

    def __init__(
        self,
        image_size: int = 64,
        num_classes_limit: int | None = None,
        train_writers: int = 8,
        val_writers: int = 1,
        test_writers: int = 1,
        held_out_font: str | None = None,
        distortion: Distortion | dict[str, Any] = Distortion(),
        font_paths: list[str] | None = None,
        seed: int = 0,
        cache_dir: str = DEFAULT_CACHE_DIR,
        batch_size: int = 128,
        num_workers: int = 0,
        render_workers: int | None = None,
        predict_dir: str | None = None,
        skip_non_images: bool = False,
    ) -> None:
        super().__init__(image_size, num_classes_limit, cache_dir, batch_size, num_workers, predict_dir, skip_non_images)
        for key, value, minimum in (("train_writers", train_writers, 1), ("val_writers", val_writers, 1), ("test_writers", test_writers, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"FontRenderedHanzi needs {key} to be an integer >= {minimum}, got {value!r} (set data.init_args.{key})"
                )
        self.save_hyperparameters()
        self.train_writers, self.val_writers, self.test_writers = train_writers, val_writers, test_writers
        self.held_out_font = held_out_font
        # A checkpoint stores the distortion as a dict (LightningCLI's hyper-parameters): accept it.
        self.distortion = as_distortion(distortion)
        self.font_paths = font_paths
        self.seed = seed
        self.render_workers = render_workers if render_workers is not None else min(2, os.cpu_count() or 1)
        self._faces: list[FontFace] | None = None

    @property
    def classes(self) -> list[str]:
        level1 = gb2312_level1()
        return level1[: self.num_classes_limit] if self.num_classes_limit else level1

    @property
    def faces(self) -> list[FontFace]:
        """The CJK faces used as writers (searched on first use, not in ``__init__``)."""
        if self._faces is None:
            self._faces = find_cjk_fonts(self.font_paths)
        return self._faces

    def split_writers(self, split: str) -> list[tuple[FontFace, int]]:
        """``(face, writer seed)`` pairs of a split, in cache order."""
        faces = self.faces
        if split == "train":
            if self.held_out_font is not None:
                kept = [f for f in faces if self.held_out_font.lower() not in f.name.lower()]
                if len(kept) == len(faces) or not kept:
                    raise ValueError(
                        f"held_out_font {self.held_out_font!r} must match some but not all fonts found "
                        f"({faces_summary(faces)}); set data.init_args.held_out_font to part of one name"
                    )
                faces = kept
            seeds = range(self.train_writers)
        elif split == "val":
            seeds = range(VAL_SEED_OFFSET, VAL_SEED_OFFSET + self.val_writers)
        elif split == "test":
            seeds = range(TEST_SEED_OFFSET, TEST_SEED_OFFSET + self.test_writers)
        else:
            raise ValueError(f"unknown split {split!r}; expected train, val or test")
        return [(face, seed) for face in faces for seed in seeds]

    def cache_path(self, split: str) -> Path:
        writers = self.split_writers(split)
        settings = {
            "version": CACHE_VERSION,
            "source": "fonts",
            "size": self.image_size,
            "characters": "".join(self.classes),
            "writers": [(f.name, os.path.getsize(f.path), f.index, s) for f, s in writers],
            "distortion": asdict(self.distortion),
            "seed": self.seed,
        }
        return self.cache_dir / f"fonts-{split}-{settings_key(settings)}"

    def build_split(self, split: str) -> ImageCache:
        """Render a split into its cache (once; later calls just open it)."""
        directory = self.cache_path(split)
        if ImageCache.exists(directory):
            return ImageCache(directory)
        characters = self.classes
        chunk = 128
        tasks = [
            (face, characters[i : i + chunk], self.image_size, self.distortion, self.seed, writer)
            for face, writer in self.split_writers(split)
            for i in range(0, len(characters), chunk)
        ]
        rank_zero_info(
            f"rendering {split}: {len(characters)} characters x {len(self.split_writers(split))} writers "
            f"({faces_summary(self.faces)}) into {directory}"
        )
        meta = {"source": "fonts", "split": split, "writers": [(f.name, s) for f, s in self.split_writers(split)]}
        if self.render_workers > 1 and len(tasks) > 1:
            with multiprocessing.get_context("fork").Pool(self.render_workers, initializer=_worker_signals) as pool:
                return write_cache(directory, self.image_size, pool.imap(_render_task, tasks), meta)
        return write_cache(directory, self.image_size, map(_render_task, tasks), meta)

    def prepare_data(self) -> None:
        """Render the splits the running command reads (:func:`splits_for`), all three without a
        Trainer: a ``test`` renders no training images."""
        for split in splits_for(self.trainer):
            self.build_split(split)

    def setup_splits(self) -> None:
        lookup = self.class_lookup()
        for split in splits_for(self.trainer):
            self.datasets[split] = select_classes(self.build_split(split), lookup)


#: The splits each Trainer entry point reads (``fit`` validates as it trains; ``predict`` reads
#: ``predict_dir``).
SPLITS_READ = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ()}


def splits_for(trainer: Any) -> tuple[str, ...]:
    """The splits ``trainer``'s running entry point reads; all three without a Trainer (the tools,
    a datamodule used from Python) or for another entry point."""
    function = getattr(getattr(trainer, "state", None), "fn", None)
    return SPLITS_READ.get(getattr(function, "value", None), ("train", "val", "test"))

