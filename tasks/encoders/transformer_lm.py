"""A small causal Transformer decoder as a language model encoder: token ids ``(B, T)`` to hidden
states ``(B, T, E)``; each TBPTT window is read on its own."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tasks.encoders.lm import LMEncoder, check_dropouts, check_sizes


class TransformerLMEncoder(LMEncoder):
    """A causal Transformer decoder (pre-norm) with learned positions.

    Each TBPTT window is encoded independently (no state crosses windows), so its context is
    at most ``bptt`` tokens; ``max_length`` bounds the window.

    Args:
        vocab_size: number of input tokens (given by the task: the data's vocabulary size).
        embedding_dim: model width ``E``, also the head's ``in_features``.
        num_layers: number of Transformer blocks.
        num_heads: attention heads per block (must divide ``embedding_dim``).
        feedforward_dim: inner width of each block's feed-forward layer.
        dropout: dropout on the embeddings and inside every block.
        max_length: longest window (number of learned positions).
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 400,
        num_layers: int = 3,
        num_heads: int = 4,
        feedforward_dim: int = 1150,
        dropout: float = 0.4,
        max_length: int = 512,
    ) -> None:
        super().__init__()
        check_dropouts("TransformerLMEncoder", dropout=dropout)
        check_sizes(
            "TransformerLMEncoder", embedding_dim=embedding_dim, num_layers=num_layers, num_heads=num_heads,
            feedforward_dim=feedforward_dim, max_length=max_length,
        )
        if embedding_dim % num_heads:
            raise ValueError(
                f"TransformerLMEncoder needs embedding_dim divisible by num_heads, got {embedding_dim} and {num_heads} "
                f"(set model.init_args.encoder.init_args.embedding_dim or num_heads)"
            )
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        self.positions = nn.Embedding(max_length, embedding_dim)
        layer = nn.TransformerEncoderLayer(
            embedding_dim, num_heads, feedforward_dim, dropout, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(embedding_dim)
        self.dropout = nn.Dropout(dropout)
        self.out_features = embedding_dim
        self.max_length = max_length
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, tokens: Tensor, state: None = None) -> tuple[Tensor, Tensor, None]:
        """Shape: tokens ``(B, T)`` -> output ``(B, T, E)``, same output, ``None``."""
        B, T = tokens.shape
        if T > self.max_length:
            raise ValueError(
                f"window of {T} tokens exceeds the transformer's max_length {self.max_length} "
                f"(raise model.init_args.encoder.init_args.max_length or lower data.init_args.bptt)"
            )
        positions = torch.arange(T, device=tokens.device)
        x = self.dropout(self.embedding(tokens) * math.sqrt(self.embedding.embedding_dim) + self.positions(positions))
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=tokens.device)  # (T, T)
        x = self.norm(self.blocks(x, mask=causal, is_causal=True))  # (B, T, E)
        return x, x, None
