"""AWD-LSTM (Merity et al. 2018), the language model encoder of the MoS and DS-Softmax papers:
token ids ``(B, T)`` to hidden states ``(B, T, H)`` that an output head turns into next-token
distributions, with the recurrent state carried from one TBPTT window to the next."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from tasks.encoders.lm import LMEncoder, check_dropouts, check_sizes

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


class AWDLSTMEncoder(LMEncoder):
    """Multi-layer LSTM with embedding, locked and DropConnect (weight-dropped) regularisation.

    The defaults are the paper's Penn Treebank model (3 layers, 1150 hidden, 400 embedding).

    Args:
        vocab_size: number of input tokens (given by the task: the data's vocabulary size).
        embedding_dim: input embedding width ``E``.
        hidden_size: width of the inner LSTM layers.
        num_layers: number of stacked LSTM layers.
        last_hidden_size: width of the last layer, the head's ``in_features`` (``E`` by default so
            weights can be tied).
        dropout_embedding: probability of dropping a word type (``dropoute``).
        dropout_input: locked dropout on the embeddings (``dropouti``).
        dropout_hidden: locked dropout between LSTM layers (``dropouth``).
        dropout_output: locked dropout on the last layer's output (``dropout``).
        weight_drop: DropConnect on each hidden-to-hidden matrix (``wdrop``).
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 400,
        hidden_size: int = 1150,
        num_layers: int = 3,
        last_hidden_size: int | None = None,
        dropout_embedding: float = 0.1,
        dropout_input: float = 0.65,
        dropout_hidden: float = 0.3,
        dropout_output: float = 0.4,
        weight_drop: float = 0.5,
    ) -> None:
        super().__init__()
        check_dropouts(
            "AWDLSTMEncoder", dropout_embedding=dropout_embedding, dropout_input=dropout_input,
            dropout_hidden=dropout_hidden, dropout_output=dropout_output, weight_drop=weight_drop,
        )
        check_sizes(
            "AWDLSTMEncoder", embedding_dim=embedding_dim, hidden_size=hidden_size, num_layers=num_layers,
            last_hidden_size=last_hidden_size,
        )
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
