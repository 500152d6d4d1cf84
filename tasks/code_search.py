"""Translation over Hybrid-LightRNN code sequences (seed 002 Eq. 4): the decoder reads and predicts
codes of :class:`heads.lightrnn.HybridLightRNNCodes`, while searches and metrics stay word-level.

Teacher forcing (:func:`code_inputs`): the decoder reads two codes per target word,
``[second(BOS), first(y_1), second(y_1), first(y_2), ...]`` (the head's
:meth:`~heads.lightrnn.HybridLightRNNCodes.code_sequence`), so step ``2t`` predicts word ``t``'s
first code and step ``2t + 1`` its second. Code ``c`` enters the network as id ``c + 1``: id
``PAD_ID = 0`` stays the padding id, which the Transformer masks and the LSTM embeds as zeros.

Decoding (:class:`CodeStep`): a search step gets the words chosen so far, feeds the last word's
two codes, and answers the next word's best ``w`` candidates with their exact word
log-probabilities. An exclusive word's score is its code's; a table word's needs one more
decoder step, reading its row code, so rows are visited best first and only while they can still
hold a top-``w`` word (:func:`heads.lightrnn.head.best_words`). The scores are the same word
log-probabilities teacher forcing sums (tested), so beam search ranks hypotheses by the loss the
model was trained on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from datamodules.bpe import PAD_ID
from heads.base import IGNORE_INDEX
from heads.lightrnn.head import best_words
from tasks.decoding import Candidates, select_rows

#: Code ``c`` is network input id ``c + CODE_OFFSET``; id ``PAD_ID`` (0) is padding.
CODE_OFFSET = PAD_ID + 1
#: (context, row) pairs per decoder call when rows are visited: each copies its context's decoder
#: state (a Transformer's encoder memory and key/value caches), so the copies are bounded.
ROW_BATCH = 256


def code_inputs(head: Any, target_input: Tensor, target_output: Tensor) -> Tensor:
    """The decoder's code inputs under teacher forcing, ``PAD_ID`` at padded words.

    Shape: target_input ``(B, T)`` (BOS + words), target_output ``(B, T)`` (words + EOS, padding
    ``IGNORE_INDEX``) -> ``(B, 2T)`` ids in ``[0, head.num_input_codes]``.
    """
    codes = head.code_sequence(target_input, target_output) + CODE_OFFSET  # (B, 2T)
    padded = (target_output == IGNORE_INDEX).repeat_interleave(2, dim=1)
    return codes.masked_fill(padded, PAD_ID)


class CodeStep:
    """A search step (:data:`tasks.decoding.StepFunction`) for a decoder over code inputs.

    ``state`` is ``{"net": decoder state, "codes": (N, c) code inputs read so far}``; start it
    with :meth:`initial`. Each call reads the last word's codes and returns the next word's best
    ``width`` words as :class:`~tasks.decoding.Candidates`.
    """

    def __init__(self, network: Any, head: Any, width: int) -> None:
        self.network, self.head = network, head
        self.width = min(width, head.num_classes)

    @staticmethod
    def initial(encoder_state: Any, rows: int, device: torch.device) -> dict[str, Any]:
        return {"net": encoder_state, "codes": torch.zeros(rows, 0, dtype=torch.long, device=device)}

    def word_codes(self, words: Tensor) -> tuple[Tensor, Tensor]:
        """Network input ids of each word's first and second code (the end marker after a
        one-code word), as teacher forcing reads them. Shape ``(N,)`` -> ``(N,)`` twice."""
        sequence = self.head.code_sequence(words[:, None], words[:, None]) + CODE_OFFSET  # (N, 2): second, first
        return sequence[:, 1], sequence[:, 0]

    def read(self, codes: Tensor, new: Tensor, net: Any) -> tuple[Tensor, Tensor, Any]:
        """Append ``new`` ``(N,)`` to the code inputs and run one decoder step."""
        codes = torch.cat([codes, new[:, None]], dim=1)
        hidden, net = self.network.decode_step(codes, net)
        return codes, hidden, net

    def __call__(self, tokens: Tensor, state: dict[str, Any]) -> tuple[Candidates, dict[str, Any]]:
        net, codes = state["net"], state["codes"]
        first, second = self.word_codes(tokens[:, -1])
        if codes.shape[1] > 0:  # BOS only sets the context: its first code is never read
            codes, _, net = self.read(codes, first, net)
        codes, hidden, net = self.read(codes, second, net)  # (N, H): predicts the next word's first code
        return self.candidates(hidden, codes, net), {"net": net, "codes": codes}

    def candidates(self, hidden: Tensor, codes: Tensor, net: Any) -> Candidates:
        """The ``width`` most probable next words after ``hidden`` (exact word log-probabilities)."""
        head, k = self.head, self.width
        K = head.num_exclusive
        _, first_lp = head._masked_log_prob(hidden, head.first_valid)  # (N, K + d2)

        def column_log_prob(contexts: Tensor, rows: Tensor) -> Tensor:  # one decoder step per (context, row)
            parts = []
            for start in range(0, contexts.numel(), ROW_BATCH):  # each pair copies its context's decoder state
                c, r = contexts[start : start + ROW_BATCH], rows[start : start + ROW_BATCH]
                _, row_hidden, _ = self.read(codes[c], K + r + CODE_OFFSET, select_rows(net, c))
                _, col_lp = head._masked_log_prob(row_hidden, head._second_allowed(r))  # (m, K + d2)
                parts.append(col_lp[:, K:])
            return torch.cat(parts)

        best, best_word = best_words(first_lp[:, :K], head.exclusive_word, first_lp[:, K : K + head.rows], head.cell_word,
                                     column_log_prob, k)
        return Candidates(best.float(), best_word)
