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
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32, check_dropout, check_positive_int
from heads.fused_nll import fusable, linear_nll
from heads.mos import MixturePriorStats, prior_stats
from heads.registry import register_head


@register_head("moc")
class MixtureOfContexts(MixturePriorStats, OutputHead):
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
        super().__init__(in_features, num_classes, ignore_index)
        name = type(self).__name__
        self.num_components = check_positive_int(num_components, "num_components", name)
        self.embedding_dim = check_positive_int(embedding_dim or in_features, "embedding_dim", name)
        self.dropout = check_dropout(dropout, "dropout", name)
        K, d = self.num_components, self.embedding_dim
        self.prior = nn.Linear(in_features, K, bias=False)  # w_pi
        self.latent = nn.Linear(in_features, K * d)  # W_k stacked
        self.decoder = nn.Linear(d, num_classes, bias=bias)  # class embeddings w_x, bias b_x
        self._last_prior_entropy: Tensor | None = None
        self._last_component_usage: Tensor | None = None

    @property
    def output_embedding_dim(self) -> int:
        return self.embedding_dim

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.embedding_dim)
        self.decoder.weight = embedding.weight

    def mixed_context(self, hidden: Tensor) -> Tensor:
        """The prior-weighted mixture of the K contexts: ``(..., in_features) -> (N, d)``."""
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        log_prior = torch.log_softmax(at_least_fp32(self.prior(g)), dim=-1)  # (N, K)
        contexts = torch.tanh(self.latent(g)).view(-1, self.num_components, self.embedding_dim)  # (N, K, d)
        contexts = F.dropout(contexts, self.dropout, self.training)
        if self.training:
            self._last_prior_entropy, self._last_component_usage = prior_stats(log_prior.detach())
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
