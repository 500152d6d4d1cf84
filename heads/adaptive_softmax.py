"""Adaptive softmax (Grave, Joulin, Cissé, Grangier & Jégou, ICML 2017, "Efficient softmax
approximation for GPUs"), on :class:`torch.nn.AdaptiveLogSoftmaxWithLoss`.

The vocabulary, sorted by decreasing frequency, is cut into a *head* (a shortlist of the most
frequent classes) and tail clusters of rarer classes. The head softmax scores the shortlist and
one token per tail cluster; a class in tail cluster ``c`` gets the two-level factorisation

    log p(x | h) = log p(c | h) + log p(x | c, h),

where ``p(x | c, h)`` is a softmax over the cluster's classes through a projection of width
``in_features // div_value**c``: rare classes get less capacity, and a token whose target is in
the shortlist never touches a tail. PyTorch's module does the work (training NLL, full
``log_prob``); this head adds the project's contract: the ignore index, any leading shape, a
``topk`` that skips the tails that cannot reach the top k, and cutoffs derived from the
vocabulary size when none are given (:func:`derived_cutoffs`).

The distribution is exact in any class order; its speed and its capacity split assume class ids
sorted by decreasing frequency, which the language-model, translation and captioning datamodules
deliver (``frequency_ordered``). Labels without a frequency order (Hanzi) put arbitrary classes in
the narrow tails: give ``cutoffs`` that suit them, or use a softmax.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.registry import register_head
from heads.validation import HEAD, check_dropout, check_positive_int

#: Each cluster of the derived cutoffs is this many times larger than the one before it
#: (the project's choice; see :func:`derived_cutoffs`).
CLUSTER_GROWTH = 4
#: Tail clusters the derived cutoffs aim for (fewer when the projections would be empty).
DERIVED_TAILS = 2


def tail_width(in_features: int, div_value: float, cluster: int) -> int:
    """Width of tail ``cluster``'s projection (1-based), as :class:`nn.AdaptiveLogSoftmaxWithLoss` sizes it."""
    return int(in_features // (div_value**cluster))


def derived_cutoffs(num_classes: int, in_features: int, div_value: float = 4.0) -> list[int]:
    """The project's default cutoffs for frequency-ordered class ids.

    Grave et al. keep a shortlist of the most frequent words in the head and put the rare words in
    a few tail clusters of decreasing capacity; the paper tunes the cluster sizes to a GPU's
    matmul timings and fixes no rule for a vocabulary it has not timed. The rule here: up to
    :data:`DERIVED_TAILS` tail clusters, each :data:`CLUSTER_GROWTH` times larger than the cluster
    before it and ending at ``num_classes``, so the head is the most frequent sixteenth of the
    vocabulary and the tails ``[V/16, V/4)`` and ``[V/4, V)``. With the default ``div_value`` of
    4 each tail then holds about as many parameters as the one before it. A tail whose
    projection would have width 0 is dropped (``[V/4]`` when only one fits), and cutoffs are kept
    distinct and inside ``[1, V - 1]`` for tiny vocabularies.
    """
    tails = sum(1 for c in range(1, DERIVED_TAILS + 1) if tail_width(in_features, div_value, c) >= 1)
    cutoffs: list[int] = []
    for power in range(tails, 0, -1):  # V/16, then V/4
        cutoff = min(max(round(num_classes / CLUSTER_GROWTH**power), cutoffs[-1] + 1 if cutoffs else 1), num_classes - 1)
        if not cutoffs or cutoff > cutoffs[-1]:
            cutoffs.append(cutoff)
    return cutoffs


def check_cutoffs(cutoffs: Sequence[int], num_classes: int, in_features: int, div_value: float) -> list[int]:
    """Cutoffs :class:`nn.AdaptiveLogSoftmaxWithLoss` accepts and whose tails all have a projection of width >= 1."""
    values = list(cutoffs)
    integers = all(isinstance(c, int) and not isinstance(c, bool) for c in values)
    if not values or not integers or values != sorted(set(values)) or values[0] < 1 or values[-1] > num_classes - 1:
        raise ValueError(
            f"AdaptiveSoftmax needs cutoffs to be increasing distinct integers in [1, num_classes - 1 = {num_classes - 1}], "
            f"got {values!r} (set {HEAD}.cutoffs, e.g. [{max(1, num_classes // 16)}], or null to derive them)"
        )
    empty = next((c for c in range(1, len(values) + 1) if tail_width(in_features, div_value, c) < 1), None)
    if empty is not None:
        raise ValueError(
            f"AdaptiveSoftmax tail cluster {empty} of {len(values)} would have a projection of width "
            f"{in_features} // {div_value:g}**{empty} = 0 (set {HEAD}.cutoffs to at most {empty - 1} values or lower {HEAD}.div_value)"
        )
    return values


@register_head("adaptive_softmax", family="clustered")
class AdaptiveSoftmax(OutputHead):
    """Adaptive softmax output layer (Grave et al. 2017) on PyTorch's nn.AdaptiveLogSoftmaxWithLoss.

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``, class ids sorted by decreasing frequency.
        cutoffs: the class ids where the shortlist and each tail cluster end, increasing, in
            ``[1, V - 1]`` (``[2000, 10000]``: a 2000-class shortlist, then two tails); ``None``
            derives them from ``V`` (:func:`derived_cutoffs`).
        div_value: tail cluster ``c`` projects to width ``d // div_value**c`` (PyTorch's default 4);
            at least 1, so a rarer cluster never gets more capacity than a frequent one.
        head_bias: learn a bias in the head softmax (off by default, as PyTorch's module and, by its
            documentation, the authors' implementation).
        embedding_dim: when it differs from ``in_features``, a ``tanh`` latent layer projects
            ``g`` to this width first (same name and meaning as in Softmax and MoS, so the heads
            compare like for like); the head and tail widths are then taken from it.
        dropout: dropout on the latent before the adaptive softmax.
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        cutoffs: list[int] | None = None,
        div_value: float = 4.0,
        head_bias: bool = False,
        embedding_dim: int | None = None,
        dropout: float = 0.0,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        if embedding_dim is not None:
            check_positive_int(embedding_dim, "embedding_dim", "AdaptiveSoftmax")
        if isinstance(div_value, bool) or not isinstance(div_value, (int, float)) or not 1.0 <= div_value < math.inf:
            raise ValueError(
                f"AdaptiveSoftmax needs div_value to be a number >= 1 (a tail is never wider than the head), "
                f"got {div_value!r} (set {HEAD}.div_value, e.g. 4.0)"
            )
        self.dropout = check_dropout(dropout, "dropout", "AdaptiveSoftmax")
        width = embedding_dim or in_features
        if cutoffs is None:
            if tail_width(width, div_value, 1) < 1:
                raise ValueError(
                    f"AdaptiveSoftmax needs a latent width >= div_value for a tail cluster of width >= 1, got width "
                    f"{width} and div_value {div_value:g} (set {HEAD}.div_value to at most {width} or widen {HEAD}.embedding_dim)"
                )
            cutoffs = derived_cutoffs(num_classes, width, float(div_value))
        cutoffs = check_cutoffs(cutoffs, num_classes, width, float(div_value))
        self.projection = nn.Linear(in_features, width) if width != in_features else None
        self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(width, num_classes, cutoffs, div_value=float(div_value), head_bias=head_bias)

    @property
    def cutoffs(self) -> list[int]:
        """Where the shortlist and each tail cluster end (the last is ``num_classes``)."""
        return list(self.adaptive.cutoffs)

    def tie_to(self, embedding: nn.Embedding) -> None:
        raise ValueError(
            "AdaptiveSoftmax has no num_classes x d class-embedding matrix to tie (its tail clusters score classes "
            "through narrower projections) (set model.init_args.tie_weights: false)"
        )

    def latent(self, hidden: Tensor) -> Tensor:
        """The vector the adaptive softmax reads, flattened, in its weights' dtype: ``(..., in_features) -> (N, d)``.

        PyTorch's module writes its float32 output buffer with the cluster log-probabilities, which
        CPU autocast leaves in bfloat16 (``index_copy_`` refuses the mix), so the module runs with
        autocast off (:meth:`_adaptive_precision`) on a latent cast to its weights' dtype.
        """
        if self.projection is not None:
            hidden = torch.tanh(self.projection(hidden))  # (..., d)
        hidden = F.dropout(hidden, self.dropout, self.training)
        return hidden.reshape(-1, self.adaptive.in_features).to(self.adaptive.head.weight.dtype)  # (N, d)

    def _adaptive_precision(self, h: Tensor) -> torch.autocast:
        """Autocast off around PyTorch's module (see :meth:`latent`)."""
        return torch.autocast(h.device.type, enabled=False)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL: the head softmax for every token, each tail only for the tokens whose
        target is in it (PyTorch's module), ignored positions left out.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``, zero at ``ignore_index``.
        """
        h = self.latent(hidden)  # (N, d)
        flat_target = target.reshape(-1)  # (N,)
        rows = (flat_target != self.ignore_index).nonzero().squeeze(1)  # (n,) scored positions
        with self._adaptive_precision(h):
            target_log_prob = self.adaptive(h.index_select(0, rows), flat_target.index_select(0, rows)).output  # (n,)
        nll = at_least_fp32(h.new_zeros(flat_target.shape[0])).index_put((rows,), at_least_fp32(-target_log_prob))
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)``, float32 at least."""
        h = self.latent(hidden)  # (N, d)
        with self._adaptive_precision(h):
            log_probs = at_least_fp32(self.adaptive.log_prob(h))  # (N, V)
        return log_probs.view(*hidden.shape[:-1], self.num_classes)

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` most probable classes, exact: a class in tail ``c`` has ``log p <= log p(c | h)``,
        so a tail whose cluster probability does not beat a row's ``k``-th best shortlist class is
        not computed for that row. A tracer (:mod:`heads.export`) gets the plain full ``log_prob``.

        Shape:
            hidden ``(..., in_features)``; returns ``(log_probs, indices)``, each ``(..., k)``.
        """
        h = self.latent(hidden)  # (N, d)
        with self._adaptive_precision(h):
            if torch.compiler.is_compiling():  # no data-dependent row selection in an exported graph
                values, indices = at_least_fp32(self.adaptive.log_prob(h)).topk(k, dim=-1)
            else:
                values, indices = self._pruned_log_prob(h, k).topk(k, dim=-1)  # (N, k)
        shape = (*hidden.shape[:-1], k)
        return values.view(shape), indices.view(shape)

    def needed_tails(self, head_log_prob: Tensor, k: int) -> Tensor:
        """``(N, clusters)`` bool: the tails that may hold one of a row's ``k`` best classes, i.e.
        whose cluster log-probability beats the row's ``k``-th best shortlist class (every tail
        when the shortlist has fewer than ``k`` classes).

        Shape:
            head_log_prob ``(N, shortlist + clusters)``, the head softmax's log-probabilities.
        """
        shortlist = self.adaptive.shortlist_size
        clusters = head_log_prob[:, shortlist:]  # (N, C)
        if shortlist < k:
            return torch.ones_like(clusters, dtype=torch.bool)
        kth = head_log_prob[:, :shortlist].topk(k, dim=-1).values[:, -1:]  # (N, 1)
        return clusters > kth

    def _pruned_log_prob(self, h: Tensor, k: int) -> Tensor:
        """Log-probabilities ``(N, V)`` with ``-inf`` for the classes of the tails :meth:`needed_tails` skips."""
        adaptive, shortlist = self.adaptive, self.adaptive.shortlist_size
        head_log_prob = at_least_fp32(F.log_softmax(adaptive.head(h), dim=-1))  # (N, shortlist + C)
        out = head_log_prob.new_full((h.shape[0], self.num_classes), -math.inf)  # (N, V)
        out[:, :shortlist] = head_log_prob[:, :shortlist]
        needed = self.needed_tails(head_log_prob, k)  # (N, C)
        for c, (start, stop) in enumerate(itertools.pairwise(adaptive.cutoffs)):
            rows = needed[:, c].nonzero().squeeze(1)  # (n,)
            if rows.numel() == 0:
                continue
            within = at_least_fp32(F.log_softmax(adaptive.tail[c](h.index_select(0, rows)), dim=-1))  # (n, stop - start)
            out[rows, start:stop] = within + head_log_prob[rows, shortlist + c].unsqueeze(1)  # Eq.: log p(c) + log p(x | c)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cutoffs={self.cutoffs[:-1]}, div_value={self.adaptive.div_value:g}"
