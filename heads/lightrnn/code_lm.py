"""Hybrid-LightRNN over code sequences (seed 002 §3, Eq. 4): the network reads codes and predicts
codes, one code dictionary for both positions.

Seed 002 replaces every sentence by its code sequence and scores it with a language model over
codes (Eq. 4): ``log P(x) = sum_k sum_j log P(g(x_k)_j | Z_{k,j})`` with ``Z_{k,j}`` every code
before ``g(x_k)_j``. Here:

* **one code dictionary** of ``K + d2`` codes: the ``K`` exclusive codes, then ``d2`` shared codes
  that spell a table row in first position and a column in second position (seed 002 sets
  ``d1 = d2``: 9,652 + 174 codes for 30K words, a 10K dictionary). The network embeds these codes
  (plus one input-only end marker, below) and one inner head (any registered head: Softmax,
  MoS...) scores them;
* **code inputs**: :meth:`HybridLightRNNCodes.code_sequence` turns a window of words into two
  network steps per word, the word's first code and its second code, so the second code is
  conditioned on the first *through the network*. A word with a length-1 (exclusive) code is
  followed by a fixed end marker in the input (its second step predicts nothing). This is where
  the model differs from Eq. 4: there, a length-1 code sequence takes one step. The marker is
  deterministic, so it adds no probability and no information; it keeps every window ``2T``
  steps long, which truncated BPTT, the carried state and DDP's equal batches need;
* **exact word probabilities**: the first code is scored over the codes that can start a word
  (exclusive codes and rows that hold a word), the second over the columns of the word's row that
  hold a word, so the word probabilities sum to one (:meth:`word_log_prob`, tested) and the
  perplexity is word-level, comparable with word-level heads. Eq. 4 itself does not renormalise.

Word positions: step ``2t`` has read the last code of input word ``t`` (its column, or the end
marker) and predicts the first code of target ``t``; step ``2t + 1`` has read that first code and
predicts the second. :meth:`forward` takes the ``(B, 2T, H)`` network output and the ``(B, T)``
word targets and returns the ``(B, T)`` word NLL, the sum of each word's code NLLs.

:class:`tasks.language_model.LanguageModel` and :class:`tasks.translation.TranslationTask` feed
code inputs (they ask the head for :meth:`code_sequence` when the head has ``code_inputs``). A
word's whole distribution needs one network step per row, so :meth:`log_prob` and :meth:`topk`
refuse (one line); translation's searches visit rows through the decoder instead
(:mod:`tasks.code_search`). The word-level output-only factorisation
(:class:`heads.lightrnn.head.HybridLightRNN`) serves captioning and ``analyze``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from heads.base import IGNORE_INDEX, OutputHead
from heads.lightrnn.codes import EMPTY
from heads.lightrnn.head import HybridLightRNN
from heads.registry import HeadSpec, build_head


class HybridLightRNNCodes(HybridLightRNN):
    """Hybrid-LightRNN over code sequences: code inputs and outputs over one code dictionary.

    Args:
        in_features: hidden size of the network output.
        num_classes: vocabulary size ``|V|`` (ids sorted by decreasing frequency).
        num_exclusive: ``K``, the most frequent words with an exclusive length-1 code.
        exclusive_fraction: ``K`` as a share of ``|V|`` (``round(f |V|)``); 0 uses ``num_exclusive``.
        rows, cols: table shape ``d1 x d2`` (``d1 <= d2``: rows use the first ``d1`` shared codes);
            default the smallest near-square table.
        inner: the head over the ``K + d2`` codes, a short name or a ``class_path`` factory.
        ignore_index: target value that contributes zero loss.
    """

    #: The task feeds this head's :meth:`code_sequence` to the network instead of the words.
    code_inputs = True
    #: Not a registered head: it is off the head contract (``forward`` scores ``(B, 2T, H)`` code
    #: steps against ``(B, T)`` words, no ``log_prob`` / ``topk`` from one hidden state), so it stays
    #: out of the registry the tools, the contract tests and ``inner`` heads take names from; configs
    #: select it by ``class_path`` (``configs/heads/hybrid_lightrnn_codes.yaml``). ``None`` rather
    #: than :class:`HybridLightRNN`'s inherited ``hybrid_lightrnn``, which names the other model.
    short_name: ClassVar[str | None] = None

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_exclusive: int = 0,
        rows: int | None = None,
        cols: int | None = None,
        inner: HeadSpec = "softmax",
        ignore_index: int = IGNORE_INDEX,
        exclusive_fraction: float = 0.0,
    ) -> None:
        OutputHead.__init__(self, in_features, num_classes, ignore_index)
        self._build_table(num_classes, num_exclusive, rows, cols, exclusive_fraction)  # checks rows <= cols
        self.num_codes = self.num_exclusive + self.cols  # the one code dictionary
        self.end_code = self.num_codes  # input-only marker after a length-1 code sequence
        self.num_input_codes = self.num_codes + 1
        self.code_head = build_head(inner, in_features, self.num_codes, ignore_index, setting="head.init_args.inner")

    # ------------------------------------------------------------------ codes
    def _refresh_codes(self) -> None:
        if self.rows > self.cols:
            raise ValueError(
                f"HybridLightRNNCodes needs rows <= cols (rows and columns share the {self.cols} table codes), got "
                f"rows={self.rows}, cols={self.cols} (set head.init_args.rows/cols, or leave both unset)"
            )
        super()._refresh_codes()
        K = self.num_exclusive
        first_valid = torch.zeros(K + self.cols, dtype=torch.bool, device=self.word_to_slot.device)
        first_valid[:K] = True
        first_valid[K : K + self.rows] = self.cell_occupied.any(1)
        if "first_valid" in self._buffers:
            self.first_valid = first_valid  # (K + d2,): codes that can start a word
        else:
            self.register_buffer("first_valid", first_valid, persistent=False)
        self._first_full = bool(first_valid.all())  # then P_1 needs no renormalisation

    def code_sequence(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """The network's code inputs for a window of words.

        Step ``2t`` reads input word ``t``'s second code (``K + column``, or the end marker for an
        exclusive word); step ``2t + 1`` reads target ``t``'s first code (the end marker for an
        ignored target).

        Shape: inputs ``(B, T)``, targets ``(B, T)`` word ids -> ``(B, 2T)`` code ids in
        ``[0, K + d2]``.
        """
        K = self.num_exclusive
        words = inputs.clamp(0, self.num_classes - 1)
        column = self.column_code[words]  # (B, T), EMPTY for exclusive words
        second = torch.where(column == EMPTY, torch.full_like(column, self.end_code), K + column)
        valid = targets != self.ignore_index
        first = torch.where(valid, self.first_code[torch.where(valid, targets, 0)], self.end_code)  # (B, T)
        return torch.stack([second, first], dim=-1).flatten(1)  # (B, 2T)

    def _masked_log_prob(self, hidden: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
        """Raw ``log P`` over the code dictionary and its renormalisation over ``allowed``.

        Shape: hidden ``(n, H)``, allowed ``(n, K + d2)`` or ``(K + d2,)`` -> ``(n, K + d2)`` twice.
        """
        raw = self.code_head.log_prob(hidden)
        masked = raw.masked_fill(~allowed, float("-inf"))
        return raw, masked - torch.logsumexp(masked, dim=-1, keepdim=True)

    def _second_allowed(self, row: Tensor) -> Tensor:
        """Codes that can follow row ``row``: ``K + c`` for the row's occupied cells. ``(m,) -> (m, K + d2)``."""
        allowed = torch.zeros(row.shape[0], self.num_codes, dtype=torch.bool, device=row.device)
        allowed[:, self.num_exclusive :] = self.cell_occupied[row]
        return allowed

    # ------------------------------------------------------------------ contract
    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Word NLL, the sum of the word's code NLLs (Eq. 4, renormalised as the module says).

        Shape:
            hidden ``(B, 2T, in_features)`` (the network over :meth:`code_sequence`), target ``(B, T)``
            word ids -> ``(B, T)``, zero at ``ignore_index``.
        """
        if hidden.dim() != 3 or hidden.shape[1] != 2 * target.shape[-1] or hidden.shape[0] != target.shape[0]:
            raise ValueError(
                f"HybridLightRNNCodes scores (B, 2T, H) code-step outputs against (B, T) words, got hidden "
                f"{tuple(hidden.shape)} and target {tuple(target.shape)} (use it in a LanguageModel or TranslationTask, which feed "
                f"it code inputs; other tasks: heads.HybridLightRNN, the output-only factorisation)"
            )
        K = self.num_exclusive
        valid = target != self.ignore_index  # (B, T)
        words = target[valid]  # (n,)
        first_hidden = hidden[:, 0::2][valid]  # (n, H): has read the previous word, predicts the first code
        second_hidden = hidden[:, 1::2][valid]  # (n, H): has read the first code, predicts the second
        first = self.first_code[words]  # (n,)
        if self._first_full:
            first_raw = None
            token_nll = self.code_head(first_hidden, first)  # (n,): the inner head's own (memory-lean) NLL
        else:
            first_raw, first_lp = self._masked_log_prob(first_hidden, self.first_valid)
            token_nll = -first_lp.gather(1, first[:, None]).squeeze(1)
        in_table = words >= K  # frequency order: ids < K are the exclusive words
        if bool(in_table.any()):
            row = first[in_table] - K  # (m,)
            col_raw, col_lp = self._masked_log_prob(second_hidden[in_table], self._second_allowed(row))  # (m, K + d2)
            column = K + self.column_code[words[in_table]]  # (m,)
            token_nll = token_nll.index_add(0, in_table.nonzero().squeeze(1), -col_lp.gather(1, column[:, None]).squeeze(1))
            if self.cost_accumulator is not None and self.training:
                # Eq. 6 costs from code log-probabilities that do not depend on the assignment: the
                # first code over every code that can be a first code (exclusive codes and all d1
                # rows), the second over all d2 columns.
                with torch.no_grad():
                    if first_raw is None:
                        first_raw = self.code_head.log_prob(first_hidden[in_table])
                    else:
                        first_raw = first_raw[in_table]
                    first_raw = first_raw[:, : K + self.rows]
                    row_lp = (first_raw - torch.logsumexp(first_raw, dim=-1, keepdim=True))[:, K:]  # (m, d1)
                    col_lp = col_raw[:, K:] - torch.logsumexp(col_raw[:, K:], dim=-1, keepdim=True)  # (m, d2)
                self.cost_accumulator.add(words[in_table] - K, row_lp, col_lp)
        nll = token_nll.new_zeros(target.shape)
        nll[valid] = token_nll
        return nll

    def word_log_prob(self, first_hidden: Tensor, row_hidden: Tensor) -> Tensor:
        """Exact word log-probabilities at one position from the network's outputs: ``first_hidden``
        after the previous word, ``row_hidden[:, r]`` after reading row ``r``'s code next.

        Shape: first_hidden ``(N, H)``, row_hidden ``(N, d1, H)`` -> ``(N, |V|)``.
        """
        K, N = self.num_exclusive, first_hidden.shape[0]
        _, first_lp = self._masked_log_prob(first_hidden, self.first_valid)  # (N, K + d2)
        rows = torch.arange(self.rows, device=first_hidden.device)
        _, col_lp = self._masked_log_prob(row_hidden.reshape(N * self.rows, -1), self._second_allowed(rows.repeat(N)))
        col_lp = col_lp.view(N, self.rows, self.num_codes)[:, :, K:].nan_to_num(nan=float("-inf"))  # (N, d1, d2)
        out = first_lp[:, self.first_code]  # (N, |V|): exclusive words done
        table = self.word_to_slot[K:] - K
        return torch.cat([out[:, :K], out[:, K:] + col_lp.reshape(N, -1)[:, table]], dim=1)

    def log_prob(self, hidden: Tensor) -> Tensor:
        raise ValueError(
            "HybridLightRNNCodes reads codes, so a word's distribution needs one network step per row: it has no "
            "log_prob from one hidden state (score with the LM's test/predict; for log_prob, topk, beam search and "
            "analyze use the output-only heads.HybridLightRNN)"
        )

    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        return self.log_prob(hidden)  # refuses, as log_prob

    @torch.no_grad()
    def init_unigram_bias(self, log_unigram: Tensor) -> bool:
        """Start the code head at the code unigram the word unigram implies: each code's share of
        all code positions (first codes of every word, column codes of table words)."""
        if log_unigram.shape != (self.num_classes,):
            raise ValueError(
                f"{type(self).__name__} needs a log-unigram vector of shape ({self.num_classes},), got "
                f"{tuple(log_unigram.shape)} (the counts must come from the head's own vocabulary)"
            )
        p = log_unigram.double().exp()
        codes = torch.zeros(self.num_codes, dtype=torch.float64, device=p.device)
        codes.index_add_(0, self.first_code, p)
        table = self.column_code != EMPTY
        codes.index_add_(0, self.num_exclusive + self.column_code[table], p[table])
        tiny = torch.finfo(torch.float64).tiny
        return self.code_head.init_unigram_bias(torch.log((codes / codes.sum()).clamp_min(tiny)).float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, codes={self.num_codes} (+1 end marker)"
