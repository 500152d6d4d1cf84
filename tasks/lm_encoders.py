"""Kept so configs and checkpoints written before the move to :mod:`tasks.encoders` load."""

from tasks.encoders.awd_lstm import AWDLSTMEncoder, embedding_dropout, locked_dropout  # noqa: F401
from tasks.encoders.transformer_lm import TransformerLMEncoder  # noqa: F401
