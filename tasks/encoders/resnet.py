"""The image encoder of the captioning task: a torchvision ResNet's convolutional trunk, and a
disk cache of a frozen trunk's features.

The task takes it as ``model.init_args.encoder`` (``class_path: tasks.encoders.ResNetEncoder``);
its ``out_channels`` sizes the decoder.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os

import torch
import torchvision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from datamodules.files import atomic_path, read_cache

ARCHITECTURES = ("resnet18", "resnet50", "resnet101")


def build_resnet(arch: str, weights: str | None) -> nn.Module:
    """A torchvision ResNet, with ImageNet ``weights`` (an enum name such as ``DEFAULT`` or
    ``IMAGENET1K_V1``) when they can be loaded (local torch hub cache or download), random
    initialisation otherwise. Prints one notice line either way."""
    if weights in ("null", "None"):
        # A null given on the command line for this nested argument (model.init_args.encoder.init_args.weights)
        # reaches the constructor as text; no torchvision weights enum has these names.
        weights = None
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown encoder {arch!r}: valid are {', '.join(ARCHITECTURES)} (set model.init_args.encoder.init_args.arch)")
    network = torchvision.models.get_model(arch, weights=None)
    if weights is None:
        rank_zero_info(f"{arch}: random initialisation (model.init_args.encoder.init_args.weights is null)")
        return network
    available = torchvision.models.get_model_weights(arch)
    try:
        weight_enum = available[weights] if weights != "DEFAULT" else available.DEFAULT
    except KeyError:
        names = ", ".join(["DEFAULT"] + [w.name for w in available])
        raise ValueError(f"unknown weights {weights!r} for {arch}: valid are {names}, or null for random init (set model.init_args.encoder.init_args.weights)") from None
    try:
        # torch.hub reports its download on stderr; the one notice below says what happened.
        with contextlib.redirect_stderr(io.StringIO()):
            state = weight_enum.get_state_dict(progress=False, check_hash=False)
        network.load_state_dict(state)
    except Exception as error:  # no network, a corrupt cache file, ...: all mean "train from scratch"
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        rank_zero_warn(f"{arch}: could not load {weight_enum} ({type(error).__name__}: {reason}); using random initialisation")
        return network
    rank_zero_info(f"{arch}: loaded ImageNet weights {weight_enum}")
    return network


class ResNetEncoder(nn.Module):
    """The convolutional trunk of a ResNet (classifier and global pool removed).

    Args:
        arch: ``resnet18``, ``resnet50`` or ``resnet101``.
        weights: torchvision weights name, or ``None`` for random initialisation.
        trainable: fine-tune the trunk; when ``False`` its parameters are frozen and its
            batch-norm statistics stay fixed (eval mode) during training.
    """

    #: ``weights`` downloads pretrained weights: the command line's choice, never a checkpoint's
    #: (whose own weights replace them anyway; :mod:`app.checkpoint_io.policy`).
    runtime_options = ("weights",)

    def __init__(self, arch: str = "resnet18", weights: str | None = None, trainable: bool = True) -> None:
        super().__init__()
        network = build_resnet(arch, weights)
        self.arch = arch
        self.trunk = nn.Sequential(
            network.conv1, network.bn1, network.relu, network.maxpool,
            network.layer1, network.layer2, network.layer3, network.layer4,
        )
        self.out_channels: int = network.fc.in_features
        self.trainable = trainable
        if not trainable:
            self.trunk.requires_grad_(False)
            # Lightning 2 does not call .train() on the model when fitting starts: a frozen trunk
            # must *start* in eval mode, or its batch norm keeps updating its running statistics
            # (and normalises with each batch's own, which differs between DDP ranks).
            self.trunk.eval()

    def train(self, mode: bool = True) -> "ResNetEncoder":
        super().train(mode and self.trainable)
        return self

    def forward(self, images: Tensor) -> Tensor:
        """Annotation vectors on the spatial grid.

        Shape:
            images ``(B, 3, H, W)`` -> ``(B, P, C)`` with ``P = ceil(H/32) * ceil(W/32)``.
        """
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            grid = self.trunk(images)  # (B, C, h, w)
        return grid.flatten(2).transpose(1, 2)  # (B, h*w, C)


class FeatureCache:
    """Annotation vectors of a *frozen* encoder on disk, one float16 file per image id, so
    later epochs skip the CNN (the decoder then trains at its own speed).

    Files live in ``root/<arch>-<digest of the encoder's weights>-<H>x<W>/<image_id>.pt``:
    a different encoder, different weights (another random init, another ImageNet file) or
    another image size never reads stale features.
    """

    def __init__(self, root: str, arch: str) -> None:
        self.root, self.arch = root, arch
        self._weights_digest: str | None = None

    def directory(self, encoder: nn.Module, images: Tensor) -> str:
        if self._weights_digest is None:
            digest = hashlib.sha256()
            for name, tensor in sorted(encoder.state_dict().items()):
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            self._weights_digest = digest.hexdigest()[:16]
        H, W = images.shape[-2:]
        return os.path.join(self.root, f"{self.arch}-{self._weights_digest}-{H}x{W}")

    def __call__(self, encoder: nn.Module, images: Tensor, image_ids: Tensor) -> Tensor:
        """Shape: images ``(B, 3, H, W)``, image_ids ``(B,)`` -> ``(B, P, C)``."""
        directory = self.directory(encoder, images)
        paths = [os.path.join(directory, f"{int(i)}.pt") for i in image_ids.tolist()]
        if all(os.path.exists(path) for path in paths):
            cached = [read_cache(path, "cached image features") for path in paths]
            if all(isinstance(t, Tensor) and t.dtype == torch.float16 and t.shape == cached[0].shape for t in cached):
                return torch.stack(cached).to(images.device).float()
            # a damaged or foreign file: computed again and rewritten below
        with torch.no_grad():
            annotations = encoder(images)  # (B, P, C)
        for path, features in zip(paths, annotations.half().cpu()):
            with atomic_path(path, "cached image features") as partial:  # DDP ranks and workers never read half a file
                torch.save(features.clone(), partial)
        return annotations.half().float()  # the precision later epochs will read back
