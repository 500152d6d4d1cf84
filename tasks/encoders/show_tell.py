"""The caption decoder: NIC's LSTM (Show and Tell), optionally with soft attention (Show, Attend
and Tell).

NIC (Vinyals et al. 2015, §3.1): the image embedding ``x_{-1} = W_I CNN(I)`` is the LSTM's
*first input* and only sets its state; words follow as ``x_t = W_e S_t`` from the start token on,
and the LSTM output at step ``t`` predicts ``S_{t+1}`` through the head (Eq. 10-12). With
``attention: true`` the decoder also attends over the CNN's spatial grid at every step (Xu et
al. 2015, §3.1.2): additive scores ``e_ti = w^T tanh(W_a a_i + W_h h_{t-1})`` (Eq. 4-5, "soft"
attention), the context ``z_t = sum_i alpha_ti a_i`` (Eq. 13) joins the word embedding as LSTM
input, and the head reads the deep output ``E y_{t-1} + L_h h_t + L_z z_t`` (Eq. 7).

The task takes it as ``model.init_args.decoder`` (``class_path: tasks.encoders.ShowTellDecoder``)
and passes the two sizes it does not own: the caption vocabulary (from the data) and the
encoder's channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from datamodules.bpe import PAD_ID
from heads.validation import check_dropout, check_positive_int

#: Where the decoder's settings live, for error messages.
DECODER = "model.init_args.decoder.init_args"


class SoftAttention(nn.Module):
    """Additive attention over annotation vectors (Xu et al. 2015, Eq. 4-5 and 13)."""

    def __init__(self, feature_dim: int, hidden_size: int, attention_dim: int) -> None:
        super().__init__()
        self.feature_projection = nn.Linear(feature_dim, attention_dim)  # W_a
        self.hidden_projection = nn.Linear(hidden_size, attention_dim, bias=False)  # W_h
        self.score = nn.Linear(attention_dim, 1, bias=False)  # w

    def forward(self, annotations: Tensor, projected: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Context vector and weights.

        Shape:
            annotations ``(N, P, C)``, projected ``(N, P, A)`` (= ``W_a a``, cached per
            image), hidden ``(N, H)`` -> context ``(N, C)``, weights ``(N, P)``.
        """
        scores = self.score(torch.tanh(projected + self.hidden_projection(hidden).unsqueeze(1))).squeeze(-1)  # (N, P)
        weights = torch.softmax(scores, dim=-1)
        context = (weights.unsqueeze(-1) * annotations).sum(dim=1)  # (N, C), Eq. 13
        return context, weights


class ShowTellDecoder(nn.Module):
    """NIC's LSTM decoder, optionally with soft attention; produces the head's input.

    Args:
        num_classes: vocabulary size (word embeddings ``W_e``), linked from the data by the task.
        feature_dim: channels ``C`` of the annotation vectors (the encoder's ``out_channels``).
        embed_dim: word and image embedding width.
        hidden_size: LSTM width.
        num_layers: stacked LSTM layers.
        dropout: on embeddings, between LSTM layers and on the head's input.
        attention: add soft attention (Xu et al.) to NIC.
        attention_dim: width ``A`` of the attention MLP.
    """

    def __init__(self, num_classes: int, feature_dim: int, embed_dim: int = 512, hidden_size: int = 512, num_layers: int = 1, dropout: float = 0.5,
                 attention: bool = False, attention_dim: int = 512) -> None:
        super().__init__()
        check_dropout(dropout, "dropout", "ShowTellDecoder", where=DECODER)
        for key, value in (("embed_dim", embed_dim), ("hidden_size", hidden_size), ("num_layers", num_layers), ("attention_dim", attention_dim)):
            check_positive_int(value, key, "ShowTellDecoder", where=DECODER)
        self.attention = SoftAttention(feature_dim, hidden_size, attention_dim) if attention else None
        self.image_embedding = nn.Linear(feature_dim, embed_dim)  # W_I, NIC Eq. 10
        self.word_embedding = nn.Embedding(num_classes, embed_dim, padding_idx=PAD_ID)  # W_e, Eq. 11
        input_size = embed_dim + (feature_dim if attention else 0)
        self.lstm = nn.LSTM(input_size, hidden_size, num_layers, batch_first=True, dropout=dropout if num_layers > 1 else 0.0)
        if attention:
            self.output_hidden = nn.Linear(hidden_size, embed_dim)  # L_h, Xu Eq. 7
            self.output_context = nn.Linear(feature_dim, embed_dim, bias=False)  # L_z
        self.dropout = nn.Dropout(dropout)
        self.output_size = embed_dim if attention else hidden_size

    def start(self, annotations: Tensor) -> dict[str, Tensor]:
        """Feed the image embedding as the first input (NIC Eq. 10); its output is unused.

        Shape: annotations ``(N, P, C)`` -> state of batch-first tensors with ``N`` rows.
        """
        pooled = annotations.mean(dim=1)  # (N, C): the CNN's global-pool feature
        image = self.dropout(self.image_embedding(pooled)).unsqueeze(1)  # (N, 1, E)
        if self.attention is not None:
            # There is no h_{-1} to attend with yet: the image step reads the mean annotation,
            # which Xu et al. (§3.1.2) also use to initialise the LSTM.
            image = torch.cat([image, pooled.unsqueeze(1)], dim=-1)  # (N, 1, E + C)
        _, (h, c) = self.lstm(image)  # (L, N, H)
        state = {"h": h.transpose(0, 1).contiguous(), "c": c.transpose(0, 1).contiguous()}  # (N, L, H)
        if self.attention is not None:
            state["annotations"] = annotations
            state["projected"] = self.attention.feature_projection(annotations)  # (N, P, A)
        return state

    def step(self, tokens: Tensor, state: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """One decoding step from the previous word.

        Shape: tokens ``(N,)`` -> head input ``(N, output_size)`` and the next state.
        """
        word = self.dropout(self.word_embedding(tokens))  # (N, E)
        h0, c0 = state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous()  # (L, N, H)
        context = None
        if self.attention is not None:
            context, _ = self.attention(state["annotations"], state["projected"], h0[-1])  # (N, C)
            lstm_input = torch.cat([word, context], dim=-1)  # (N, E + C)
        else:
            lstm_input = word
        output, (h, c) = self.lstm(lstm_input.unsqueeze(1), (h0, c0))  # (N, 1, H)
        hidden = self.output(output[:, 0], word, context)  # (N, D)
        return hidden, {**state, "h": h.transpose(0, 1), "c": c.transpose(0, 1)}

    def output(self, lstm_output: Tensor, word: Tensor, context: Tensor | None) -> Tensor:
        """The head's input: the LSTM output (NIC) or Xu's deep output (Eq. 7)."""
        if self.attention is None:
            return self.dropout(lstm_output)
        return self.dropout(word + self.output_hidden(lstm_output) + self.output_context(context))

    def forward(self, annotations: Tensor, caption_input: Tensor) -> Tensor:
        """Teacher-forced hidden states.

        Shape:
            annotations ``(N, P, C)`` (one row per caption), caption_input ``(N, T)``
            ``[BOS, w_1 .. w_n]`` -> ``(N, T, output_size)``.
        """
        state = self.start(annotations)
        if self.attention is None:
            # Without attention every input is known up front: one cuDNN/MKL LSTM call.
            words = self.dropout(self.word_embedding(caption_input))  # (N, T, E)
            h0, c0 = state["h"].transpose(0, 1).contiguous(), state["c"].transpose(0, 1).contiguous()
            outputs, _ = self.lstm(words, (h0, c0))  # (N, T, H)
            return self.dropout(outputs)
        hidden = []
        for t in range(caption_input.size(1)):  # attention needs h_{t-1} before step t's input
            step_hidden, state = self.step(caption_input[:, t], state)
            hidden.append(step_hidden)
        return torch.stack(hidden, dim=1)  # (N, T, D)
