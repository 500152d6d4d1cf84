"""CNN encoders for 64x64 grayscale character images (the hanzi task), giving the
``(B, out_features)`` hidden state a classification head needs."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut (He et al. 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        """Shape: ``(B, C_in, H, W)`` -> ``(B, C_out, H / stride, W / stride)``."""
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class HanziCNN(nn.Module):
    """A small ResNet-style encoder for grayscale characters.

    A 3x3 stem, then one :class:`BasicBlock` stage per entry of ``channels`` (each after the
    first halves the resolution), global average pooling and a linear projection to
    ``out_features`` with dropout. The default (32, 64, 128, 256) on 64x64 inputs ends at 8x8.
    The projection is linear: a ReLU after it can drive every output negative for every input
    early in training, after which the hidden state is 0, no gradient reaches the network and the
    loss stays at ln(num_classes) (docs/hanzi.md). ``stem_stride=2`` lets the stem see the
    full-resolution image but start the stages at half resolution: about 4x fewer FLOPs, ending
    at 4x4 on 64x64 inputs.

    Args:
        out_features: size of the hidden state handed to the head.
        channels: channels of the stages.
        blocks_per_stage: residual blocks per stage.
        in_channels: image channels (1 for grayscale).
        dropout: dropout before the projection.
        stem_stride: stride of the stem convolution (1 or 2).
    """

    def __init__(
        self,
        out_features: int = 256,
        channels: Sequence[int] = (32, 64, 128, 256),
        blocks_per_stage: int = 1,
        in_channels: int = 1,
        dropout: float = 0.1,
        stem_stride: int = 1,
    ) -> None:
        super().__init__()
        channels = [int(c) for c in channels]
        if not channels or min(channels) < 1 or out_features < 1 or blocks_per_stage < 1:
            raise ValueError(
                f"HanziCNN needs non-empty positive channels, out_features >= 1 and blocks_per_stage >= 1, got "
                f"{channels}, {out_features}, {blocks_per_stage} (set model.init_args.encoder.init_args)"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"HanziCNN needs dropout in [0, 1), got {dropout} (set model.init_args.encoder.init_args.dropout)")
        if stem_stride not in (1, 2):
            raise ValueError(
                f"HanziCNN needs stem_stride 1 or 2, got {stem_stride} (set model.init_args.encoder.init_args.stem_stride)"
            )
        self.in_channels = in_channels
        self.out_features = out_features
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, channels[0], 3, stem_stride, 1, bias=False), nn.BatchNorm2d(channels[0]), nn.ReLU()
        )
        stages, previous = [], channels[0]
        for i, width in enumerate(channels):
            for j in range(blocks_per_stage):
                stages.append(BasicBlock(previous, width, stride=2 if (i > 0 and j == 0) else 1))
                previous = width
        self.stages = nn.Sequential(*stages)
        self.dropout = nn.Dropout(dropout)
        self.projection = nn.Linear(previous, out_features)

    def forward(self, images: Tensor) -> Tensor:
        """Shape: images ``(B, in_channels, H, W)`` -> hidden ``(B, out_features)``."""
        if images.dim() != 4 or images.shape[1] != self.in_channels:
            raise ValueError(
                f"HanziCNN expects images of shape (B, {self.in_channels}, H, W), got {tuple(images.shape)}"
            )
        features = self.stages(self.stem(images))  # (B, C, H / 2^(stages-1), W / ...)
        pooled = features.mean(dim=(2, 3))  # (B, C): global average pool
        return self.projection(self.dropout(pooled))  # linear: no ReLU to die (class docstring)


class ResNet18Encoder(nn.Module):
    """torchvision ``resnet18`` (random init) adapted to small grayscale images.

    ImageNet's 7x7/stride-2 stem and max-pool would shrink 64x64 to 16x16 before the first
    block; as is usual for small inputs (CIFAR variants of ResNet) the stem becomes a 3x3
    stride-1 conv on ``in_channels`` and the max-pool is dropped, so the last stage sees 8x8.
    The classifier is removed; a linear projection maps the 512 pooled features to
    ``out_features``.
    """

    def __init__(self, out_features: int = 256, in_channels: int = 1, dropout: float = 0.1) -> None:
        super().__init__()
        from torchvision.models import resnet18

        if out_features < 1 or not 0.0 <= dropout < 1.0:
            raise ValueError(
                f"ResNet18Encoder needs out_features >= 1 and dropout in [0, 1), got {out_features}, {dropout} "
                f"(set model.init_args.encoder.init_args)"
            )
        net = resnet18(weights=None)
        net.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        net.fc = nn.Identity()
        self.net = net
        self.in_channels = in_channels
        self.out_features = out_features
        self.dropout = nn.Dropout(dropout)
        self.projection = nn.Linear(512, out_features)

    def forward(self, images: Tensor) -> Tensor:
        """Shape: images ``(B, in_channels, H, W)`` -> hidden ``(B, out_features)``."""
        pooled = self.net(images)  # (B, 512) after torchvision's global average pool
        return self.projection(self.dropout(pooled))  # linear: no ReLU to die (class docstring)
