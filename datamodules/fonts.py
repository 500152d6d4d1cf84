"""The GB2312 level-1 character set, CJK font discovery, and handwriting-like rendering.

Each font face acts as one "writer"; a per-sample seed drives the distortions that make a
printed glyph look handwritten (random affine, elastic deformation, stroke width, noise), so a
writer seed always gives the same image and held-out seeds give unseen "handwriting".
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont
from scipy import ndimage

from datamodules.gnt import fit_to_square

#: PyPI distributions that ship OFL CJK fonts (distribution -> import package).
FONT_PACKAGES: dict[str, str] = {
    "pylopdf-fonts-zh-cn": "pylopdf_fonts_zh_cn",  # Noto Sans SC, Noto Serif SC
    "paperang-p2-fonts-cjk": "paperang_p2_fonts_cjk",  # WenQuanYi Micro Hei
}
SYSTEM_FONT_DIRS: tuple[str, ...] = (
    "/usr/share/fonts",
    "/usr/local/share/fonts",
    "~/.fonts",
    "~/.local/share/fonts",
)
FONT_SUFFIXES = (".ttf", ".otf", ".ttc", ".otc")


def gb2312_level1() -> list[str]:
    """The 3,755 GB2312 level-1 characters in GB2312 code order.

    Level 1 is rows 16-55 of GB2312 (bytes 0xB0A1-0xD7F9): 94 cells per row except row 55,
    which holds 89. GB2312 orders level 1 by pinyin, so this order is also alphabetical by
    reading. The set is produced by decoding every cell with Python's ``gb2312`` codec.
    """
    characters = []
    for row in range(16, 56):
        for cell in range(1, 95):
            # Row/cell -> EUC-CN bytes: both offset by 0xA0.
            try:
                characters.append(bytes([0xA0 + row, 0xA0 + cell]).decode("gb2312"))
            except UnicodeDecodeError:
                continue  # the five unassigned cells at the end of row 55
    return characters


@dataclass(frozen=True)
class FontFace:
    """One face of a font file (``index`` selects the face inside a .ttc/.otc collection)."""

    path: str
    index: int
    name: str


def _font_files(directories: Sequence[str | Path]) -> list[Path]:
    files: list[Path] = []
    for directory in directories:
        root = Path(directory).expanduser()
        if root.is_dir():
            files.extend(p for p in sorted(root.rglob("*")) if p.suffix.lower() in FONT_SUFFIXES)
    return files


def package_font_dirs() -> list[Path]:
    """Install locations of the :data:`FONT_PACKAGES` that are installed."""
    dirs = []
    for module in FONT_PACKAGES.values():
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(Path(p) for p in spec.submodule_search_locations)
    return dirs


def _faces_covering(path: Path, characters: Sequence[str]) -> list[FontFace]:
    """Faces of ``path`` whose character map holds every one of ``characters``."""
    from fontTools.ttLib import TTCollection, TTFont

    try:
        if path.suffix.lower() in (".ttc", ".otc"):
            fonts = list(TTCollection(str(path), lazy=True).fonts)
        else:
            fonts = [TTFont(str(path), lazy=True)]
    except Exception:  # not a font fontTools can read: not a candidate
        return []
    faces = []
    for index, font in enumerate(fonts):
        cmap = font.getBestCmap() or {}
        if all(ord(ch) in cmap for ch in characters):
            name = font["name"].getDebugName(4) or f"{path.stem}#{index}"
            faces.append(FontFace(str(path), index, name))
    return faces


def _face_fingerprint(face: FontFace) -> str:
    """Hash of a few rendered glyphs: faces that draw Chinese identically (WenQuanYi Micro Hei
    and its Mono face) are one writer, not two."""
    font = ImageFont.truetype(face.path, 48, index=face.index)
    digest = hashlib.sha1()
    for ch in "永国字书写":
        digest.update(render_clean(font, ch, 64).tobytes())
    return digest.hexdigest()


def find_cjk_fonts(
    font_paths: Sequence[str] | None = None, characters: Sequence[str] | None = None
) -> list[FontFace]:
    """CJK faces covering ``characters`` (default: GB2312 level 1), one per distinct design.

    Searched in order: ``font_paths`` if given (files or directories), else the installed
    :data:`FONT_PACKAGES` and then :data:`SYSTEM_FONT_DIRS`.

    Raises:
        ValueError: no face covers the characters, naming the packages that provide one.
    """
    characters = list(characters) if characters is not None else gb2312_level1()
    if font_paths:
        files = [Path(p).expanduser() for p in font_paths if Path(p).expanduser().is_file()]
        files += _font_files([p for p in font_paths if Path(p).expanduser().is_dir()])
        searched = ", ".join(str(p) for p in font_paths)
    else:
        dirs = package_font_dirs() + [Path(d) for d in SYSTEM_FONT_DIRS]
        files = _font_files(dirs)
        searched = "the packages " + ", ".join(FONT_PACKAGES) + " and " + ", ".join(SYSTEM_FONT_DIRS)
    faces, seen = [], set()
    for path in files:
        for face in _faces_covering(path, characters):
            fingerprint = _face_fingerprint(face)
            if fingerprint not in seen:
                seen.add(fingerprint)
                faces.append(face)
    if not faces:
        raise ValueError(
            f"no CJK font covering the {len(characters)} requested GB2312 characters was found in "
            f"{searched}; install one with `pip install {' '.join(FONT_PACKAGES)}` "
            f"(or set data.init_args.font_paths to .ttf/.otf/.ttc files)"
        )
    return faces


def render_clean(font: ImageFont.FreeTypeFont, character: str, canvas: int) -> np.ndarray:
    """Draw ``character`` black on white, untouched, on a ``canvas x canvas`` square.

    Shape: returns ``(canvas, canvas)`` uint8, background 255.
    """
    image = Image.new("L", (canvas, canvas), 255)
    ImageDraw.Draw(image).text((canvas / 2, canvas / 2), character, font=font, fill=0, anchor="mm")
    return np.asarray(image, dtype=np.uint8)


@dataclass(frozen=True)
class Distortion:
    """How far a rendered glyph is pushed towards handwriting; every field is a maximum and
    each sample draws its own value uniformly (or by the stated rule) from its seed.

    Args:
        enabled: False renders clean glyphs (fonts only differ by design).
        rotation: degrees, +-.
        shear: horizontal shear factor, +-.
        aspect: relative change of width vs height, +- (the fit-to-square framing removes the
            overall scale and shift, as it does for CASIA samples and ``predict`` images).
        elastic_amplitude: std of the elastic displacement as a fraction of the image side
            (Simard et al. 2003, Sec. 2: a random field smoothed by a Gaussian).
        elastic_smoothness: std of that Gaussian as a fraction of the image side.
        stroke_probability: chance of thinning or thickening the strokes by a morphological
            erosion/dilation (grey max/min filter) at twice the output resolution.
        ink_variation: the ink grey level is drawn from [0, 255 * ink_variation].
        noise_std: std of additive Gaussian pixel noise, as a fraction of 255, drawn per sample
            from [0, noise_std].
    """

    enabled: bool = True
    rotation: float = 12.0
    shear: float = 0.3
    aspect: float = 0.2
    elastic_amplitude: float = 0.012
    elastic_smoothness: float = 0.06
    stroke_probability: float = 0.6
    ink_variation: float = 0.35
    noise_std: float = 0.08

    def __post_init__(self) -> None:
        for key, value in asdict(self).items():
            if key != "enabled" and (not isinstance(value, (int, float)) or value < 0):
                raise ValueError(
                    f"Distortion needs {key} >= 0, got {value!r} (set data.init_args.distortion.{key})"
                )
        if self.stroke_probability > 1 or self.ink_variation > 1:
            raise ValueError(
                f"Distortion needs stroke_probability and ink_variation in [0, 1], got "
                f"{self.stroke_probability} and {self.ink_variation} (set data.init_args.distortion)"
            )


@lru_cache(maxsize=16)
def load_face(path: str, index: int, points: int) -> ImageFont.FreeTypeFont:
    """Open a face once per process (rendering calls this for every sample)."""
    return ImageFont.truetype(path, points, index=index)


def _random_affine(image: Image.Image, rng: np.random.Generator, distortion: Distortion) -> Image.Image:
    side = image.size[0]
    theta = np.deg2rad(rng.uniform(-distortion.rotation, distortion.rotation))
    shear = rng.uniform(-distortion.shear, distortion.shear)
    stretch = 1.0 + rng.uniform(-distortion.aspect, distortion.aspect)
    # Forward map about the centre: p_out = R(theta) Sh(shear) diag(stretch, 1) (p_in - c) + c.
    rotate = np.array([[np.cos(theta), -np.sin(theta)], [np.sin(theta), np.cos(theta)]])
    forward = rotate @ np.array([[1.0, shear], [0.0, 1.0]]) @ np.diag([stretch, 1.0])
    # PIL wants the inverse map (output pixel -> input pixel).
    inverse = np.linalg.inv(forward)
    centre = np.array([side / 2, side / 2])
    offset = centre - inverse @ centre
    coeffs = (inverse[0, 0], inverse[0, 1], offset[0], inverse[1, 0], inverse[1, 1], offset[1])
    return image.transform(image.size, Image.AFFINE, coeffs, resample=Image.BILINEAR, fillcolor=255)


def _elastic(pixels: np.ndarray, rng: np.random.Generator, distortion: Distortion) -> np.ndarray:
    side = pixels.shape[0]
    sigma = max(distortion.elastic_smoothness * side, 1.0)
    coords = np.mgrid[0:side, 0:side].astype(np.float32)  # (2, side, side): row, column
    for axis in range(2):
        field = ndimage.gaussian_filter(rng.uniform(-1.0, 1.0, (side, side)), sigma, mode="constant")
        # Normalise the smoothed field so the amplitude is a displacement in pixels,
        # independent of sigma (Simard et al. scale by a constant alpha instead).
        field *= distortion.elastic_amplitude * side / (field.std() + 1e-12)
        coords[axis] += field.astype(np.float32)
    return ndimage.map_coordinates(pixels.astype(np.float32), coords, order=1, cval=255.0)


def render_sample(
    face: FontFace, character: str, size: int, distortion: Distortion, seed: Sequence[int]
) -> np.ndarray:
    """Render one "handwritten" sample of ``character`` in ``face``, framed like CASIA.

    Work happens at twice the output resolution so that the stroke-width step (a 3x3 grey
    max/min filter) changes the stroke by a fraction of an output pixel, not a whole one.

    Args:
        seed: integers fully determining the distortion (the caller passes the writer seed,
            the face number and the character's code point, so a sample is the same whatever
            subset or worker renders it).

    Shape: returns ``(size, size)`` uint8, background 255, ink dark.
    """
    canvas = 2 * size
    font = load_face(face.path, face.index, int(canvas * 0.8))
    glyph = fit_to_square(render_clean(font, character, canvas), canvas, margin=0.15)
    if not distortion.enabled:
        return fit_to_square(glyph, size)
    rng = np.random.default_rng(list(seed))
    image = _random_affine(Image.fromarray(glyph), rng, distortion)
    if rng.random() < distortion.stroke_probability:
        # White background: MinFilter spreads ink (thicker), MaxFilter spreads paper (thinner).
        image = image.filter(ImageFilter.MinFilter(3) if rng.random() < 0.6 else ImageFilter.MaxFilter(3))
    pixels = _elastic(np.asarray(image), rng, distortion)
    pixels = fit_to_square(np.clip(pixels, 0, 255).astype(np.uint8), size)
    # Ink level and paper noise after framing so the noise cannot move the ink box.
    ink = rng.uniform(0.0, 255.0 * distortion.ink_variation)
    pixels = 255.0 - (255.0 - pixels.astype(np.float32)) * (255.0 - ink) / 255.0
    pixels += rng.normal(0.0, 255.0 * rng.uniform(0.0, distortion.noise_std), pixels.shape)
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def faces_summary(faces: Sequence[FontFace]) -> str:
    """``name (file)`` list for logs and errors."""
    return ", ".join(f"{f.name} ({os.path.basename(f.path)})" for f in faces)
