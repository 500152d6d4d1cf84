"""Encoder-decoder networks for translation: the contract, and the LSTM with Luong attention.

A :class:`Seq2SeqNetwork` turns a source sentence and a target prefix into the decoder's hidden
states; the task's head turns those into target-word distributions. The task builds the network
from ``model.init_args.network`` (``class_path`` + ``init_args``) and passes the two sizes only
the data knows, ``source_vocab_size`` and ``target_vocab_size``, as the first two arguments.

:class:`LuongAttentionSeq2Seq`: LSTM encoder (optionally bidirectional) and LSTM decoder with
Luong et al. (2015) global attention, *dot* score (§3.1, Eq. 7-8): ``a_t = softmax(h_t . h_s)``,
``c_t = sum_s a_ts h_s``, attentional state ``h~_t = tanh(W_c [c_t; h_t])`` (Eq. 5) fed to the
head. Input feeding (§3.3) is left out so teacher-forced training runs the decoder LSTM over
the whole sentence in one call, which matters on CPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from datamodules.bpe import PAD_ID
from heads.validation import check_dropout, check_positive_int


class Seq2SeqNetwork(nn.Module):
    """What a translation network offers the task and the searches (:mod:`tasks.decoding`).

    ``encode(source, source_lengths) -> state``; ``decode(target_input, state) -> (B, T,
    output_size)`` under teacher forcing; ``decode_step(tokens, state) -> ((N, output_size),
    state)`` for the last token of each row. ``state`` is a dict of tensors whose first dimension
    is the row (beam search reorders rows with :func:`tasks.decoding.select_rows`).
    ``target_embedding`` is the decoder's input embedding (``tie_weights`` shares it with the
    head); ``output_size`` is the width the head receives.
    """

    target_embedding: nn.Embedding

    @property
    def output_size(self) -> int:
        raise NotImplementedError

    def encode(self, source: Tensor, source_lengths: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def decode(self, target_input: Tensor, state: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def decode_step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError


#: Where a translation network's settings live, for error messages.
NETWORK = "model.init_args.network.init_args"


class LuongAttentionSeq2Seq(Seq2SeqNetwork):
    """LSTM encoder + LSTM decoder with global dot-product attention (Luong et al. 2015).

    Args:
        source_vocab_size / target_vocab_size: linked from the data by the task.
        embed_dim: source and target word embedding width.
        hidden_size: LSTM width (and the attentional state's).
        num_layers: encoder and decoder layers.
        bidirectional: bidirectional encoder (its two directions projected to ``hidden_size``).
        dropout: on embeddings, between layers and on attentional states.
        attentional_layer: ``True`` (Luong): the head gets ``tanh(W_c [c_t; h_t])``. ``False``:
            the head gets ``[c_t; h_t]`` (width ``2 hidden_size``) and its own projection plays
            the attentional layer's part, so MoS's / Mixtape's ``tanh(W_k g)`` contexts are ``K``
            attentional vectors instead of a second ``tanh`` layer stacked on the first (MoS-1 is
            then exactly the Luong softmax model, plus a bias). Set the head's ``embedding_dim``
            to keep its class embeddings at the decoder width.
    """

    def __init__(self, source_vocab_size: int, target_vocab_size: int, embed_dim: int = 256, hidden_size: int = 256, num_layers: int = 2,
                 bidirectional: bool = True, dropout: float = 0.2, attentional_layer: bool = True) -> None:
        super().__init__()
        for key, value in (("embed_dim", embed_dim), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            check_positive_int(value, key, "LuongAttentionSeq2Seq", where=NETWORK)
        check_dropout(dropout, "dropout", "LuongAttentionSeq2Seq", where=NETWORK)
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.attentional_layer = attentional_layer
        self.bidirectional = bidirectional
        self.source_embedding = nn.Embedding(source_vocab_size, embed_dim, padding_idx=PAD_ID)
        self.target_embedding = nn.Embedding(target_vocab_size, embed_dim, padding_idx=PAD_ID)
        layer_dropout = dropout if num_layers > 1 else 0.0
        self.encoder = nn.LSTM(embed_dim, hidden_size, num_layers, batch_first=True, dropout=layer_dropout, bidirectional=bidirectional)
        self.decoder = nn.LSTM(embed_dim, hidden_size, num_layers, batch_first=True, dropout=layer_dropout)
        if bidirectional:
            # Dot attention needs keys of the decoder's width: project [forward; backward].
            self.memory_projection = nn.Linear(2 * hidden_size, hidden_size, bias=False)
            self.bridge_h = nn.Linear(2 * hidden_size, hidden_size)
            self.bridge_c = nn.Linear(2 * hidden_size, hidden_size)
        if attentional_layer:
            self.attentional = nn.Linear(2 * hidden_size, hidden_size, bias=False)  # W_c, Eq. 5
        self.dropout = nn.Dropout(dropout)

    @property
    def output_size(self) -> int:
        return self.hidden_size if self.attentional_layer else 2 * self.hidden_size

    def encode(self, source: Tensor, source_lengths: Tensor) -> dict[str, Tensor]:
        """Shape: ``source (B, S)``, ``source_lengths (B,)`` -> state with batch-first tensors."""
        B, S = source.shape
        embedded = self.dropout(self.source_embedding(source))  # (B, S, E)
        packed = pack_padded_sequence(embedded, source_lengths.cpu(), batch_first=True, enforce_sorted=False)
        outputs, (h, c) = self.encoder(packed)
        memory, _ = pad_packed_sequence(outputs, batch_first=True, total_length=S)  # (B, S, dirs*H)
        if self.bidirectional:
            memory = self.memory_projection(memory)  # (B, S, H)
            h = h.view(self.num_layers, 2, B, self.hidden_size)  # (L, dirs, B, H)
            c = c.view(self.num_layers, 2, B, self.hidden_size)
            h = torch.tanh(self.bridge_h(torch.cat([h[:, 0], h[:, 1]], dim=-1)))  # (L, B, H)
            c = self.bridge_c(torch.cat([c[:, 0], c[:, 1]], dim=-1))  # (L, B, H)
        return {
            "memory": memory,
            "padding": source == PAD_ID,  # (B, S) True where padded
            "h": h.transpose(0, 1).contiguous(),  # (B, L, H): rows first for beam reordering
            "c": c.transpose(0, 1).contiguous(),
        }

    def attend(self, decoder_states: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Attentional hidden states ``h~ = tanh(W_c [c; h])``, or ``[c; h]`` itself without the
        attentional layer. Shape: ``(B, T, H) -> (B, T, output_size)``."""
        scores = decoder_states @ state["memory"].transpose(1, 2)  # (B, T, S), dot score Eq. 8
        scores = scores.masked_fill(state["padding"].unsqueeze(1), -math.inf)
        weights = torch.softmax(scores, dim=-1)
        context = weights @ state["memory"]  # (B, T, H), Eq. 7 weighted average
        combined = torch.cat([context, decoder_states], dim=-1)  # (B, T, 2H)
        if not self.attentional_layer:
            return self.dropout(combined)
        return self.dropout(torch.tanh(self.attentional(combined)))

    def decode(self, target_input: Tensor, state: dict[str, Tensor]) -> Tensor:
        """Teacher-forced decoder. Shape: ``target_input (B, T)`` -> hidden ``(B, T, output_size)``."""
        embedded = self.dropout(self.target_embedding(target_input))  # (B, T, E)
        initial = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())  # (L, B, H)
        outputs, _ = self.decoder(embedded, initial)  # (B, T, H)
        return self.attend(outputs, state)

    def decode_step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One step from the last token. Shape: ``tokens (N, t)`` -> hidden ``(N, output_size)``."""
        embedded = self.target_embedding(tokens[:, -1:])  # (N, 1, E)
        initial = (state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous())
        output, (h, c) = self.decoder(embedded, initial)  # (N, 1, H)
        hidden = self.attend(output, state)[:, 0]  # (N, output_size)
        return hidden, {**state, "h": h.transpose(0, 1), "c": c.transpose(0, 1)}
