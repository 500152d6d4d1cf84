"""Mixture of Contexts (Yang et al., ICLR 2018, "Breaking the Softmax Bottleneck", §2.5).

MoC mixes ``K`` context vectors *before* a single softmax:

    pi_k = softmax_k(w_pi . g),   h_k = tanh(W_k g),   h = sum_k pi_k h_k,
    log p(x | g) = h . w_x + b_x - logsumexp_v(h . w_v + b_v).

Because the mixed context ``h`` is still one ``d``-wide vector per context, the
log-probability matrix has rank at most ``d + 1`` exactly as for a softmax: MoC has the same
parameters as MoS and serves as the low-rank baseline that isolates the effect of mixing in
probability space (§2.5, Table 6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from heads.base import IGNORE_INDEX, at_least_fp32
from heads.fused_nll import fusable, linear_nll
from heads.mixture import MixtureHead
from heads.registry import register_head


@register_head("moc", size_argument="num_components", family="bottleneck")
class MixtureOfContexts(MixtureHead):
    """Mixture of Contexts output layer (Yang et al. 2018, §2.5).

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: number of context vectors ``K``.
        embedding_dim: width ``d`` of the context vectors and of the (tieable) class
            embeddings; defaults to ``in_features``.
        dropout: dropout on the context vectors ``h_k``.
        bias: learn a per-class bias ``b``.
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int = 15,
        embedding_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, num_components, embedding_dim, dropout, bias, ignore_index)

    def mixed_context(self, hidden: Tensor) -> Tensor:
        """The prior-weighted mixture of the K contexts: ``(..., in_features) -> (N, d)``."""
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        log_prior, contexts = self.log_prior(g), self.contexts(g)  # (N, K), (N, K, d)
        # Mix the contexts first (the defining difference from MoS): one d-vector per token.
        return torch.einsum("nk,nkd->nd", log_prior.exp().to(contexts.dtype), contexts)  # (N, d)

    def logits(self, hidden: Tensor) -> Tensor:
        """Logits of the single softmax over the mixed context, float32.

        Shape:
            ``(..., in_features) -> (..., V)``.
        """
        mixed = self.mixed_context(hidden)  # (N, d)
        return at_least_fp32(self.decoder(mixed)).view(*hidden.shape[:-1], self.num_classes)  # (..., V)

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``, zero at ``ignore_index``.
        """
        mixed = self.mixed_context(hidden)  # (N, d)
        if fusable(mixed, self.decoder.weight):
            nll = linear_nll(mixed, self.decoder.weight, self.decoder.bias, target.reshape(-1), self.ignore_index)
        else:
            logits = at_least_fp32(self.decoder(mixed))  # (N, V)
            nll = F.cross_entropy(logits, target.reshape(-1), ignore_index=self.ignore_index, reduction="none")
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)``."""
        return torch.log_softmax(self.logits(hidden), dim=-1)
