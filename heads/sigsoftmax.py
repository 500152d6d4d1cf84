"""SigSoftmax (Kanai, Fujiwara, Yamanaka & Adachi, NeurIPS 2018, "Sigsoftmax: Reanalysis of the
Softmax Bottleneck"; cited by the Mixtape paper as a cheap alternative).

SigSoftmax replaces ``exp(z)`` by ``exp(z) * sigmoid(z)`` (the definition of sigsoftmax in Kanai et al.):

    p(x | g) = exp(z_x) sigmoid(z_x) / sum_v exp(z_v) sigmoid(z_v)
             = softmax(z + log sigmoid(z))_x,

so the log-probability is a non-linear function of the logits and is not confined to the
``d + 1`` rank bound of the softmax. It is computed as ``log_softmax(z + logsigmoid(z))``,
which never overflows. With ``num_components > 1`` it becomes a mixture of SigSoftmaxes
(the mixture of sigsoftmaxes Kanai et al. evaluate alongside MoS), sharing the memory-lean normaliser of :mod:`heads.mos`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.base import IGNORE_INDEX, OutputHead, at_least_fp32, check_dropout, check_positive_int
from heads.mos import MixturePriorStats, auto_chunk_rows, mixture_nll, prior_stats
from heads.registry import register_head


def sigsoftmax_scores(logits: Tensor) -> Tensor:
    """``z + log sigmoid(z)``: the log of SigSoftmax's unnormalised weight ``exp(z) sigmoid(z)``."""
    return logits + F.logsigmoid(logits)


@register_head("sigsoftmax")
class SigSoftmax(MixturePriorStats, OutputHead):
    """SigSoftmax output layer, optionally a mixture of SigSoftmaxes.

    Args:
        in_features: hidden size of the encoder output ``g``.
        num_classes: vocabulary size ``V``.
        num_components: ``K``; 1 is plain SigSoftmax, more is a mixture with a softmax prior
            and ``K`` context vectors ``tanh(W_k g)`` as in MoS.
        embedding_dim: width ``d`` of the context vector(s). With ``K = 1`` and no value the
            logits are a linear map of ``g`` itself; with a value (or ``K > 1``) a ``tanh``
            latent layer of that width comes first (``in_features`` if unset).
        dropout: dropout on the context vector(s).
        bias: learn a per-class bias.
        chunk_size: rows per chunk of the mixture's normaliser (see :mod:`heads.mos`).
        ignore_index: target value that contributes zero loss.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        num_components: int = 1,
        embedding_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        chunk_size: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        super().__init__(in_features, num_classes, ignore_index)
        name = type(self).__name__
        self.num_components = check_positive_int(num_components, "num_components", name)
        if embedding_dim is not None:
            check_positive_int(embedding_dim, "embedding_dim", name)
        if chunk_size is not None:
            check_positive_int(chunk_size, "chunk_size", name)
        self.chunk_size = chunk_size
        self.dropout = check_dropout(dropout, "dropout", name)
        K = self.num_components
        self.embedding_dim = embedding_dim or in_features
        use_latent = K > 1 or embedding_dim is not None
        self.prior = nn.Linear(in_features, K, bias=False) if K > 1 else None
        self.latent = nn.Linear(in_features, K * self.embedding_dim) if use_latent else None
        self.decoder = nn.Linear(self.embedding_dim, num_classes, bias=bias)
        self._last_prior_entropy: Tensor | None = None
        self._last_component_usage: Tensor | None = None

    @property
    def output_embedding_dim(self) -> int:
        return self.embedding_dim

    def tie_to(self, embedding: nn.Embedding) -> None:
        self._check_tie(embedding, self.embedding_dim)
        self.decoder.weight = embedding.weight

    def unigram_bias(self, log_unigram: Tensor) -> Tensor:
        """``b`` with ``b + log sigmoid(b) = log u + C``: SigSoftmax scores ``exp(b) sigmoid(b)``, not ``exp(b)``.

        With ``a = e^b`` the condition is ``a^2 / (a + 1) = e^y`` (``y = log u - max log u``), so
        ``a = (e^y + sqrt(e^{2y} + 4 e^y)) / 2``.
        """
        y = (log_unigram - log_unigram.max()).double().exp()
        return torch.log((y + torch.sqrt(y * y + 4 * y)) / 2).to(log_unigram.dtype)

    def contexts(self, g: Tensor) -> Tensor:
        """Context vectors. Shape: ``(N, in_features) -> (N, K, d)``."""
        if self.latent is None:
            h = g.unsqueeze(1)  # (N, 1, d)
        else:
            h = torch.tanh(self.latent(g)).view(g.shape[0], self.num_components, self.embedding_dim)  # (N, K, d)
        return F.dropout(h, self.dropout, self.training)

    def log_prior(self, g: Tensor) -> Tensor:
        """Mixture prior ``log pi``. Shape: ``(N, in_features) -> (N, K)`` float32."""
        if self.prior is None:
            return at_least_fp32(g.new_zeros(g.shape[0], 1))
        log_prior = torch.log_softmax(at_least_fp32(self.prior(g)), dim=-1)  # (N, K)
        if self.training:
            self._last_prior_entropy, self._last_component_usage = prior_stats(log_prior.detach())
        return log_prior

    def forward(self, hidden: Tensor, target: Tensor) -> Tensor:
        """Per-token NLL.

        Shape:
            hidden ``(..., in_features)``, target ``(...)`` -> ``(...)``, zero at ``ignore_index``.
        """
        if self.num_components == 1:
            scores = sigsoftmax_scores(at_least_fp32(self.decoder(self.contexts(hidden.reshape(-1, self.in_features))[:, 0])))
            nll = F.cross_entropy(scores, target.reshape(-1), ignore_index=self.ignore_index, reduction="none")
            return nll.view(target.shape)
        # Mixture: the same lean normaliser as MoS, with the SigSoftmax weighting inside.
        flat_target = target.reshape(-1)  # (N,)
        valid = flat_target != self.ignore_index
        g = hidden.reshape(-1, self.in_features)[valid]  # (n, in)
        x = flat_target[valid]
        log_prior, h = self.log_prior(g), self.contexts(g)  # (n, K), (n, K, d)
        chunk_tokens = max(1, auto_chunk_rows(self.num_classes, self.chunk_size) // self.num_components)
        token_nll = mixture_nll(
            log_prior, h, self.decoder.weight, self.decoder.bias, x, chunk_tokens, sigmoid_weighting=True
        )  # (n,)
        nll = hidden.new_zeros(flat_target.shape, dtype=token_nll.dtype)
        nll[valid] = token_nll
        return nll.view(target.shape)

    def log_prob(self, hidden: Tensor) -> Tensor:
        """Shape: ``(..., in_features) -> (..., V)`` float32 (token-chunked for mixtures)."""
        g = hidden.reshape(-1, self.in_features)  # (N, in)
        log_prior, h = self.log_prior(g), self.contexts(g)  # (N, K), (N, K, d)
        rows = max(1, auto_chunk_rows(self.num_classes, self.chunk_size) // self.num_components)
        pieces = []
        for start in range(0, g.shape[0], rows):
            scores = sigsoftmax_scores(at_least_fp32(self.decoder(h[start : start + rows])))  # (c, K, V)
            component_log_p = torch.log_softmax(scores, dim=-1)
            pieces.append(torch.logsumexp(log_prior[start : start + rows, :, None] + component_log_p, dim=1))
        out = torch.cat(pieces) if pieces else g.new_zeros(0, self.num_classes, dtype=log_prior.dtype)
        return out.view(*hidden.shape[:-1], self.num_classes)
