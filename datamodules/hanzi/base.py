"""Chinese handwritten character recognition data: CASIA-HWDB ``.gnt`` files and the offline
default, GB2312 level-1 characters rendered from CJK fonts with handwriting-like distortion.

Both sources store images once in a compact cache (``images.u8``: a raw uint8 array
``(N, size, size)`` read through ``np.memmap``; ``codes.npy``: the character of each image as a
code point; ``meta.json``: the settings and counts) under a directory keyed by a hash of
everything that determines the pixels, so epochs, later runs and other processes never
re-render or re-parse.

Batches are ``{"input": (B, 1, size, size) float in [0, 1] with ink = 1, "target": (B,) class
ids}``; ``predict`` batches carry ``"path"`` instead of ``"target"``.

Class order (``classes``): GB2312 code order for level 1 (3,755 characters, which GB2312 sorts
by pinyin); with ``label_set="all"`` on CASIA, every tag found in the training files in code
order. Character frequencies are not known for these sources (every CASIA writer writes the
whole set once), so no frequency order is claimed.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import zlib
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from datamodules.fonts import (
    Distortion,
    FontFace,
    faces_summary,
    find_cjk_fonts,
    gb2312_level1,
    render_sample,
)
from datamodules.gnt import empty_gnt_error, fit_to_square, iter_gnt
from datamodules.sharding import evaluation_loader, ignored_target, rank_and_world, training_sampler

CACHE_VERSION = 1
DEFAULT_CACHE_DIR = "~/.cache/headbench/hanzi"
#: Writer seeds of the splits: training writers count up from 0, validation and test writers
#: from these offsets, so the three never share a distortion seed.
VAL_SEED_OFFSET = 10_000
TEST_SEED_OFFSET = 20_000


# ---------------------------------------------------------------------------------- cache
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

    Written under a temporary name and renamed at the end, so an interrupted build never leaves
    a cache that looks finished.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    codes: list[np.ndarray] = []
    with (tmp / "images.u8").open("wb") as handle:
        for images, batch_codes in batches:
            assert images.shape[1:] == (size, size) and images.dtype == np.uint8
            handle.write(np.ascontiguousarray(images).tobytes())
            codes.append(np.asarray(batch_codes, dtype=np.int64))
    all_codes = np.concatenate(codes) if codes else np.zeros(0, dtype=np.int64)
    np.save(tmp / "codes.npy", all_codes)
    (tmp / "meta.json").write_text(json.dumps({**meta, "size": size, "count": int(all_codes.size)}, indent=1))
    try:
        os.replace(tmp, directory)
    except OSError:  # another process finished the same cache first
        shutil.rmtree(tmp, ignore_errors=True)
    return ImageCache(directory)


# ---------------------------------------------------------------------------------- datasets
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


def is_image_file(path: Path) -> bool:
    """True when PIL can identify ``path`` as an image."""
    try:
        with Image.open(path) as image:
            image.verify()
        return True
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        return False


def load_character_image(path: str | Path, size: int) -> np.ndarray:
    """Read any image file as one character framed like the training data.

    Greyscale conversion, then inversion if the paper is dark, then :func:`fit_to_square`. The
    paper is taken to be dark when both the median border pixel and the median pixel are dark
    (< 128): the border alone misleads on a bitmap cropped to its ink, as ``.gnt`` records are,
    where a character such as 口 has ink all along the border; the whole image alone misleads
    on a heavy character with a white margin. Shape: returns ``(size, size)`` uint8,
    background 255.
    """
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("L"), dtype=np.uint8)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    if np.median(border) < 128 and np.median(pixels) < 128:
        pixels = 255 - pixels
    return fit_to_square(pixels, size)


class ImageFolder(Dataset):
    """The image files of a folder (sorted, recursive) for ``predict``."""

    def __init__(self, files: Sequence[Path], size: int) -> None:
        self.files, self.size = list(files), size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input": to_input(load_character_image(self.files[i], self.size)), "path": str(self.files[i])}


# ---------------------------------------------------------------------------------- base
class HanziDataModule(pl.LightningDataModule):
    """What both sources share: class list, loaders, the predict folder.

    Args:
        image_size: side of the square images the network sees.
        num_classes_limit: keep only the first N classes of :attr:`classes` (CPU runs, tests).
        cache_dir: where rendered/parsed images are cached (``~`` expanded).
        batch_size: images per batch.
        num_workers: DataLoader worker processes.
        predict_dir: folder of character images for ``predict`` (every file must be an image).
        skip_non_images: in ``predict_dir``, leave out files PIL cannot read (listed in a
            warning and in :attr:`skipped_files`) instead of stopping with an error.
    """

    def __init__(
        self,
        image_size: int = 64,
        num_classes_limit: int | None = None,
        cache_dir: str = DEFAULT_CACHE_DIR,
        batch_size: int = 128,
        num_workers: int = 0,
        predict_dir: str | None = None,
        skip_non_images: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
            raise ValueError(f"{name} needs image_size to be an integer >= 16, got {image_size!r} (set data.init_args.image_size)")
        if num_classes_limit is not None and (not isinstance(num_classes_limit, int) or num_classes_limit < 2):
            raise ValueError(
                f"{name} needs num_classes_limit to be None or an integer >= 2, got {num_classes_limit!r} "
                f"(set data.init_args.num_classes_limit)"
            )
        if batch_size < 1 or num_workers < 0:
            raise ValueError(
                f"{name} needs batch_size >= 1 and num_workers >= 0, got {batch_size} and {num_workers} "
                f"(set data.init_args.batch_size / num_workers)"
            )
        self.image_size = image_size
        self.num_classes_limit = num_classes_limit
        self.cache_dir = Path(cache_dir).expanduser()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.predict_dir = predict_dir
        self.skip_non_images = skip_non_images
        self.skipped_files: list[str] = []
        self.datasets: dict[str, Dataset] = {}

    # ---------------------------------------------------------------- classes
    @property
    def classes(self) -> list[str]:
        """Class id -> character, in the documented order (module docstring)."""
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def class_names(self) -> list[str]:
        """The characters, for reports that list classes (SparsityTracker, analyze experts)."""
        return self.classes

    def class_lookup(self) -> dict[int, int]:
        """Code point -> class id."""
        return {ord(ch): i for i, ch in enumerate(self.classes)}

    def state_for_checkpoint(self) -> dict[str, Any]:
        """Saved in checkpoints by HeadTask so tools can map class ids back to characters."""
        return {"classes": list(self.classes)}

    # ---------------------------------------------------------------- predict
    def predict_files(self) -> list[Path]:
        """The images under ``predict_dir``; non-image files raise or are skipped and reported."""
        if self.predict_dir is None:
            raise ValueError(
                f"{type(self).__name__} has no predict_dir; set data.init_args.predict_dir to a folder of character images"
            )
        root = Path(self.predict_dir).expanduser()
        if not root.is_dir():
            raise ValueError(f"predict_dir {root} is not a directory (set data.init_args.predict_dir)")
        files = [p for p in sorted(root.rglob("*")) if p.is_file()]
        bad = [p for p in files if not is_image_file(p)]
        if bad and not self.skip_non_images:
            raise ValueError(
                f"predict_dir {root} holds {len(bad)} file(s) that are not images, e.g. {bad[0].name}; "
                f"remove them or set data.init_args.skip_non_images=true to skip them"
            )
        if bad:
            self.skipped_files = [str(p) for p in bad]
            rank_zero_warn(f"predict: skipped {len(bad)} non-image file(s) in {root}: " + ", ".join(p.name for p in bad))
        images = [p for p in files if p not in set(bad)]
        if not images:
            raise ValueError(f"predict_dir {root} holds no image files (put .png/.jpg character images there)")
        return images

    # ---------------------------------------------------------------- loaders
    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        if split not in self.datasets:
            raise ValueError(f"{type(self).__name__} has no {split} split set up; call setup() for that stage first")
        args = {"batch_size": self.batch_size, "num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        rank, world_size = rank_and_world(self)
        if shuffle:  # the same global batches on any number of processes (datamodules/hierarchy.py)
            return DataLoader(self.datasets[split], sampler=training_sampler(self.datasets[split], rank, world_size), **args)
        if split == "predict":  # Lightning's predict sampler shards without repeats and tracks indices
            return DataLoader(self.datasets[split], **args)
        # Under DDP every image is scored by exactly one rank (no padding duplicates).
        return evaluation_loader(self.datasets[split], rank, world_size, ignored_target, **args)

    def setup(self, stage: str | None = None) -> None:
        if stage == "predict":
            self.datasets["predict"] = ImageFolder(self.predict_files(), self.image_size)
        else:
            self.setup_splits()

    def setup_splits(self) -> None:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        # Resumes mid-epoch from a checkpoint (datamodules/resumable.py).
        from datamodules.resumable import as_resumable

        return as_resumable(self._loader("train", shuffle=True))

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")


def _select(cache: ImageCache, lookup: dict[int, int]) -> CachedCharacters:
    targets = np.array([lookup.get(int(c), -1) for c in cache.codes], dtype=np.int64)
    rows = np.flatnonzero(targets >= 0)
    return CachedCharacters(cache, rows, targets[rows])


# ---------------------------------------------------------------------------------- fonts
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
            with multiprocessing.get_context("fork").Pool(self.render_workers) as pool:
                return write_cache(directory, self.image_size, pool.imap(_render_task, tasks), meta)
        return write_cache(directory, self.image_size, map(_render_task, tasks), meta)

    def prepare_data(self) -> None:
        for split in ("train", "val", "test"):
            self.build_split(split)

    def setup_splits(self) -> None:
        lookup = self.class_lookup()
        for split in ("train", "val", "test"):
            self.datasets[split] = _select(self.build_split(split), lookup)


# ---------------------------------------------------------------------------------- CASIA
def gnt_files(directory: str | Path) -> list[Path]:
    """The ``.gnt`` files under ``directory`` (sorted, recursive)."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"CASIA-HWDB directory {root} does not exist (set data.init_args.train_dir / test_dir)")
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() == ".gnt")
    if not files:
        raise ValueError(f"no .gnt files under {root}; unpack HWDB1.0/1.1 (e.g. Gnt1.1TrainPart1.zip) there")
    for path in files:  # refused here, before the split into training and validation writers
        if path.stat().st_size == 0:
            raise empty_gnt_error(path)
    return files


def tag_code(tag: bytes) -> int:
    """A 2-byte tag as one integer in GB order (high byte first); the cache stores these."""
    return (tag[0] << 8) | tag[1]


def tag_character(code: int) -> str:
    """Readable form of a tag code: the GB18030 character, else its hex value."""
    tag = bytes([code >> 8, code & 0xFF])
    try:
        text = tag.decode("gb18030")
        if len(text) == 1:
            return text
    except UnicodeDecodeError:
        pass
    return f"0x{code:04X}"


def _parse_gnt(files: Sequence[Path], size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for path in files:
        images, codes = [], []
        for sample in iter_gnt(path):
            images.append(fit_to_square(sample.pixels, size))
            codes.append(tag_code(sample.tag))
        if images:
            yield np.stack(images), np.array(codes, dtype=np.int64)


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
                # Only headers are read: listing the tags of HWDB1.1 takes seconds, not a parse.
                found = {tag_code(s.tag) for p in gnt_files(self.train_dir) for s in iter_gnt(p, headers_only=True)}
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
            return {tag_code(ch.encode("gb2312")): i for i, ch in enumerate(self.classes)}
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
        counts = [sum(1 for _ in iter_gnt(path, headers_only=True)) for path in files]
        meta = {"source": "gnt", "files": [str(p) for p in files], "file_counts": counts}
        return write_cache(directory, self.image_size, _parse_gnt(files, self.image_size), meta)

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
            allowed = {tag_code(ch.encode("gb2312")) for ch in gb2312_level1()}
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
