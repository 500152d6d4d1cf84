"""Synthetic scenes: generated pictures of coloured shapes with captions that describe them.

The embedded captioning data set (no download, runs anywhere). A scene holds one or two
*groups*; a group is ``count`` (1-3) identical shapes with a ``size`` (small, large), a
``colour`` (red, green, blue, yellow) and a ``shape`` (circle, square, triangle). With two
groups, the first sits ``above``, ``below``, ``to the left of`` or ``to the right of`` the
second: each group owns one half of the picture and lays its shapes out in a row (or a
column) of equal cells, each shape jittered inside its cell. Everything is drawn with PIL
from a random generator seeded by ``(seed, split, index)``, so a scene is the same on every
machine and every access, and no image is stored.

Captions are generated from the scene description with several templates ("two small red
circles above a large blue square", "a large blue square below two small red circles",
"there are ...", "a picture of ..."), so the references of one image vary in wording but
all state what is drawn. Learning them needs colour, shape, size, counting and the spatial
relation, which a small CNN learns on a CPU in minutes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw

from datamodules.captioning import CaptionDataModule, CaptionRecord

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 235),
    "yellow": (235, 215, 40),
}
SHAPES = ("circle", "square", "triangle")
#: Shape radius (centre to vertex or rim) as a fraction of the image side; a large shape
#: still fits a cell when three share half the picture (cell side = side / 3).
SIZES = {"small": 0.08, "large": 0.14}
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
#: Relation of the first group to the second and its converse (used by reversed templates).
RELATIONS = {"above": "below", "below": "above", "to the left of": "to the right of", "to the right of": "to the left of"}
COLOUR_JITTER = 20  # per-channel shade variation of each shape
SPLIT_IDS = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class Group:
    """``count`` identical shapes."""

    count: int
    size: str
    colour: str
    shape: str

    def phrase(self) -> str:
        """Noun phrase: ``two small red circles`` / ``a large blue square``."""
        noun = self.shape + ("s" if self.count > 1 else "")
        return f"{COUNT_WORDS[self.count]} {self.size} {self.colour} {noun}"

    def verb(self) -> str:
        return "are" if self.count > 1 else "is"


@dataclass(frozen=True)
class DrawnShape:
    """One drawn shape: its group (index into ``Scene.groups``), kind, colour and centre."""

    group: int
    shape: str
    colour: tuple[int, int, int]
    centre: tuple[float, float]  # (x, y) in pixels
    radius: float


@dataclass(frozen=True)
class Scene:
    """A scene description and the geometry it was drawn with."""

    groups: tuple[Group, ...]
    relation: str | None  # of groups[0] to groups[1]
    shapes: tuple[DrawnShape, ...]
    background: tuple[int, int, int]
    image_size: int

    def captions(self) -> list[str]:
        """Every reference caption template filled in for this scene."""
        a = self.groups[0]
        if self.relation is None:
            A = a.phrase()
            return [A, f"there {a.verb()} {A}", f"a picture of {A}", f"{A} on a dark background", f"only {A}"]
        b = self.groups[1]
        A, B, rel, converse = a.phrase(), b.phrase(), self.relation, RELATIONS[self.relation]
        return [
            f"{A} {rel} {B}",
            f"{B} {converse} {A}",
            f"there {a.verb()} {A} {rel} {B}",
            f"a picture of {A} {rel} {B}",
            f"{A} and {B}",
        ]

    def render(self) -> Image.Image:
        """Draw the scene (deterministic: all randomness was drawn when the scene was made)."""
        image = Image.new("RGB", (self.image_size, self.image_size), self.background)
        draw = ImageDraw.Draw(image)
        for item in self.shapes:
            x, y, r = item.centre[0], item.centre[1], item.radius
            if item.shape == "circle":
                draw.ellipse((x - r, y - r, x + r, y + r), fill=item.colour)
            elif item.shape == "square":
                half = r * 0.8  # a square of about the circle's area
                draw.rectangle((x - half, y - half, x + half, y + half), fill=item.colour)
            else:  # upright equilateral triangle inscribed in the circle of radius r
                draw.polygon([(x, y - r), (x - 0.866 * r, y + 0.5 * r), (x + 0.866 * r, y + 0.5 * r)], fill=item.colour)
        return image


def make_scene(rng: random.Random, image_size: int, two_group_probability: float = 0.7) -> Scene:
    """Draw a random scene description and lay it out on an ``image_size`` square."""
    S = float(image_size)
    num_groups = 2 if rng.random() < two_group_probability else 1
    groups = tuple(
        Group(rng.randint(1, 3), rng.choice(list(SIZES)), rng.choice(list(COLOURS)), rng.choice(SHAPES)) for _ in range(num_groups)
    )
    if num_groups == 1:
        relation, regions = None, [(0.0, 0.0, S, S)]
    else:
        relation = rng.choice(list(RELATIONS))
        top, bottom, left, right = (0.0, 0.0, S, S / 2), (0.0, S / 2, S, S / 2), (0.0, 0.0, S / 2, S), (S / 2, 0.0, S / 2, S)
        regions = {
            "above": [top, bottom],
            "below": [bottom, top],
            "to the left of": [left, right],
            "to the right of": [right, left],
        }[relation]
    shapes = []
    for g, (group, (x0, y0, w, h)) in enumerate(zip(groups, regions)):
        radius = SIZES[group.size] * S
        horizontal = w >= h  # a row in a wide region, a column in a tall one
        cell_w, cell_h = (w / group.count, h) if horizontal else (w, h / group.count)
        base = COLOURS[group.colour]
        for i in range(group.count):
            cx0 = x0 + (i * cell_w if horizontal else 0.0) + cell_w / 2
            cy0 = y0 + (0.0 if horizontal else i * cell_h) + cell_h / 2
            slack_x, slack_y = max(0.0, cell_w / 2 - radius - 1), max(0.0, cell_h / 2 - radius - 1)
            centre = (cx0 + rng.uniform(-slack_x, slack_x), cy0 + rng.uniform(-slack_y, slack_y))
            colour = tuple(min(255, max(0, c + rng.randint(-COLOUR_JITTER, COLOUR_JITTER))) for c in base)
            shapes.append(DrawnShape(g, group.shape, colour, centre, radius))  # type: ignore[arg-type]
    background = (rng.randint(0, 40),) * 3
    return Scene(groups, relation, tuple(shapes), background, image_size)  # type: ignore[arg-type]


def scene_at(seed: int, split: str, index: int, image_size: int) -> Scene:
    """The ``index``-th scene of ``split``: independent of every other scene and of order."""
    return make_scene(random.Random(f"scenes-{seed}-{SPLIT_IDS[split]}-{index}"), image_size)


class SyntheticScenes(CaptionDataModule):
    """Generated shapes-and-captions data (the embedded default for captioning).

    Args:
        num_train / num_val / num_test: images per split.
        seed: generator seed (scenes depend on ``seed``, split and index only).
        captions_per_scene: references per image (1-5 of the templates, in a per-scene
            random order).
        image_size: side of the square images.
        **kwargs: see :class:`datamodules.captioning.CaptionDataModule` (``count_threshold``
            defaults to 1 here: the vocabulary is tiny and closed).
    """

    def __init__(
        self,
        num_train: int = 4000,
        num_val: int = 500,
        num_test: int = 500,
        seed: int = 0,
        captions_per_scene: int = 5,
        image_size: int = 64,
        count_threshold: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_size=image_size, count_threshold=count_threshold, **kwargs)
        self.save_hyperparameters()
        for key, value in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SyntheticScenes needs {key} to be an integer >= 1, got {value!r} (set data.init_args.{key})")
        if not 1 <= captions_per_scene <= 5:
            raise ValueError(f"SyntheticScenes needs captions_per_scene in 1..5 (five templates), got {captions_per_scene} (set data.init_args.captions_per_scene)")
        self.sizes = {"train": num_train, "val": num_val, "test": num_test}
        self.seed = seed
        self.captions_per_scene = captions_per_scene

    def scene(self, split: str, index: int) -> Scene:
        return scene_at(self.seed, split, index, self.image_size)

    def load_records(self, split: str) -> list[CaptionRecord]:
        records = []
        for index in range(self.sizes[split]):
            scene = self.scene(split, index)
            captions = scene.captions()
            random.Random(f"captions-{self.seed}-{split}-{index}").shuffle(captions)
            # Image ids unique across splits, so a results file never mixes two images.
            image_id = SPLIT_IDS[split] * 10_000_000 + index
            records.append(CaptionRecord(image_id, scene, captions[: self.captions_per_scene], name=f"{split}/{index}"))
        return records

    def load_image(self, record: CaptionRecord) -> Image.Image:
        return record.source.render()
