"""Synthetic two-level class hierarchy of DS-Softmax App. A (Eq. 7).

Super-class centres ``μ_s ~ N(0, σ_super² I)``; sub-class centres around them
``μ_(s,j) ~ N(μ_s, σ_sub² I)``; inputs around those ``x ~ N(μ_(s,j), σ_input² I)``. The default
draw (``draw="eq7"``) is Eq. 7 as printed: variances ``d³``, ``d²`` and ``d`` with the paper's
``d = 10`` (``eq7_d``), i.e. standard deviations 31.6, 10 and 3.16 (ratio 1 : 0.32 : 0.10).
``draw="std"`` takes the three standard deviations from ``sigma_super``, ``sigma_sub`` and
``sigma_input`` instead (default 1, 0.4, 0.4: inputs about 4x noisier relative to the sub-class
spread than Eq. 7, so the sub-classes of a super-class overlap). The label
is the sub-class ``c = s * num_sub + j``; the super-class is hidden from the model and kept in
:attr:`HierarchyDataModule.super_class_of` so analyses can check whether the experts
rediscover it (expert purity). Everything is generated from ``seed`` in ``setup``: no files.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from datamodules.base import HeadDataModule
from datamodules.resumable import training_loader
from datamodules.sharding import evaluation_loader, ignored_target, rank_and_world, training_sampler


DRAWS = ("eq7", "std")
DATA_PATH = "datamodules.hierarchy.HierarchyDataModule"


class HierarchyDataset(Dataset):
    """``{"input": (num_features,), "target": ()}`` samples from generated tensors."""

    def __init__(self, inputs: Tensor, targets: Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return self.targets.numel()

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input": self.inputs[index], "target": self.targets[index]}


def _check_int(value: int, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"HierarchyDataModule needs {key} to be an integer >= {minimum}, got {value!r} (set data.init_args.{key})")
    return value


class HierarchyDataModule(HeadDataModule):
    """Gaussian super-class / sub-class data (App. A, Eq. 7), e.g. 10x10 or 100x100.

    Besides the base contract it offers :class:`datamodules.base.FeatureInputs` (``num_features``)
    and :class:`datamodules.base.ClassHierarchy` (``super_class_of``).

    Args:
        num_super: number of super-classes.
        num_sub: sub-classes per super-class.
        num_features: input dimension.
        draw: ``"eq7"``: Eq. 7's variances ``d³, d², d`` (``d = eq7_d``); ``"std"``: the
            standard deviations ``sigma_super, sigma_sub, sigma_input``.
        eq7_d: Eq. 7's ``d`` (the paper: 10); used by ``draw="eq7"``.
        sigma_super / sigma_sub / sigma_input: standard deviations of the three levels with
            ``draw="std"`` (ignored by ``"eq7"``).
        train_per_class / val_per_class / test_per_class: samples per sub-class per split.
        batch_size: samples per batch per rank.
        seed: seed of the centres and samples.
        num_workers: DataLoader workers.
    """

    #: Where data is read, cached or fetched from and how it is loaded: the command line's
    #: choice, never a checkpoint's (:mod:`app.checkpoint_io.policy`).
    runtime_options: tuple[str, ...] = ("num_workers",)

    #: Classes are not frequency ordered (all equally frequent); ids follow the hierarchy.
    frequency_ordered: ClassVar[bool] = False

    def __init__(
        self,
        num_super: int = 10,
        num_sub: int = 10,
        num_features: int = 32,
        sigma_super: float = 1.0,
        sigma_sub: float = 0.4,
        sigma_input: float = 0.4,
        train_per_class: int = 50,
        val_per_class: int = 10,
        test_per_class: int = 10,
        batch_size: int = 128,
        seed: int = 0,
        num_workers: int = 0,
        draw: str = "eq7",
        eq7_d: float = 10.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if draw not in DRAWS:
            raise ValueError(f"HierarchyDataModule needs draw in {DRAWS}, got {draw!r} (set data.init_args.draw)")
        if not float(eq7_d) > 0:
            raise ValueError(f"HierarchyDataModule needs eq7_d > 0, got {eq7_d} (set data.init_args.eq7_d; the paper uses 10)")
        for key, minimum in (("num_super", 1), ("num_sub", 1), ("num_features", 1), ("train_per_class", 1),
                             ("val_per_class", 1), ("test_per_class", 1), ("batch_size", 1), ("num_workers", 0)):
            _check_int(getattr(self.hparams, key), key, minimum)
        if num_super * num_sub < 2:
            raise ValueError(f"HierarchyDataModule needs num_super * num_sub >= 2 classes, got {num_super}x{num_sub} (raise data.init_args.num_sub)")
        for key in ("sigma_super", "sigma_sub", "sigma_input"):
            if not float(getattr(self.hparams, key)) >= 0:
                raise ValueError(f"HierarchyDataModule needs {key} >= 0, got {getattr(self.hparams, key)} (set data.init_args.{key})")
        self.splits: dict[str, HierarchyDataset] = {}

    # ------------------------------------------------------------------ sizes
    @property
    def num_classes(self) -> int:
        return self.hparams.num_super * self.hparams.num_sub

    @property
    def num_features(self) -> int:
        """Input dimension (``num_features`` of the settings)."""
        return self.hparams.num_features

    @property
    def super_class_of(self) -> list[int]:
        """Ground-truth super-class of every class id (``c // num_sub``)."""
        return [c // self.hparams.num_sub for c in range(self.num_classes)]

    @property
    def class_names(self) -> list[str]:
        """``"s<super>.<sub>"`` names, so expert class lists show the hierarchy."""
        n = self.hparams.num_sub
        return [f"s{c // n}.{c % n}" for c in range(self.num_classes)]

    # ------------------------------------------------------------------ data
    def stds(self) -> tuple[float, float, float]:
        """Standard deviations of the super-class, sub-class and input draws."""
        h = self.hparams
        if h.draw == "eq7":
            d = float(h.eq7_d)
            return d**1.5, d, d**0.5  # variances d³, d², d (Eq. 7)
        return float(h.sigma_super), float(h.sigma_sub), float(h.sigma_input)

    def generate(self) -> dict[str, HierarchyDataset]:
        """Eq. 7 centres and the three splits, deterministic in ``seed``."""
        h = self.hparams
        generator = torch.Generator().manual_seed(h.seed)
        D = h.num_features
        sigma_super, sigma_sub, sigma_input = self.stds()
        super_centres = torch.randn(h.num_super, D, generator=generator) * sigma_super  # (S, D)
        sub_centres = super_centres.repeat_interleave(h.num_sub, 0)  # (S*J, D), class c = s*J + j
        sub_centres = sub_centres + torch.randn(self.num_classes, D, generator=generator) * sigma_sub
        splits = {}
        for split, per_class in (("train", h.train_per_class), ("val", h.val_per_class), ("test", h.test_per_class)):
            targets = torch.arange(self.num_classes).repeat(per_class)  # (N,)
            inputs = sub_centres[targets] + torch.randn(targets.numel(), D, generator=generator) * sigma_input
            splits[split] = HierarchyDataset(inputs, targets)
        return splits

    def setup(self, stage: str | None = None) -> None:
        if not self.splits:
            self.splits = self.generate()

    def state_dict(self) -> dict:
        """The draw, saved in checkpoints so a run restored from one scores the data it was trained on."""
        return {"draw": self.hparams.draw, "eq7_d": float(self.hparams.eq7_d)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the checkpoint's draw when it differs from the configured one (warned), so
        ``test`` / a resumed ``fit`` regenerate the data the model was trained on."""
        draw, eq7_d = state_dict.get("draw", self.hparams.draw), float(state_dict.get("eq7_d", self.hparams.eq7_d))
        if (draw, eq7_d) == (self.hparams.draw, float(self.hparams.eq7_d)):
            return
        if draw not in DRAWS:
            raise ValueError(f"checkpoint's HierarchyDataModule state has draw={draw!r}, not one of {DRAWS} (the checkpoint is corrupt)")
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"HierarchyDataModule: the checkpoint was trained on draw={draw!r} (eq7_d={eq7_d:g}) data, not the "
                       f"configured draw={self.hparams.draw!r}: using the checkpoint's (set data.init_args.draw to match to silence this)")
        self.hparams.draw, self.hparams.eq7_d = draw, eq7_d
        self.splits = {}

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        rank, world_size = rank_and_world(self)
        args = {"batch_size": self.hparams.batch_size, "num_workers": self.hparams.num_workers}
        if shuffle:  # resumes mid-epoch (datamodules/resumable.py)
            sampler = training_sampler(self.splits[split], rank, world_size)
            return training_loader(self.splits[split], sampler=sampler, **args)
        # Under DDP every sample is scored by exactly one rank (no padding duplicates).
        return evaluation_loader(self.splits[split], rank, world_size, ignored_target, **args)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        # Lightning's predict sampler already shards without repeats and tracks indices.
        self.setup()
        return DataLoader(self.splits["test"], batch_size=self.hparams.batch_size, num_workers=self.hparams.num_workers)
