"""Full softmax: the baseline output layer whose rank is bounded by its embedding size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32
from heads.fused_nll import fusable, linear_nll
from heads.registry import register_head
from heads.validation import check_dropout, check_positive_int


@register_head("softmax", family="bottleneck")
class Softmax(OutputHead):
    """Linear projection to logits followed by a log-softmax.

    ``log p(x | g) = z_x - logsumexp(z)``, ``z = W h + b``, where ``h = g`` or, with
    ``embedding_dim`` different from ``in_features``, ``h = tanh(P g)`` (the latent layer AWD-LSTM-MoS puts between a
    620-unit LSTM and its 280-wide embedding, so the comparison with MoS is like for like).
    The log-probability matrix over any set of contexts has rank at most ``dim(h) + 1``:
    the softmax bottleneck (Yang et al. 2018, §2.1).

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        embedding_dim: width of the class embeddings; when it differs from ``in_features`` a
            ``tanh`` latent layer projects to it (same name and meaning as in MoS, MoC, Mixtape).
        bias: learn a per-class bias ``b``.
        dropout: dropout on the latent ``h`` before the decoder.
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        embedding_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        if embedding_dim is not None:
            check_positive_int(embedding_dim, "embedding_dim", "Softmax")
        self.dropout = check_dropout(dropout, "dropout", "Softmax")
        width = embedding_dim or in_features
        self.projection = nn.Linear(in_features, width) if width != in_features else None
        self.decoder = nn.Linear(width, num_classes, bias=bias)

    @property
    def output_embedding_dim(self) -> int:
        return self.decoder.in_features

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.decoder.in_features)
        self.decoder.weight = embedding.weight

    def latent(self, hidden: Tensor) -> Tensor:
        """The vector the class embeddings score: ``(..., in_features) -> (..., d)``."""
        if self.projection is not None:
            hidden = torch.tanh(self.projection(hidden))  # (..., d)
        return F.dropout(hidden, self.dropout, self.training)

    def logits(self, hidden: Tensor) -> Tensor:
        """Unnormalised scores ``(..., in_features) -> (..., V)``, in float32 under autocast."""
        return at_least_fp32(self.decoder(self.latent(hidden)))  # (..., V)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``.
        """
        h = self.latent(hidden)
        if fusable(h, self.decoder.weight):  # one pass per row chunk, no (N, V) temporaries
            flat = h.reshape(-1, h.shape[-1])  # (N, d)
            nll = linear_nll(flat, self.decoder.weight, self.decoder.bias, target.reshape(-1), self.ignore_index)
        else:  # autocast / mixed dtypes: the plain path, logits upcast to float32
            flat = at_least_fp32(self.decoder(h)).reshape(-1, self.num_classes)  # (N, V)
            nll = F.cross_entropy(flat, target.reshape(-1), ignore_index=self.ignore_index, reduction="none")
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)``."""
        return torch.log_softmax(self.logits(hidden), dim=-1)

    @torch.no_grad()
    def topk(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        logits = self.logits(hidden)
        values, indices = logits.topk(k, dim=-1)  # the normaliser is shared: rank logits first
        return values - torch.logsumexp(logits, dim=-1, keepdim=True), indices
