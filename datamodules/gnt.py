"""CASIA-HWDB ``.gnt`` files (offline isolated characters, HWDB1.0/1.1) and the square
framing shared by every Chinese-character source in this project.

A ``.gnt`` file is a plain concatenation of samples, each laid out as (little-endian)::

    uint32  sample_size      # bytes of this whole record, header included: 10 + width * height
    2 bytes tag_code         # the character in GB2312 (high byte first, as stored)
    uint16  width
    uint16  height
    uint8   pixels[height][width]   # row-major grey levels, background 255, ink darker

There is no file header and no sample count, so a reader can only walk the records and check
that each one is consistent; :func:`iter_gnt` does exactly that and names the file and the byte
offset of the first record that does not fit. Every reading of ``.gnt`` files in the
project goes through this module: listing the files of a folder, tags, record counts, framed
records.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from PIL import Image

#: uint32 sample size + 2-byte tag + uint16 width + uint16 height.
GNT_HEADER = struct.Struct("<I2sHH")


@dataclass(frozen=True)
class GntSample:
    """One record of a ``.gnt`` file: its byte offset, raw tag and ``(height, width)`` pixels."""

    offset: int
    tag: bytes
    pixels: np.ndarray

    @property
    def character(self) -> str | None:
        """The tag decoded as GB2312, or None when it is not a GB2312 character."""
        return decode_tag(self.tag)


def decode_tag(tag: bytes) -> str | None:
    """Decode a 2-byte ``.gnt`` tag as one GB2312 character (None if it is not one)."""
    try:
        text = tag.decode("gb2312")
    except UnicodeDecodeError:
        return None
    return text if len(text) == 1 else None


def encode_tag(character: str) -> bytes:
    """The 2-byte GB2312 tag a ``.gnt`` file stores for ``character``."""
    tag = character.encode("gb2312")
    if len(tag) != 2:
        raise ValueError(
            f".gnt tags are 2-byte GB2312 codes, got {character!r} which encodes to {len(tag)} byte(s)"
        )
    return tag


def empty_gnt_error(path: Path) -> ValueError:
    """The one-line refusal of a 0-byte ``.gnt`` file.

    An empty file is not "a writer with no samples": it is a failed copy or extraction, and
    accepting it would silently give a training or validation-writer slot to nobody.
    """
    return ValueError(
        f"{path} is empty (0 bytes): a .gnt file holds at least one character record; "
        f"re-copy it from the archive or remove it from the folder"
    )


def iter_gnt(path: str | Path, headers_only: bool = False) -> Iterator[GntSample]:
    """Walk the records of one ``.gnt`` file.

    Args:
        path: the file.
        headers_only: seek over the pixels instead of reading them (``pixels`` is then an
            empty ``(0, 0)`` array); lists the labels of a large file cheaply.

    Raises:
        ValueError: on a truncated or inconsistent record, naming the file and byte offset.
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise empty_gnt_error(path)
    with path.open("rb") as handle:
        offset = 0
        while offset < size:
            header = handle.read(GNT_HEADER.size)
            if len(header) < GNT_HEADER.size:
                raise ValueError(
                    f"{path}: truncated .gnt record header at byte offset {offset} ({len(header)} of "
                    f"{GNT_HEADER.size} bytes left); the file is cut short, re-copy it from the archive"
                )
            sample_size, tag, width, height = GNT_HEADER.unpack(header)
            if width == 0 or height == 0:
                raise ValueError(
                    f"{path}: corrupt .gnt record at byte offset {offset}: width {width} x height {height} "
                    f"is an empty image (a record needs width >= 1 and height >= 1); the file is damaged "
                    f"or not a CASIA-HWDB .gnt file"
                )
            expected = GNT_HEADER.size + width * height
            if sample_size != expected:
                raise ValueError(
                    f"{path}: corrupt .gnt record at byte offset {offset}: sample size {sample_size} "
                    f"but width {width} x height {height} needs {expected}; the file is damaged or "
                    f"not a CASIA-HWDB .gnt file"
                )
            if offset + sample_size > size:
                raise ValueError(
                    f"{path}: truncated .gnt record at byte offset {offset}: needs {sample_size} bytes, "
                    f"only {size - offset} left; the file is cut short, re-copy it from the archive"
                )
            if headers_only:
                handle.seek(width * height, 1)
                pixels = np.zeros((0, 0), dtype=np.uint8)
            else:
                # (height * width,) -> (height, width): rows are stored top to bottom.
                pixels = np.frombuffer(handle.read(width * height), dtype=np.uint8).reshape(height, width)
            yield GntSample(offset=offset, tag=tag, pixels=pixels)
            offset += sample_size


def write_gnt(path: str | Path, samples: Iterable[tuple[str | bytes, np.ndarray]]) -> int:
    """Write ``(character or raw tag, (height, width) uint8 pixels)`` pairs as a ``.gnt`` file.

    Returns the number of records written. Used to build test fixtures and to export
    rendered characters in the CASIA format.
    """
    count = 0
    with Path(path).open("wb") as handle:
        for label, pixels in samples:
            tag = label if isinstance(label, bytes) else encode_tag(label)
            pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
            if pixels.ndim != 2 or len(tag) != 2:
                raise ValueError(
                    f"write_gnt needs a 2-byte tag and 2-D pixels, got tag {tag!r} and shape {pixels.shape}"
                )
            height, width = pixels.shape
            handle.write(GNT_HEADER.pack(GNT_HEADER.size + width * height, tag, width, height))
            handle.write(pixels.tobytes())
            count += 1
    return count


def gnt_files(directory: str | Path) -> list[Path]:
    """The ``.gnt`` files under ``directory`` (sorted, recursive); a missing directory, one without
    ``.gnt`` files or an empty file among them is one ``ValueError`` naming it."""
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
    """A 2-byte tag as one integer in GB order (high byte first); caches store these."""
    return (tag[0] << 8) | tag[1]


def character_code(character: str) -> int:
    """The tag code of ``character`` (its GB2312 bytes as one integer)."""
    return tag_code(encode_tag(character))


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


def tag_codes(files: Iterable[Path]) -> set[int]:
    """The distinct tag codes of ``files``; only record headers are read (listing the tags of
    HWDB1.1 takes seconds, not a parse)."""
    return {tag_code(sample.tag) for path in files for sample in iter_gnt(path, headers_only=True)}


def record_counts(files: Iterable[Path]) -> list[int]:
    """Records per file (one file = one writer in HWDB), from the headers only."""
    return [sum(1 for _ in iter_gnt(path, headers_only=True)) for path in files]


def framed_records(files: Iterable[Path], size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per file with records: ``(images (n, size, size) uint8, tag codes (n,))``, every record
    framed by :func:`fit_to_square`."""
    for path in files:
        images, codes = [], []
        for sample in iter_gnt(path):
            images.append(fit_to_square(sample.pixels, size))
            codes.append(tag_code(sample.tag))
        if images:
            yield np.stack(images), np.array(codes, dtype=np.int64)


def ink_bbox(pixels: np.ndarray, threshold: int = 200) -> tuple[int, int, int, int] | None:
    """``(top, left, bottom, right)`` (exclusive ends) of pixels darker than ``threshold``."""
    ink = pixels < threshold
    rows = np.flatnonzero(ink.any(axis=1))
    if rows.size == 0:
        return None
    cols = np.flatnonzero(ink.any(axis=0))
    return int(rows[0]), int(cols[0]), int(rows[-1]) + 1, int(cols[-1]) + 1


def fit_to_square(pixels: np.ndarray, size: int, margin: float = 0.0625) -> np.ndarray:
    """Frame a character: crop to its ink, scale the longer side to ``size * (1 - 2 margin)``
    preserving the aspect ratio, and centre it on a white ``size x size`` square.

    Every source (CASIA records, rendered fonts, images given to ``predict``) goes through this
    one function with this one policy, so that train and inference framing agree: a bitmap
    framed from a ``.gnt`` record and the same bitmap saved as an image file and given to
    ``predict`` reach the network as the same tensor. The white border a record or an image
    file carries around the ink is therefore dropped before scaling. It follows the usual HWDB
    preprocessing (aspect-preserving normalisation into a fixed box with a white border).

    Shape:
        pixels: ``(height, width)`` uint8, background 255. Returns ``(size, size)`` uint8.
    """
    box = ink_bbox(pixels)
    if box is not None:  # no ink at all (a blank record): frame the whole bitmap
        top, left, bottom, right = box
        pixels = pixels[top:bottom, left:right]
    height, width = pixels.shape
    inner = max(1, int(round(size * (1.0 - 2.0 * margin))))
    scale = inner / max(height, width)
    new_h = max(1, int(round(height * scale)))
    new_w = max(1, int(round(width * scale)))
    glyph = Image.fromarray(np.ascontiguousarray(pixels)).resize((new_w, new_h), Image.BILINEAR)
    canvas = Image.new("L", (size, size), 255)
    canvas.paste(glyph, ((size - new_w) // 2, (size - new_h) // 2))
    return np.asarray(canvas, dtype=np.uint8)
