"""Kept so configs and checkpoints written before the move to :mod:`tasks.encoders.mlp` load."""

from tasks.encoders.mlp import MLPEncoder  # noqa: F401
