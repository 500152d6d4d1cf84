"""SVD-softmax (Shim et al., NeurIPS 2017): fast inference for a trained softmax.

The decoder ``z = W h + b`` is rewritten through a singular value decomposition of the
bias-augmented weight ``[W | b] = U Σ Vᵀ`` (``V x D'``, ``D' = D + 1`` with a bias):

* ``B = U Σ`` (``V x D'``) and the transformed context ``h̃ = Vᵀ [h; 1]`` give the exact
  logits ``z = B h̃`` (Eq. 2 of the paper);
* **preview** (§3, Algorithm 1): the leading ``W'`` columns of ``B`` carry the largest
  singular values, so ``z̃ = B[:, :W'] h̃[:W']`` ranks the classes cheaply;
* **full view**: the ``N`` classes with the best preview logits are recomputed exactly with
  all ``D'`` columns, and those exact logits replace their preview values.

The distribution this head defines (``log_prob``, ``forward``, ``topk``) is the paper's
output: exact logits for the ``N`` candidates, preview logits for the other classes,
normalised together over all ``V`` classes. With ``preview_width = D'`` every logit is exact and
the head equals the softmax it was built from. It is an inference-only head: the factors are
buffers (not trained); gradients still flow to the input so the head fits the contract.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.registry import register_head
from heads.softmax import Softmax
from heads.validation import check_fraction, check_positive_int


@register_head("svd_softmax", family="sparse", trainable=False)
class SVDSoftmax(OutputHead):
    """SVD-softmax head: preview with the leading singular directions, exact full view of the top-N.

    Args:
        in_features: hidden size of the encoder output.
        num_classes: vocabulary size ``V``.
        preview_fraction: share of the ``D'`` singular dimensions used by the preview
            (the paper's window width ``W = preview_fraction * D'``, rounded up; 0.05 or 0.1).
        num_candidates: ``N``, classes recomputed exactly (default: 5% of ``V``, at least 1).
        ignore_index: target value that contributes zero loss.

    Built standalone it decomposes a freshly initialised :class:`Softmax` (so the registry
    can construct it); the useful way is :meth:`from_softmax` on a trained head.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        preview_fraction: float = 0.1,
        num_candidates: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        self.preview_fraction = check_fraction(preview_fraction, "preview_fraction", "SVDSoftmax")
        if num_candidates is None:
            num_candidates = max(1, math.ceil(0.05 * num_classes))
        check_positive_int(num_candidates, "num_candidates", "SVDSoftmax")
        if num_candidates > num_classes:
            raise ValueError(
                f"SVDSoftmax needs num_candidates <= num_classes={num_classes}, got {num_candidates} "
                f"(set head.init_args.num_candidates)"
            )
        self.num_candidates = num_candidates
        self.projection: nn.Linear | None = None
        self.register_buffer("basis", torch.empty(0))  # Vᵀ, (D', D)
        self.register_buffer("basis_bias", torch.empty(0))  # Vᵀ's bias column, (D',)
        self.register_buffer("scaled_left", torch.empty(0))  # B = U Σ, (V, D')
        self.register_buffer("preview_weight", torch.empty(0))  # B[:, :W'] contiguous, (V, W')
        self._decompose(Softmax(in_features, num_classes))

    @classmethod
    def from_softmax(cls, head: Softmax, preview_fraction: float = 0.1, num_candidates: int | None = None) -> "SVDSoftmax":
        """SVD-softmax of a trained :class:`Softmax` (its optional tanh projection is kept as is)."""
        if not isinstance(head, Softmax):
            raise ValueError(f"SVDSoftmax.from_softmax needs a heads.Softmax, got {type(head).__name__} (train a softmax head first)")
        svd = cls(head.in_features, head.num_classes, preview_fraction, num_candidates, head.ignore_index)
        svd._decompose(head)
        return svd.to(head.decoder.weight.dtype)

    @torch.no_grad()
    def _decompose(self, head: Softmax) -> None:
        weight = head.decoder.weight.detach()  # (V, D)
        dtype = weight.dtype
        if head.decoder.bias is not None:
            # The bias is one more input dimension fed a constant 1 (the paper's augmented W).
            weight = torch.cat([weight, head.decoder.bias.detach().unsqueeze(1)], dim=1)  # (V, D+1)
        D = head.decoder.in_features
        left, singular, right_t = torch.linalg.svd(weight.double(), full_matrices=False)  # (V,D'), (D',), (D',D')
        self.projection = None
        if head.projection is not None:
            self.projection = nn.Linear(head.projection.in_features, D).to(dtype)
            self.projection.load_state_dict(head.projection.state_dict())
            self.projection.requires_grad_(False)
        self.basis = right_t[:, :D].to(dtype).contiguous()  # (D', D)
        self.basis_bias = (right_t[:, D] if right_t.shape[1] > D else right_t.new_zeros(right_t.shape[0])).to(dtype)
        self.scaled_left = (left * singular).to(dtype).contiguous()  # B = U Σ, (V, D')
        self.preview_width = max(1, math.ceil(self.preview_fraction * singular.numel()))
        self.preview_weight = self.scaled_left[:, : self.preview_width].contiguous()  # (V, W')

    @property
    def rank(self) -> int:
        """``D'``: the width of the transformed context ``h̃``."""
        return self.scaled_left.shape[1]

    def transformed(self, hidden: Tensor) -> Tensor:
        """``h̃ = Vᵀ [h; 1]``. Shape: ``(..., in_features) -> (..., D')``."""
        if self.projection is not None:
            hidden = torch.tanh(self.projection(hidden))  # (..., D)
        return F.linear(hidden, self.basis, self.basis_bias)  # (..., D')

    def approximate_logits(self, hidden: Tensor) -> Tensor:
        """Algorithm 1: preview logits for all classes, exact ones for the top-N candidates.

        Shape: ``(..., in_features) -> (..., V)``.
        """
        h = self.transformed(at_least_fp32(hidden))  # (..., D')
        flat = h.reshape(-1, self.rank)  # (M, D')
        preview = F.linear(flat[:, : self.preview_width], self.preview_weight)  # (M, V), preview z̃
        with torch.no_grad():
            candidates = preview.topk(self.num_candidates, dim=1).indices  # (M, N)
        # Full view: every context's candidates scored with all D' columns. One matmul against
        # the union of the batch's candidates, instead of gathering an (M, N, D') block of rows.
        union, position = torch.unique(candidates, return_inverse=True)  # (U,), (M, N)
        exact = F.linear(flat, self.scaled_left[union]).gather(1, position)  # (M, U) -> (M, N)
        logits = preview.scatter(1, candidates, exact)  # (M, V)
        return logits.view(*hidden.shape[:-1], self.num_classes)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Log-probabilities of the SVD-softmax distribution. Shape: ``(..., in_features) -> (..., V)``."""
        return torch.log_softmax(self.approximate_logits(hidden), dim=-1)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL under the SVD-softmax distribution (evaluation; the head is not trained).

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``.
        """
        logits = self.approximate_logits(hidden).reshape(-1, self.num_classes)  # (M, V)
        nll = F.cross_entropy(logits, target.reshape(-1), ignore_index=self.ignore_index, reduction="none")
        return nll.view(target.shape)

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` most probable classes of the SVD-softmax distribution.

        Shape:
            hidden ``(..., in_features)`` -> ``(log_probs, indices)``, each ``(..., k)``.
        """
        if hidden.dim() == 2 and hidden.shape[0] == 1 and k <= self.num_candidates:
            values, indices = self._topk_single(at_least_fp32(hidden[0]), k)
            return values.unsqueeze(0), indices.unsqueeze(0)
        logits = self.approximate_logits(hidden)  # (..., V)
        values, indices = logits.topk(k, dim=-1)
        return values - torch.logsumexp(logits, dim=-1, keepdim=True), indices

    def _topk_single(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        # One context, the latency path: matrix-vector products and no batch bookkeeping.
        if self.projection is not None:
            hidden = torch.tanh(self.projection(hidden))  # (D,)
        h = torch.addmv(self.basis_bias, self.basis, hidden)  # (D',)
        preview = torch.mv(self.preview_weight, h[: self.preview_width])  # (V,)
        candidates = preview.topk(self.num_candidates).indices  # (N,)
        exact = torch.mv(self.scaled_left.index_select(0, candidates), h)  # (N,)
        logits = preview.index_copy_(0, candidates, exact)  # (V,), Algorithm 1's mixed logits
        values, indices = logits.topk(k)
        return values - torch.logsumexp(logits, 0), indices

    def stats(self) -> dict[str, Tensor | float]:
        return {"preview_width": float(self.preview_width), "num_candidates": float(self.num_candidates)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, preview_width={self.preview_width}/{self.rank}, num_candidates={self.num_candidates}"
