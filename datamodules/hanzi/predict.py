"""Character images given to ``predict``: a folder of image files, framed like the training data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from datamodules.gnt import fit_to_square
from datamodules.hanzi.cache import to_input


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


def image_files(predict_dir: str | None, skip_non_images: bool, owner: str) -> tuple[list[Path], list[Path]]:
    """``(images, skipped)`` under ``predict_dir`` (sorted, recursive).

    A file PIL cannot read stops with one ``ValueError`` naming it, unless ``skip_non_images``
    (then it is listed in a warning and returned in ``skipped``). ``owner`` names the data module
    in the message about a missing ``predict_dir``.
    """
    if predict_dir is None:
        raise ValueError(f"{owner} has no predict_dir; set data.init_args.predict_dir to a folder of character images")
    root = Path(predict_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"predict_dir {root} is not a directory (set data.init_args.predict_dir)")
    files = [p for p in sorted(root.rglob("*")) if p.is_file()]
    bad = [p for p in files if not is_image_file(p)]
    if bad and not skip_non_images:
        raise ValueError(
            f"predict_dir {root} holds {len(bad)} file(s) that are not images, e.g. {bad[0].name}; "
            f"remove them or set data.init_args.skip_non_images=true to skip them"
        )
    if bad:
        rank_zero_warn(f"predict: skipped {len(bad)} non-image file(s) in {root}: " + ", ".join(p.name for p in bad))
    images = [p for p in files if p not in set(bad)]
    if not images:
        raise ValueError(f"predict_dir {root} holds no image files (put .png/.jpg character images there)")
    return images, bad


class ImageFolder(Dataset):
    """The image files of a folder (sorted, recursive) for ``predict``."""

    def __init__(self, files: Sequence[Path], size: int) -> None:
        self.files, self.size = list(files), size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input": to_input(load_character_image(self.files[i], self.size)), "path": str(self.files[i])}
