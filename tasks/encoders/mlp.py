"""A small multi-layer perceptron encoder for vector inputs (the App. A hierarchy task)."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn


class MLPEncoder(nn.Module):
    """``Linear -> ReLU -> Dropout`` blocks mapping ``(..., in_features)`` to ``(..., out_features)``.

    Args:
        in_features: input size (the datamodule's ``num_features``).
        hidden_sizes: width of each hidden layer; the last one is ``out_features``.
        dropout: dropout after each activation.
    """

    def __init__(self, in_features: int, hidden_sizes: Sequence[int] = (128,), dropout: float = 0.0) -> None:
        super().__init__()
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features < 1:
            raise ValueError(f"MLPEncoder needs in_features to be an integer >= 1, got {in_features!r} (set model.init_args.encoder.init_args.in_features)")
        sizes = list(hidden_sizes)
        if not sizes or any(int(s) < 1 for s in sizes):
            raise ValueError(f"MLPEncoder needs hidden_sizes to be a non-empty list of integers >= 1, got {hidden_sizes!r} (set model.init_args.encoder.init_args.hidden_sizes)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MLPEncoder needs dropout in [0, 1), got {dropout} (set model.init_args.encoder.init_args.dropout)")
        layers: list[nn.Module] = []
        width = in_features
        for size in sizes:
            layers += [nn.Linear(width, int(size)), nn.ReLU(), nn.Dropout(dropout)]
            width = int(size)
        self.layers = nn.Sequential(*layers)
        self.in_features = in_features
        self.out_features = width

    def forward(self, inputs: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., out_features)``."""
        return self.layers(inputs)
