"""CASIA-HWDB1.0/1.1 offline isolated characters from ``.gnt`` files (read by
:mod:`datamodules.gnt`), parsed once into an image cache.

Class order (``classes``): GB2312 code order for level 1 (3,755 characters, which GB2312 sorts
by pinyin); with ``label_set="all"``, every tag found in the training files in code order.
Character frequencies are not known (every CASIA writer writes the whole set once), so no
frequency order is claimed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from datamodules.fonts import gb2312_level1
from datamodules.gnt import character_code, framed_records, gnt_files, record_counts, tag_character, tag_codes
from datamodules.hanzi.base import HanziDataModule
from datamodules.hanzi.cache import CACHE_VERSION, DEFAULT_CACHE_DIR, CachedCharacters, ImageCache, settings_key, write_cache


class CasiaHWDB(HanziDataModule):
    """CASIA-HWDB1.0/1.1 offline isolated characters from ``.gnt`` files.

    Splits: ``test_dir`` is the test set; of the sorted training files (one file = one
    writer in HWDB), the last ``val_fraction`` are held out as validation writers
    (``val_fraction=0`` validates on the test files).

    Args:
        train_dir / test_dir: folders holding ``.gnt`` files (searched recursively).
        label_set: ``"level1"`` keeps the 3,755 GB2312 level-1 classes; samples with other tags
            are counted and reported (warning + :attr:`outside_level1`); ``"all"`` keeps every
            tag found in the training files.
        val_fraction: share of training writers (files) held out for validation.
        (others: see :class:`HanziDataModule`.)
    """

    runtime_options: tuple[str, ...] = (*HanziDataModule.runtime_options, "train_dir", "test_dir")

    def __init__(
        self,
        train_dir: str,
        test_dir: str,
        label_set: Literal["level1", "all"] = "level1",
        val_fraction: float = 0.1,
        image_size: int = 64,
        num_classes_limit: int | None = None,
        cache_dir: str = DEFAULT_CACHE_DIR,
        batch_size: int = 128,
        num_workers: int = 0,
        predict_dir: str | None = None,
        skip_non_images: bool = False,
    ) -> None:
        super().__init__(image_size, num_classes_limit, cache_dir, batch_size, num_workers, predict_dir, skip_non_images)
        if label_set not in ("level1", "all"):
            raise ValueError(f"CasiaHWDB needs label_set 'level1' or 'all', got {label_set!r} (set data.init_args.label_set)")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"CasiaHWDB needs val_fraction in [0, 1), got {val_fraction} (set data.init_args.val_fraction)")
        self.save_hyperparameters()
        self.train_dir, self.test_dir = train_dir, test_dir
        self.label_set = label_set
        self.val_fraction = val_fraction
        self.outside_level1: dict[str, Counter] = {}
        self._classes: list[str] | None = None
        self._all_codes: list[int] = []  # label_set="all": tag codes in class order

    @property
    def classes(self) -> list[str]:
        if self._classes is None:
            if self.label_set == "level1":
                classes = gb2312_level1()
            else:
                found = tag_codes(gnt_files(self.train_dir))
                if len(found) < 2:
                    raise ValueError(
                        f"CASIA-HWDB training files in {self.train_dir} hold {len(found)} distinct character tag(s); "
                        f"label_set='all' needs at least 2 (check that the .gnt files are complete, not empty)"
                    )
                self._all_codes = sorted(found)
                classes = [tag_character(c) for c in self._all_codes]
            self._classes = classes[: self.num_classes_limit] if self.num_classes_limit else classes
        return self._classes

    def class_codes(self) -> dict[int, int]:
        """Tag code -> class id."""
        if self.label_set == "level1":
            return {character_code(ch): i for i, ch in enumerate(self.classes)}
        count = self.num_classes  # lists the tags on first use
        return {c: i for i, c in enumerate(self._all_codes[:count])}

    def cache_path(self, files: Sequence[Path]) -> Path:
        settings = {
            "version": CACHE_VERSION,
            "source": "gnt",
            "size": self.image_size,
            "framing": "ink box",  # fit_to_square crops to the ink, as predict does
            "files": [(str(p.resolve()), p.stat().st_size, int(p.stat().st_mtime)) for p in files],
        }
        return self.cache_dir / f"gnt-{settings_key(settings)}"

    def build_cache(self, files: Sequence[Path]) -> ImageCache:
        """Parse ``files`` once into a cache of every sample (all tags; selection happens later)."""
        directory = self.cache_path(files)
        if ImageCache.exists(directory):
            return ImageCache(directory)
        rank_zero_info(f"parsing {len(files)} .gnt file(s) into {directory}")
        # Samples per file (one file = one writer) go in the metadata so splits by writer
        # need no second parse.
        counts = record_counts(files)
        meta = {"source": "gnt", "files": [str(p) for p in files], "file_counts": counts}
        return write_cache(directory, self.image_size, framed_records(files, self.image_size), meta)

    def _train_test_files(self) -> tuple[list[Path], list[Path], list[Path]]:
        train = gnt_files(self.train_dir)
        test = gnt_files(self.test_dir)
        if self.val_fraction == 0:
            return train, test, test
        num_val = max(1, int(round(self.val_fraction * len(train))))
        if num_val >= len(train):
            raise ValueError(
                f"CasiaHWDB holds out val_fraction={self.val_fraction} of {len(train)} training file(s), leaving "
                f"none to train on; add files or set data.init_args.val_fraction=0 to validate on test_dir"
            )
        return train[:-num_val], train[-num_val:], test

    def prepare_data(self) -> None:
        train, val, test = self._train_test_files()
        self.build_cache(sorted(set(train) | set(val)))
        self.build_cache(test)

    def _split(self, split: str, cache: ImageCache, keep_files: set[int] | None) -> CachedCharacters:
        lookup = self.class_codes()
        rows = np.arange(len(cache))
        if keep_files is not None:
            counts = cache.meta["file_counts"]
            file_ids = np.repeat(np.arange(len(counts)), counts)
            rows = rows[np.isin(file_ids, sorted(keep_files))]
        codes = cache.codes[rows]
        targets = np.array([lookup.get(int(c), -1) for c in codes], dtype=np.int64)
        if self.label_set == "level1":
            allowed = {character_code(ch) for ch in gb2312_level1()}
            reason = ("are outside GB2312 level 1 and left out (label_set='level1'; set "
                      "data.init_args.label_set=all to keep them)")
        else:
            # Classes come from the training files only: a tag that appears only in validation
            # or test files has no class id and its samples cannot be scored.
            allowed = set(self._all_codes)
            reason = ("have tags not found in the training files and are left out (label_set='all' "
                      "takes its classes from data.init_args.train_dir; add writers with those characters to it)")
        left_out = Counter(tag_character(int(c)) for c in codes if int(c) not in allowed)
        if self.label_set == "level1":
            self.outside_level1[split] = left_out
        if left_out:
            examples = ", ".join(f"{ch}x{n}" for ch, n in left_out.most_common(5))
            rank_zero_warn(
                f"CASIA-HWDB {split}: {sum(left_out.values())} of {len(codes)} samples ({len(left_out)} distinct tags, "
                f"e.g. {examples}) {reason}"
            )
        keep = targets >= 0
        if split == "train" and not keep.any():
            raise ValueError(
                f"CASIA-HWDB train split has no sample of the {self.num_classes} classes ({len(codes)} samples read; "
                f"empty or foreign .gnt files?): check data.init_args.train_dir or set data.init_args.label_set=all"
            )
        return CachedCharacters(cache, rows[keep], targets[keep])

    def setup_splits(self) -> None:
        train, val, test = self._train_test_files()
        train_val = sorted(set(train) | set(val))
        train_cache = self.build_cache(train_val)
        test_cache = self.build_cache(test)
        index = {p: i for i, p in enumerate(train_val)}
        self.datasets["train"] = self._split("train", train_cache, {index[p] for p in train})
        if self.val_fraction == 0:
            self.datasets["val"] = self._split("val", test_cache, None)
        else:
            self.datasets["val"] = self._split("val", train_cache, {index[p] for p in val})
        self.datasets["test"] = self._split("test", test_cache, None)
