"""What both Chinese-character sources share: the class list, the loaders, the predict folder.

Batches are ``{"input": (B, 1, size, size) float in [0, 1] with ink = 1, "target": (B,) class
ids}``; ``predict`` batches carry ``"path"`` instead of ``"target"``.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import DataLoader, Dataset

from datamodules.base import HeadDataModule
from datamodules.hanzi.cache import DEFAULT_CACHE_DIR
from datamodules.hanzi.predict import ImageFolder, image_files
from datamodules.resumable import training_loader
from datamodules.sharding import evaluation_loader, ignored_target, rank_and_world, training_sampler


class HanziDataModule(HeadDataModule):
    """What both sources share: class list, loaders, the predict folder; a source provides
    :attr:`classes` and :meth:`setup_splits`.

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

    #: Where data is read, cached or fetched from and how it is loaded: the command line's
    #: choice, never a checkpoint's (:mod:`app.checkpoint_io.policy`).
    runtime_options: tuple[str, ...] = ("cache_dir", "num_workers", "predict_dir")

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
        """Class id -> character, in the documented order (the source's module docstring)."""
        raise NotImplementedError

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def class_names(self) -> list[str]:
        """The characters in id order (:attr:`classes`)."""
        return list(self.classes)

    def class_lookup(self) -> dict[int, int]:
        """Code point -> class id."""
        return {ord(ch): i for i, ch in enumerate(self.classes)}

    # ---------------------------------------------------------------- predict
    def predict_files(self) -> list[Path]:
        """The images under ``predict_dir``; non-image files raise or are skipped and reported."""
        images, skipped = image_files(self.predict_dir, self.skip_non_images, type(self).__name__)
        if skipped:
            self.skipped_files = [str(p) for p in skipped]
        return images

    # ---------------------------------------------------------------- loaders
    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        if split not in self.datasets:
            raise ValueError(f"{type(self).__name__} has no {split} split set up; call setup() for that stage first")
        args = {"batch_size": self.batch_size, "num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        rank, world_size = rank_and_world(self)
        if shuffle:  # the same global batches on any number of processes; resumes mid-epoch (datamodules/resumable.py)
            return training_loader(self.datasets[split], sampler=training_sampler(self.datasets[split], rank, world_size), **args)
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
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("predict")
