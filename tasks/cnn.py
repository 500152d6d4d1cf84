"""Kept so configs and checkpoints written before the move to :mod:`tasks.encoders.hanzi_cnn` load."""

from tasks.encoders.hanzi_cnn import BasicBlock, HanziCNN, ResNet18Encoder  # noqa: F401
