"""Encoders for word-level language modeling: AWD-LSTM (Merity et al. 2018) and a small
causal Transformer decoder. Both map token ids ``(B, T)`` to hidden states ``(B, T, H)``
that an output head turns into next-token distributions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

LSTMState = list[tuple[Tensor, Tensor]]


def locked_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Variational dropout: one mask per sequence, shared over time (Gal & Ghahramani 2016).

    Shape: ``(B, T, C) -> (B, T, C)``.
    """
    if not training or p == 0.0:
        return x
    B, _, C = x.shape
    mask = x.new_empty(B, 1, C).bernoulli_(1 - p) / (1 - p)  # (B, 1, C)
    return x * mask


def embedding_dropout(embedding: nn.Embedding, tokens: Tensor, p: float, training: bool) -> Tensor:
    """Drop whole word types (rows of the embedding matrix), AWD-LSTM §4.3.

    Shape: tokens ``(B, T)`` -> ``(B, T, E)``.
    """
    weight = embedding.weight
    if training and p > 0.0:
        mask = weight.new_empty(weight.size(0), 1).bernoulli_(1 - p) / (1 - p)  # (V, 1)
        weight = weight * mask
    return F.embedding(tokens, weight)


class AWDLSTMEncoder(nn.Module):
    """Multi-layer LSTM with embedding, locked and DropConnect (weight-dropped) regularisation.

    Args:
        vocab_size: number of input tokens.
        embedding_dim: input embedding width ``E``.
        hidden_size: width of the inner LSTM layers.
        num_layers: number of stacked LSTM layers.
        last_hidden_size: width of the last layer (``E`` by default so weights can be tied).
        dropout_embedding: probability of dropping a word type (``dropoute``).
        dropout_input: locked dropout on the embeddings (``dropouti``).
        dropout_hidden: locked dropout between LSTM layers (``dropouth``).
        dropout_output: locked dropout on the last layer's output (``dropout``).
        weight_drop: DropConnect on each hidden-to-hidden matrix (``wdrop``).
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        hidden_size: int,
        num_layers: int,
        last_hidden_size: int | None = None,
        dropout_embedding: float = 0.0,
        dropout_input: float = 0.0,
        dropout_hidden: float = 0.0,
        dropout_output: float = 0.0,
        weight_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)
        last = last_hidden_size or embedding_dim
        sizes = [embedding_dim] + [hidden_size] * (num_layers - 1) + [last]
        self.layers = nn.ModuleList(
            nn.LSTM(sizes[i], sizes[i + 1], batch_first=True) for i in range(num_layers)
        )
        self.out_features = last
        self.dropout_embedding, self.dropout_input = dropout_embedding, dropout_input
        self.dropout_hidden, self.dropout_output = dropout_hidden, dropout_output
        self.weight_drop = weight_drop
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)

    def _run_layer(self, layer: nn.LSTM, x: Tensor, state: tuple[Tensor, Tensor] | None):
        if self.training and self.weight_drop > 0.0:
            # DropConnect on W_hh (AWD-LSTM §2): a fresh mask per forward, shared over time.
            dropped = F.dropout(layer.weight_hh_l0, self.weight_drop, training=True)
            return functional_call(layer, {"weight_hh_l0": dropped}, (x, state), strict=False)
        return layer(x, state)

    def forward(self, tokens: Tensor, state: LSTMState | None = None) -> tuple[Tensor, Tensor, LSTMState]:
        """Encode a window of tokens, continuing from ``state``.

        Shape:
            tokens ``(B, T)`` -> output ``(B, T, H)`` (after output dropout), raw last-layer
            output ``(B, T, H)`` (for temporal activation regularisation), and the new state.
        """
        x = embedding_dropout(self.embedding, tokens, self.dropout_embedding, self.training)  # (B, T, E)
        x = locked_dropout(x, self.dropout_input, self.training)
        new_state: LSTMState = []
        for i, layer in enumerate(self.layers):
            x, layer_state = self._run_layer(layer, x, None if state is None else state[i])
            new_state.append(layer_state)
            if i < len(self.layers) - 1:
                x = locked_dropout(x, self.dropout_hidden, self.training)
        raw = x  # (B, T, H)
        return locked_dropout(raw, self.dropout_output, self.training), raw, new_state


class TransformerLMEncoder(nn.Module):
    """A small causal Transformer decoder (pre-norm), learned positions.

    Each TBPTT window is encoded independently (no state crosses windows), so its context is
    at most ``bptt`` tokens; ``max_length`` bounds the window.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        num_layers: int,
        num_heads: int,
        feedforward_dim: int,
        dropout: float,
        max_length: int,
    ) -> None:
        super().__init__()
        if embedding_dim % num_heads:
            raise ValueError(
                f"transformer needs embedding_dim divisible by transformer_heads, got {embedding_dim} and "
                f"{num_heads} (set model.init_args.embedding_dim or transformer_heads)"
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
                f"(raise model.init_args.max_length or lower data.init_args.bptt)"
            )
        positions = torch.arange(T, device=tokens.device)
        x = self.dropout(self.embedding(tokens) * math.sqrt(self.embedding.embedding_dim) + self.positions(positions))
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=tokens.device)  # (T, T)
        x = self.norm(self.blocks(x, mask=causal, is_causal=True))  # (B, T, E)
        return x, x, None
